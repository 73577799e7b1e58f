"""The packet network's fast engine and its clock (`FastEngine`).

A start (`start`) adds a transfer group's flows to the table and asks for one solve at
this instant (`solve_soon`), after every start queued there; a solve (`finish`) takes the
queued rows, delivers the flows that are done, re-solves the rates (the solver's
`solve_changed`), updates the loads and sets one timer for the next flow to finish; a newer
solve supersedes it (`generation`). Between solves nothing moves but the clock: `advance`
moves every flow forward at its rate. A group alone on its links that one timer would
finish runs as a job instead (networks.packet.groupjobs), outside the table.
"""

from __future__ import annotations

import numpy as np
import simpy

from networks.groups import Group, seq_sum
from networks.packet.groupjobs import GroupJobs
from networks.packet.landing import Landing
from networks.packet.ringjob import REL_TOL as _REL_TOL
from networks.packet.ringjob import TIME_TOL as _TIME_TOL
from networks.packet.ringjobs import RingJobs
from networks.packet.solve import ComponentSolve
from networks.packet.table import FlowTable

# one-row columns shared by point-to-point starts (only ever copied into the table)
_ZERO_I, _ZERO_F = np.zeros(1, np.int64), np.zeros(1)


class FastEngine:
    """The fast engine: the flows in numpy arrays, one solve per instant that changed them,
    one timer for the next flow to finish.

    Gives: `start(g, flat, nh, lat, distinct, alone, footprint)` (a transfer group's flows
    start now: their routes' links `flat`, `nh` per transfer, path latencies `lat`; the
    last three optional), `solve_now()` (the
    solve queued for this instant, at once), `advance()` (the clock moved to now),
    `finish()` (a solve: done flows delivered, rates and loads brought up to date, the
    next timer set); and its parts: `table` (networks.packet.table), `landing`
    (networks.packet.landing), `solver` (networks.packet.solve), `rings`
    (networks.packet.ringjobs) and `groups` (networks.packet.groupjobs).

    Needs: the network (`env`, `capacity`, `links`, `check_solves`, and the counters it
    adds to: `link_bytes`, `link_busy`, `bytes_sent`, `in_flight`, `reallocations`,
    `_log`).
    """

    small_table = 64  # tables of up to this many flows checked in plain Python (`_done`)
    small_adds = 16  # a start's link bytes added in plain Python up to this many entries

    def __init__(self, net) -> None:
        self.net, self.env = net, net.env
        self.table = FlowTable(net.capacity)
        self.landing = Landing(net, self.table)
        self.solver = ComponentSolve(net, self.table, self.landing)
        self.rings = RingJobs(net, self)
        self.groups = GroupJobs(net, self)
        self.last = net.env.now  # the instant the flows were last moved forward to
        self.generation = 0  # solves so far: a timer of an older one does nothing
        self.solve_queued = False  # new flows wait for a solve at this instant
        # the instant of the last done check, and the least remaining time found then
        # (when at tmin_at)
        self.checked = self.tmin_at = None
        self.tmin = np.inf

    def start(
        self, g: Group, flat, nh, lat, distinct: bool = False, alone=None, footprint=None
    ) -> None:
        """Start the transfers of `g` (their routes' links `flat`, `nh` per transfer, path
        latencies `lat`; `distinct`: no link twice in `flat`; `alone`: a callable giving
        what they get alone on their links, networks.packet.groupjobs.Alone, to run as a
        job if they are; `footprint`: a callable giving their
        networks.packet.footprint.Footprint, or None)."""
        self.advance()
        rings, groups, net = self.rings, self.groups, self.net
        fp = footprint() if footprint is not None and len(flat) > self.small_adds else None
        probe = flat if fp is None else fp.links  # (the links: the same answers)
        # (count_nonzero: a call in C, where .any() goes through numpy's Python wrapper)
        if len(rings.jobs) and np.count_nonzero(rings.owner[probe] >= 0):
            rings.split_touched(flat)
        if len(groups.jobs) and np.count_nonzero(groups.owner[probe] >= 0):
            groups.split_touched(flat)
        nb = g.nb
        k = len(nb)
        if distinct:  # each link gets one add: a buffered add is the unbuffered one
            net.link_bytes[flat] += nb[0] if k == 1 else np.repeat(nb, nh)
        elif len(flat) <= self.small_adds:  # the same adds, one at a time, in Python
            lb, links, e = net.link_bytes, flat.tolist(), 0
            for v, h in zip(nb.tolist(), nh.tolist(), strict=True):
                for i in links[e : e + h]:
                    lb[i] += v
                e += h
        elif fp is None or not fp.add_link_bytes(net.link_bytes):
            # one unbuffered add in flow order: the same sums as one add per flow
            np.add.at(net.link_bytes, flat, np.repeat(nb, nh))
        sent = None if fp is None else fp.add_to(net.bytes_sent)
        net.bytes_sent = seq_sum(net.bytes_sent, nb) if sent is None else sent
        net.in_flight += k
        net._log.append(g)
        gid = self.landing.register(g)
        if alone is not None and groups.start(gid, g, flat, nh, lat, alone, probe):
            if self.table.waiting:  # a split job's flows wait for a solve
                self.solve_soon()
            return
        if k == 1:  # a point-to-point send (pipelines: hundreds of thousands at 16k GPUs)
            self.table.add(gid, g, _ZERO_I, nb, _ZERO_F, lat, nh, flat, distinct)
        else:
            self.table.add(gid, g, np.arange(k), nb, np.zeros(k), lat, nh, flat, distinct)
        self.solve_soon()

    def solve_soon(self) -> None:
        """Solve once the events already queued for this instant have run: transfers
        started at one instant by many processes (the pipeline sends of thousands of
        replicas) then cost one solve, not one each. The flows wait in the table; nothing
        moves before the solve, as the clock cannot pass this instant before it."""
        if self.solve_queued:
            return
        self.solve_queued = True
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None
        ev.callbacks.append(self.solve_now)
        self.env.schedule(ev)

    def solve_now(self, _event=None) -> None:
        if self.solve_queued:
            self.solve_queued = False
            self.finish()

    def advance(self) -> None:
        now = self.env.now
        dt = now - self.last
        if dt > 0 and len(self.table.rem):
            t = self.table
            t.rem -= t.rate * dt  # in place: the same floats as rem - rate * dt
            # the links with load > 0 gain dt, the others 0.0 (which leaves them unchanged)
            self.net.link_busy[self.solver.busy_links()] += dt
        self.last = now

    def finish(self) -> None:
        landing = self.landing
        landing.solving = True  # what lands inside the solve waits for its own event
        try:
            self._finish()
        finally:
            landing.solving = False

    def _finish(self) -> None:
        t, solver, check = self.table, self.solver, self.net.check_solves
        self.solve_queued = False  # a timer at this instant solves the queued flows too
        if t.waiting:
            t.take_rows()
        now = self.env.now
        tick = _TIME_TOL * max(now, 1e-9)
        n = len(t.rem)
        if solver.stale is not None and self.checked == now:
            # the other flows were found not done at this instant and have not changed
            cand = solver.stale
            if t.new:
                cand = np.concatenate([cand, np.arange(n - t.new, n)])
            done = cand[self._done(cand, tick)]
        else:
            done = np.flatnonzero(self._done(slice(None), tick))
        if check:
            assert np.array_equal(done, np.flatnonzero(self._done(slice(None), tick)))
        departed = len(done) > 0
        if departed:
            self.landing.deliver(done)
            keep = np.ones(n, bool)
            keep[done] = False
            t.keep(keep)
        self.checked = now
        solver.stale = None
        self.generation += 1
        if not len(t.rem):
            solver.idle()
            t.clear_log()
            self.tmin_at = None
            return
        self.net.reallocations += 1
        peak = self.net.max_utilisation
        touched = solver.solve_changed()
        if touched is None:  # no flow left
            solver.idle()
            self.tmin_at = None
            return
        if len(touched):
            solver.update_loads(touched)
        if check:
            solver.checks.check_loads(peak)
        k = solver.solved_tail
        rem, rate = t.rem, t.rate
        with np.errstate(divide="ignore"):
            if self.tmin_at == now and not departed and k >= 0:
                # only the k flows at the end changed since the last minimum, at this instant
                dt = self.tmin if k == 0 else min(self.tmin, float((rem[-k:] / rate[-k:]).min()))
            else:
                dt = float((rem / rate).min())
            if check:
                assert dt == float((rem / rate).min())
        self.tmin, self.tmin_at = dt, now
        gen = self.generation
        self.env.timeout(max(dt, 0.0)).callbacks.append(lambda _e: self.on_timer(gen))

    def _done(self, sel, tick):
        """Which flows `sel` are done: (almost) no bytes left, no links, or less time left
        than the clock resolves."""
        t = self.table
        if len(t.rem) <= self.small_table:  # a few flows: plain Python, the same comparisons
            rem, rate, nb, nh = t.rem.tolist(), t.rate.tolist(), t.nb.tolist(), t.nh.tolist()
            rows = range(len(rem))[sel] if isinstance(sel, slice) else sel.tolist()
            return np.array(
                [
                    rem[i] <= _REL_TOL * nb[i]
                    or nh[i] == 0
                    or (rate[i] > 0 and rem[i] <= rate[i] * tick)
                    for i in rows
                ],
                bool,
            )
        rem, rate = t.rem[sel], t.rate[sel]
        return (
            (rem <= _REL_TOL * t.nb[sel]) | (t.nh[sel] == 0) | ((rate > 0) & (rem <= rate * tick))
        )

    def on_timer(self, gen) -> None:
        if gen != self.generation:
            return
        self.advance()
        self.finish()
