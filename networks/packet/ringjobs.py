"""Ring collectives as one reservation in the packet network's fast engine (`RingJobs`).

`RingJobs.ring` runs a lock-step ring collective. When the ring's links are exclusive and
carry nothing else, it becomes one `RingJob`: its step times come from
networks.packet.ringjob's scalar loop, its links are reserved, and one event fires at its
end. A transfer that touches a reserved link splits the job first: the steps before the
current one are done (records, link bytes and busy time as the per-step engine counts
them), the current step becomes ordinary flows with the bytes they have left (or arrivals
still to come), and the remaining steps run through `ring` again once it is over.
"""

from __future__ import annotations

import math

import numpy as np
import simpy

from networks.groups import Group, Records, at, chain, repeat_add, seq_sum
from networks.packet.ringjob import RingJob, RingPaths, ring_paths, run_step

_PLAIN = (int, float)


class RingJobs:
    """The fast engine's ring collectives, run as reserved jobs where their links are free.

    Gives: `ring(group, chunk, steps, tag)` (the fast engine's; the network sends the
    reference engine and a subclass that counts deliveries itself to Network's per-step
    ring); `split(job)` when a transfer touches a reserved link (the flow table must have
    been advanced to now); its state, `jobs` (the jobs under way by id) and `owner` (the
    job holding each link, -1 for none); the counters `ring_jobs` and `ring_splits`.

    Needs: the network (`env`, `capacity`, `_gpu_set` and `_check` for the arguments,
    `_route` and `_distances`, and the counters it adds to: `bytes_sent`,
    `bytes_delivered`, `in_flight`, `link_bytes`, `link_busy`, `max_utilisation`,
    `reallocations`, `_log`) and the fast `engine` (networks.packet.engine: `start`, its
    flow table's `add` and `occ`, its landing's `register` and `land_later`: a split
    job's current step becomes flows there).
    """

    def __init__(self, net, engine) -> None:
        self.net, self.env, self.engine = net, net.env, engine
        self.table, self.landing = engine.table, engine.landing
        self.rings: dict = {}  # ring group -> RingPaths
        self.jobs: dict[int, RingJob] = {}  # ring jobs under way
        self.owner = np.full(len(net.links), -1, np.int64)  # job holding each link
        self.ring_jobs = self.ring_splits = 0

    def ring(self, group, chunk: float, steps: int, tag: str = "") -> simpy.Event:
        net = self.net
        group = tuple(group)
        bad = [g for g in group if g not in net._gpu_set]
        if bad or not (type(chunk) in _PLAIN and 0 <= chunk < math.inf):
            net._check(bad[0] if bad else group[0], group[0], chunk)
        done = self.env.event()
        if len(group) < 2:
            return done.succeed()
        self._ring_run(self._ring_paths(group), float(chunk), int(steps), tag, done)
        return done

    def _ring_paths(self, group: tuple) -> RingPaths:
        p = self.rings.get(group)
        if p is None:
            net = self.net
            srcs = list(group)
            dsts = srcs[1:] + srcs[:1]
            net._distances(srcs)
            routes = [net._route(s, d) for s, d in zip(srcs, dsts, strict=True)]
            p = self.rings[group] = ring_paths(srcs, dsts, routes, net.capacity)
        return p

    def _ring_run(self, p: RingPaths, chunk, steps, tag, done) -> None:
        """The remaining `steps`: one job if the links are free, else one ordinary step
        and the question again when it is over."""
        if steps <= 0:
            done.succeed()
            return
        if p.eligible and self._free(p.flat):
            self._start_job(p, chunk, steps, tag, done)
            return
        n = len(p.srcs)
        g = Group(
            p.srcs,
            p.dsts,
            np.full(n, chunk),
            np.full(n, math.inf),
            self.env.now,
            tag,
            done=self.env.event(),
        )
        g.done.callbacks.append(lambda _e: self._ring_run(p, chunk, steps - 1, tag, done))
        self.engine.start(g, p.flat, p.nh, p.lat)

    def _free(self, flat) -> bool:
        """No reservation (a ring's or a group's) and no flow in the table on these links."""
        return not (
            (self.owner[flat] >= 0).any()
            or self.table.occ[flat].any()
            or not self.engine.groups.free(flat)
        )

    def _start_job(self, p: RingPaths, chunk, steps, tag, done) -> None:
        net = self.net
        job = RingJob(self.ring_jobs, p, chunk, steps, tag, self.env.now)
        job.done = done
        self.ring_jobs += 1
        self.jobs[job.id] = job
        self.owner[p.flat] = job.id
        net.in_flight += len(p.srcs)  # the current step's transfers
        if any(job.step_solves):  # each step's solve sees the same rates
            net.max_utilisation = max(net.max_utilisation, p.util)
        net._log.append(job)
        at(self.env, job.end, lambda _e: self._job_done(job))

    def _job_done(self, job: RingJob) -> None:
        if not job.alive:
            return  # split earlier
        self._account(job, job.steps, job.steps)
        self.net.in_flight -= len(job.paths.srcs)
        self._release(job)
        job.done.succeed()

    def _account(self, job: RingJob, finished: int, started: int) -> None:
        """Counters for `finished` whole steps and the link bytes of `started` steps (the
        per-step engine counts a step's link bytes when it starts), in the per-step
        engine's order of additions."""
        net = self.net
        p, n, c = job.paths, len(job.paths.srcs), job.chunk
        net.link_bytes[p.flat] = chain(net.link_bytes[p.flat], np.full(started, c))
        for k, links in enumerate(p.class_links):
            net.link_busy[links] = chain(net.link_busy[links], job.class_incs(k, finished))
        net.bytes_sent = repeat_add(net.bytes_sent, c, n * started)
        net.bytes_delivered = repeat_add(net.bytes_delivered, c, n * finished)
        net.reallocations += sum(job.step_solves[:finished])
        job.completed = finished

    def _release(self, job: RingJob) -> None:
        self.owner[job.paths.flat] = -1
        job.alive = False
        del self.jobs[job.id]

    def split(self, job: RingJob) -> None:
        """Turn the job into what the per-step engine would hold now (the flow table must
        have been advanced to now): see the module docstring."""
        net = self.net
        now, p, c = self.env.now, job.paths, job.chunk
        n = len(p.srcs)
        s = job.step_at(now)
        st = run_step(job.starts[s], c, p.rates, until=now)
        self._account(job, s, s + 1)
        net.reallocations += st.solves
        for k, links in enumerate(p.class_links):
            incs = [d for d, act in st.incs if k in act]
            if k in st.active and now > st.t:
                incs.append(now - st.t)
            net.link_busy[links] = chain(net.link_busy[links], incs)
        g = Group(
            p.srcs,
            p.dsts,
            np.full(n, c),
            np.full(n, math.inf),
            job.starts[s],
            job.tag,
            done=self.env.event(),
        )
        done_at = np.array(st.done_at, float)[p.cls]
        sent = ~np.isnan(done_at)
        arrival = done_at + p.lat
        past = sent & (arrival < now)
        g.ends[past] = arrival[past]
        g.pending -= int(past.sum())
        net.bytes_delivered = seq_sum(net.bytes_delivered, g.nb[past])
        net.in_flight -= int(past.sum())
        self.ring_splits += 1
        self._release(job)
        net._log.append(g)
        left, outer = job.steps - s - 1, job.done
        g.done.callbacks.append(lambda _e: self._ring_run(p, c, left, job.tag, outer))
        if g.pending == 0:
            g.done.succeed(Records(g))
            return
        gid = self.landing.register(g)
        later = np.flatnonzero(sent & ~past)
        if len(later):
            self.landing.land_later(arrival[later], None, np.full(len(later), gid), later)
        sending = np.flatnonzero(~sent)
        if len(sending):
            rem = np.array(st.rem, float)[p.cls[sending]]
            rate = np.array(st.rate, float)[p.cls[sending]]
            if now > st.t:
                rem = rem - rate * (now - st.t)
            flat = p.flat[np.repeat(~sent, p.nh)]
            self.table.add(gid, g, sending, rem, rate, p.lat[sending], p.nh[sending], flat)

    def split_touched(self, flat: np.ndarray) -> None:
        """Split the jobs holding any of the links `flat`, in order of first touch."""
        owner = self.owner[flat]
        for jid in dict.fromkeys(owner[owner >= 0].tolist()):
            self.split(self.jobs[jid])
