"""Ring collectives as one reservation in the packet network's fast engine (a mixin).

`ring` runs a lock-step ring collective. When the ring's links are exclusive and carry
nothing else, it becomes one `RingJob`: its step times come from networks.packet.ringjob's
scalar loop, its links are reserved, and one event fires at its end. A transfer that
touches a reserved link splits the job first: the steps before the current one are done
(records, link bytes and busy time as the per-step engine counts them), the current step
becomes ordinary flows with the bytes they have left (or arrivals still to come), and the
remaining steps run through `ring` again once it is over.

What it provides: `ring` (the fast engine's; the reference engine and a subclass that counts
deliveries itself take Network's per-step ring), `_split(job)` for the flow table when a
transfer touches a reserved link, the counters `ring_jobs` and `ring_splits`, and its state
(`_rings`, `_jobs`, `_owner`: the job holding each link, -1 for none), made by
`_init_rings()`. What the host provides: `env`, `options`, `links`, `capacity`, `_gpu_set`,
`_route` and `_distances`, the network's counters (`bytes_sent`, `bytes_delivered`,
`in_flight`, `link_bytes`, `link_busy`, `max_utilisation`, `reallocations`, `_log`), the
landing's `_register`, `_per_record` and `_land_later`, the engine's `_start_fast`, and the
flow table's `_add_flows` and `_occ` (a split job's current step becomes flows there).
"""

from __future__ import annotations

import math

import numpy as np
import simpy

from networks.groups import Group, Records, at, chain, repeat_add, seq_sum
from networks.packet.ringjob import RingJob, RingPaths, ring_paths, run_step

_PLAIN = (int, float)


class RingJobs:
    def _init_rings(self) -> None:
        self._rings: dict = {}  # ring group -> RingPaths
        self._jobs: dict[int, RingJob] = {}  # ring jobs under way
        self._owner = np.full(len(self.links), -1, np.int64)  # job holding each link
        self.ring_jobs = self.ring_splits = 0

    def ring(self, group, chunk: float, steps: int, tag: str = "") -> simpy.Event:
        if self.options.engine == "reference" or self._per_record:
            return super().ring(group, chunk, steps, tag)
        group = tuple(group)
        bad = [g for g in group if g not in self._gpu_set]
        if bad or not (type(chunk) in _PLAIN and 0 <= chunk < math.inf):
            self._check(bad[0] if bad else group[0], group[0], chunk)
        done = self.env.event()
        if len(group) < 2:
            return done.succeed()
        self._ring_run(self._ring_paths(group), float(chunk), int(steps), tag, done)
        return done

    def _ring_paths(self, group: tuple) -> RingPaths:
        p = self._rings.get(group)
        if p is None:
            srcs = list(group)
            dsts = srcs[1:] + srcs[:1]
            self._distances(srcs)
            routes = [self._route(s, d) for s, d in zip(srcs, dsts, strict=True)]
            p = self._rings[group] = ring_paths(srcs, dsts, routes, self.capacity)
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
        self._start_fast(g, p.flat, p.nh, p.lat)

    def _free(self, flat) -> bool:
        """No reservation and no flow in the table on these links."""
        return not ((self._owner[flat] >= 0).any() or self._occ[flat].any())

    def _start_job(self, p: RingPaths, chunk, steps, tag, done) -> None:
        job = RingJob(self.ring_jobs, p, chunk, steps, tag, self.env.now)
        job.done = done
        self.ring_jobs += 1
        self._jobs[job.id] = job
        self._owner[p.flat] = job.id
        self.in_flight += len(p.srcs)  # the current step's transfers
        if any(job.step_solves):  # each step's solve sees the same rates
            self.max_utilisation = max(self.max_utilisation, p.util)
        self._log.append(job)
        at(self.env, job.end, lambda _e: self._job_done(job))

    def _job_done(self, job: RingJob) -> None:
        if not job.alive:
            return  # split earlier
        self._account(job, job.steps, job.steps)
        self.in_flight -= len(job.paths.srcs)
        self._release(job)
        job.done.succeed()

    def _account(self, job: RingJob, finished: int, started: int) -> None:
        """Counters for `finished` whole steps and the link bytes of `started` steps (the
        per-step engine counts a step's link bytes when it starts), in the per-step
        engine's order of additions."""
        p, n, c = job.paths, len(job.paths.srcs), job.chunk
        self.link_bytes[p.flat] = chain(self.link_bytes[p.flat], np.full(started, c))
        for k, links in enumerate(p.class_links):
            self.link_busy[links] = chain(self.link_busy[links], job.class_incs(k, finished))
        self.bytes_sent = repeat_add(self.bytes_sent, c, n * started)
        self.bytes_delivered = repeat_add(self.bytes_delivered, c, n * finished)
        self.reallocations += sum(job.step_solves[:finished])
        job.completed = finished

    def _release(self, job: RingJob) -> None:
        self._owner[job.paths.flat] = -1
        job.alive = False
        del self._jobs[job.id]

    def _split(self, job: RingJob) -> None:
        """Turn the job into what the per-step engine would hold now (the flow table must
        have been advanced to now): see the module docstring."""
        now, p, c = self.env.now, job.paths, job.chunk
        n = len(p.srcs)
        s = job.step_at(now)
        st = run_step(job.starts[s], c, p.rates, until=now)
        self._account(job, s, s + 1)
        self.reallocations += st.solves
        for k, links in enumerate(p.class_links):
            incs = [d for d, act in st.incs if k in act]
            if k in st.active and now > st.t:
                incs.append(now - st.t)
            self.link_busy[links] = chain(self.link_busy[links], incs)
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
        self.bytes_delivered = seq_sum(self.bytes_delivered, g.nb[past])
        self.in_flight -= int(past.sum())
        self.ring_splits += 1
        self._release(job)
        self._log.append(g)
        left, outer = job.steps - s - 1, job.done
        g.done.callbacks.append(lambda _e: self._ring_run(p, c, left, job.tag, outer))
        if g.pending == 0:
            g.done.succeed(Records(g))
            return
        gid = self._register(g)
        later = np.flatnonzero(sent & ~past)
        if len(later):
            self._land_later(arrival[later], None, np.full(len(later), gid), later)
        sending = np.flatnonzero(~sent)
        if len(sending):
            rem = np.array(st.rem, float)[p.cls[sending]]
            rate = np.array(st.rate, float)[p.cls[sending]]
            if now > st.t:
                rem = rem - rate * (now - st.t)
            flat = p.flat[np.repeat(~sent, p.nh)]
            self._add_flows(gid, g, sending, rem, rate, p.lat[sending], p.nh[sending], flat)
