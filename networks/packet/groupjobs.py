"""Transfer groups alone on their links, in closed form (`GroupJobs`).

A transfer group whose links carry nothing else (no flow in the table, no ring or group
job) gets from the engine, while nothing else touches those links, its own max-min rates
(the component solve of its flows alone, networks.maxmin), one timer at t1 = t0 +
min(bytes / rate), and at that instant the done rule. When that one timer retires every
flow, such a group runs as a job: its links are reserved, one event fires at t1 (its
links freed, its busy time counted, and each transfer set to land one path latency later
through the engine's own Landing, as the table's delivery sets them), and no row enters
the flow table and no solve runs. A transfer that touches a reserved link (up to t1
itself) first splits the job: its flows enter the table with the bytes they have left and
their rates, as the engine would hold them then (at t1 nothing is left: the next solve
lands them). Groups whose timer would leave some flow unfinished (unequal shares: a second
round) take the table.

The floats are the engine's for the group alone, so a job gives its times bit for bit when
nothing else runs; when other flows elsewhere start or end meanwhile, the engine would
have moved the group's bytes forward at each of those instants, and its times differ from
a job's by round-off (as ring jobs', networks.packet.ringjobs). What differs besides:
`reallocations` counts one solve per job (the table counts another when the group leaves
a table that still holds flows), and the rows of a split job join the table after those
already there (`flow_rates` gives the rates in the order the groups started). A group's
`Alone` is made once per batch (networks.packet.network `_Batch.alone`), from the
capacities as they are then: a batch does not outlive a change of them (a run by orbits
sets a class's capacity when the class is first routed, before its batches are made;
`by_orbits(None)` comes with the communication model's `forget_batches`).
"""

from __future__ import annotations

import numpy as np

from networks.groups import Group, at
from networks.maxmin import max_min_rates
from networks.packet.landing import arrival_runs
from networks.packet.ringjob import REL_TOL, TIME_TOL
from networks.packet.table import FlowTable


class Alone:
    """What a group of transfers gets alone on its links (made once per batch, read by
    every job of it): the max-min `rate` of each flow, `dt` = min(bytes / rate) (the
    engine's first timer), the distinct `links` and the peak utilisation `util` their
    loads give; `ok` False where a job cannot run it (a rate 0 or infinite, a flow of 0
    bytes or no link)."""

    __slots__ = ("ok", "rate", "dt", "links", "util", "nb", "ids", "lat0", "small", "lat_runs")
    small_flows = 8  # groups of up to this many flows: the done rule in Python floats

    def __init__(self, capacity: np.ndarray, flat, nh, nb, maxr, lat, nan_util: bool) -> None:
        n = len(nh)
        self.nb, self.ids = nb, np.arange(n)
        # one path latency for all (the common case: one landing at t1 + it), else None
        self.lat0 = float(lat[0]) if n and (lat == lat[0]).all() else None
        # else the flows of each distinct latency (Landing's runs of the arrivals, as long
        # as t1 + latency keeps them apart) and that latency
        self.lat_runs = None
        if self.lat0 is None and n:
            self.lat_runs = [(float(lat[r[0]]), r) for r in arrival_runs(lat)]
        capped = np.flatnonzero(maxr < np.inf)
        if len(capped):  # the engine's incidence: a capped flow's private link after its path
            rows, ext = FlowTable.with_private_links(flat, nh, capped, len(capacity))
            cap = np.concatenate([capacity, maxr[capped]])
        else:
            rows, ext, cap = flat, nh, capacity
        self.rate = max_min_rates(rows, np.repeat(np.arange(n), ext), n, cap)
        rate = self.rate
        self.ok = bool(
            n and (nh > 0).all() and (nb > 0).all() and np.isfinite(rate).all() and (rate > 0).all()
        )
        self.dt = float((nb / rate).min()) if self.ok else 0.0
        self.links, inv = np.unique(flat, return_inverse=True)
        self.util = 0.0
        fin = np.isfinite(capacity[self.links])
        if self.ok and fin.any() and not nan_util:  # (a link of capacity 0: no peak kept)
            # the solve's loads: each link's flows summed in their order (bincount)
            load = np.bincount(inv.reshape(-1), weights=np.repeat(rate, nh))
            self.util = float((load[fin] / capacity[self.links][fin]).max())
        # (bytes, rate) of each flow of a small group, for the done rule in Python floats
        small = n <= self.small_flows
        self.small = list(zip(nb.tolist(), rate.tolist(), strict=True)) if small else None


class GroupJob:
    """One group under way as a job: started at t0, its flows done sending at t1."""

    __slots__ = ("id", "gid", "g", "flat", "nh", "lat", "alone", "t0", "t1", "alive")

    def __init__(self, jid, gid, g, flat, nh, lat, alone, t0, t1) -> None:
        self.id, self.gid, self.g = jid, gid, g
        self.flat, self.nh, self.lat, self.alone = flat, nh, lat, alone
        self.t0, self.t1 = t0, t1
        self.alive = True  # holds its links (until its timer at t1, or a split)


class GroupJobs:
    """The fast engine's transfer groups run as jobs where they are alone (the module's
    docstring says when and what a job computes).

    Gives: `start(gid, g, flat, nh, lat, alone, probe)` (True: `g`, registered with the landing
    as `gid`, now runs as a job; False: it must take the table), `split_touched(flat)`
    (split the jobs holding any of these links: the table must have been advanced to
    now), `split_all()`, `free(flat)` (no job holds these links); its state, `jobs` (by
    id) and `owner` (the job holding each link, -1 for none); the counters `group_jobs`
    and `group_splits`.

    Needs: the network (`env`, `capacity`, and the counters it adds to: `link_busy`,
    `max_utilisation`, `reallocations`) and the fast `engine` (its flow table's `add` and
    `occ`, its landing's `land_one`, its solver's `nan_util`, its ring jobs' `owner`).
    """

    enabled = True  # tests turn jobs off to see the table's way

    def __init__(self, net, engine) -> None:
        self.net, self.env, self.engine = net, net.env, engine
        self.jobs: dict[int, GroupJob] = {}
        self.owner = np.full(len(net.links), -1, np.int64)
        self.group_jobs = self.group_splits = 0

    def alone(self, flat, nh, nb, maxr, lat) -> Alone:
        return Alone(self.net.capacity, flat, nh, nb, maxr, lat, self.engine.solver.nan_util)

    def start(self, gid: int, g: Group, flat, nh, lat, alone, probe=None) -> bool:
        """`alone`: a callable giving the group's Alone (made only where the links are
        free). The engine calls it once it has split the ring and group jobs holding these
        links (their flows are then in the table). `probe`: the distinct links of `flat`
        where known (fewer to look at), else `flat`."""
        probe = flat if probe is None else probe
        if not self.enabled or np.count_nonzero(self.engine.table.occ[probe]):  # (no wrapper)
            return False
        alone = alone()
        if not alone.ok:
            return False
        t0 = self.env.now
        t1 = t0 + alone.dt  # the engine's timer (timeout(dt) from t0)
        d = t1 - t0  # its advance at the timer
        tick = TIME_TOL * max(t1, 1e-9)
        if alone.small is not None and g.nb is alone.nb:  # the same float operations
            for b, r in alone.small:
                rem = b - r * d
                if not (rem <= REL_TOL * b or rem <= r * tick):
                    return False  # some flow would need another round: the table's way
        else:
            rem = g.nb - alone.rate * d
            if not ((rem <= REL_TOL * g.nb) | (rem <= alone.rate * tick)).all():
                return False
        net = self.net
        net.reallocations += 1  # the solve at its start (the table's would count one more
        # at its end when other flows are in the table then)
        net.max_utilisation = max(net.max_utilisation, alone.util)
        job = GroupJob(self.group_jobs, gid, g, flat, nh, lat, alone, t0, t1)
        self.group_jobs += 1
        self.jobs[job.id] = job
        self.owner[alone.links] = job.id  # (its distinct links: the same marks)
        at(self.env, t1, lambda _e: self._timer(job))
        return True

    def _timer(self, job: GroupJob) -> None:
        """The job's timer at t1: done sending, its links free; each transfer lands one
        path latency later, set now as the table's delivery sets it (so landings that
        share an instant come in the order the table gives them)."""
        if not job.alive:
            return  # split earlier (at t1 too: its flows, done, land from the table)
        self._release(job)
        self.net.link_busy[job.alone.links] += job.t1 - job.t0
        self._land(job)

    def _land(self, job: GroupJob) -> None:
        alone, env = job.alone, self.env
        if alone.lat0 is not None:  # (the table's timeout(lat) from t1: t1 + lat)
            at(env, job.t1 + alone.lat0, lambda _e: self._landed(job, None))
            return
        runs = alone.lat_runs
        times = [job.t1 + x for x, _ in runs]
        if len(set(times)) == len(times):  # the latencies' runs are the arrivals' runs
            runs = [(t, idx) for t, (_, idx) in zip(times, runs, strict=True)]
        else:
            arrival = job.t1 + job.lat
            runs = [(float(arrival[idx[0]]), idx) for idx in arrival_runs(arrival)]
        for t, idx in runs:
            at(env, t, lambda _e, idx=idx: self._landed(job, idx))

    def _landed(self, job: GroupJob, idx) -> None:
        """Transfers of the job (None: all) land now."""
        self.engine.landing.land_one(job.gid, job.alone.ids if idx is None else idx)

    def _release(self, job: GroupJob) -> None:
        self.owner[job.alone.links] = -1
        job.alive = False
        del self.jobs[job.id]

    def split(self, job: GroupJob) -> None:
        """Turn the job into the flows the engine would hold now (the table advanced to
        now, at most t1: at t1 they have nothing left, and the next solve lands them):
        the bytes left and the rates, their busy time so far counted."""
        now = self.env.now
        self._release(job)
        self.group_splits += 1
        a = job.alone
        d = now - job.t0
        if d > 0:
            self.net.link_busy[a.links] += d
            rem = job.g.nb - a.rate * d
        else:
            rem = job.g.nb.copy()
        n = len(job.nh)
        self.engine.table.add(
            job.gid, job.g, np.arange(n), rem, a.rate.copy(), job.lat, job.nh, job.flat
        )

    def free(self, flat: np.ndarray) -> bool:
        """No job holds any of the links `flat`."""
        return not (self.owner[flat] >= 0).any()

    def split_touched(self, flat: np.ndarray) -> None:
        """Split the jobs holding any of the links `flat`, in order of first touch."""
        owner = self.owner[flat]
        for jid in dict.fromkeys(owner[owner >= 0].tolist()):
            self.split(self.jobs[jid])

    def split_all(self) -> None:
        for job in list(self.jobs.values()):
            self.split(job)
