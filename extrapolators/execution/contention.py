"""Compute slowed while its GPU communicates: NCCL's kernels run on the GPU's own SMs and
memory, so a GEMM that overlaps a collective runs slower than alone (arXiv 2507.03114,
"Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
Learning": 18.9 % slower on average, 40 % at most, over GPT and Llama layers on A100,
H100, MI250 and MI210).

Contract: a GPU's compute progresses at rate 1 while none of its communication is in
flight and at 1 / (1 + slowdown) while any is (one or several: the measurement is of
one collective beside the compute; several are not counted twice). Communication is in
flight on a GPU from the moment one of its streams reaches a collective or a send until
that ends: an NCCL kernel holds its SMs while it waits for its peers too. A receive
is not counted (the sender's send covers the transfer; a pipeline's receive mostly
blocks the compute stream it is on). A run of computes is timed at its start as if
nothing changed; each time its GPU starts or stops communicating, its end moves
(`Contention.comm_started`, `comm_ended`) and the instants inside it are mapped through
the piecewise-linear time it kept (its `Span`, `Span.warp`). A run that never overlapped
ends at exactly the instant the runtime would have given it without contention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import simpy

from perfmodel.host import runs_on_gpu
from triosim.common.schema import option

__all__ = ["Contention", "OverlapOptions", "Span", "slowdown"]

# arXiv 2507.03114's average compute slowdown under overlapped communication
PUBLISHED_SLOWDOWN = 0.189


@dataclass
class OverlapOptions:
    """The `overlap` section: what communication costs the compute it overlaps."""

    compute_slowdown: float | None = option(
        None,
        ge=0.0,
        le=1.0,
        help="compute runs this much slower while its GPU communicates (a collective or "
        "a send in flight: NCCL's kernels take SMs and memory bandwidth); 0: overlap is "
        f"free; unset: {PUBLISHED_SLOWDOWN} (the published average, arXiv 2507.03114) for "
        "traces of a GPU (as host.model auto), 0 for CPU and synthetic traces",
    )


def slowdown(options: OverlapOptions, trace) -> tuple[float, str]:
    """(the compute slowdown a run takes, how it was chosen: the summary's line)."""
    s = options.compute_slowdown
    if s is not None:
        how = "set"
    elif runs_on_gpu(trace):
        s, how = PUBLISHED_SLOWDOWN, "a GPU trace: the published average, arXiv 2507.03114"
    else:
        s, how = 0.0, "not a GPU trace"
    if not s:
        return 0.0, f"free ({how})"
    return s, f"compute {s * 100:g} % slower while its GPU communicates ({how})"


class Span:
    """One run of computes on one stream, from `start` to `end_u` as timed without
    contention (unstretched time u). `points` are the instants its rate changed, as
    (u, real time, slow after it); the real end follows from the last one."""

    __slots__ = ("end_u", "factor", "points", "u0", "r0", "slow")

    def __init__(self, start: float, end_u: float, slow: bool, factor: float):
        self.end_u, self.factor = end_u, factor
        self.u0 = self.r0 = start
        self.slow = slow
        self.points = [(start, start, True)] if slow else []

    def end(self) -> float:
        # (warp's arithmetic for its last segment, so that the event and the logged end
        # are the same double; a run that no change reaches has no Span: its end is the
        # timed one)
        return self.r0 + (self.end_u - self.u0) * (self.factor if self.slow else 1.0)

    def change(self, now: float, slow: bool) -> None:
        """Its GPU started (slow) or stopped communicating at `now` (before the span's
        start, where it waits for its launch: it starts at that rate)."""
        if now <= self.r0:
            self.slow = slow
            self.points.append((self.u0, self.r0, slow))
            return
        gone = now - self.r0
        u = self.u0 + (gone / self.factor if self.slow else gone)
        self.u0, self.r0, self.slow = min(u, self.end_u), now, slow
        self.points.append((self.u0, now, slow))

    def warp(self, instants: np.ndarray | None) -> np.ndarray | None:
        """`instants` (unstretched, within the span) in real time: a new array, or the
        same one where the span never ran slow."""
        if instants is None or not self.points:
            return instants
        us = np.array([p[0] for p in self.points])
        rs = np.array([p[1] for p in self.points])
        rate = np.array([self.factor if p[2] else 1.0 for p in self.points])
        i = np.searchsorted(us, instants, side="right") - 1
        before = i < 0  # before the first change: real time is unstretched time
        i = np.maximum(i, 0)
        out = rs[i] + (instants - us[i]) * rate[i]
        return np.where(before, instants, out)


class Contention:
    """Which GPUs are communicating and which runs of computes each is in the middle of
    (the contract is the module's). The runtime asks `compute` for a run's entry, waits
    on its event and, where the run was slowed, maps its instants through its `Span`; it
    calls `comm_started` / `comm_ended` around every collective and send. A run that no
    change reaches costs a list and its event: its Span is made when a change first finds
    it (or at its start, where its GPU is communicating then)."""

    def __init__(self, env: simpy.Environment, slowdown: float):
        self.env = env
        self.factor = 1.0 + slowdown
        self.at = None  # t -> an event at absolute time t: the runtime's (Runtime._at)
        self._open: dict = {}  # GPU -> communication operations in flight
        # GPU -> [event, start, uncontended end, Span or None] of its runs, some maybe ended
        self._running: dict = {}

    def compute(self, gpu, start: float, end_u: float) -> list:
        """The entry of a run from `start` (now, or later: a launch) whose computes take until `end_u`
        uncontended: wait on entry[0] at once (a change moves the waiters to a new event);
        entry[3] is its Span once it ran slow, else None (its instants are as timed)."""
        running = self._running.get(gpu)
        if running is None:
            running = self._running[gpu] = []
        elif len(running) > 8:  # (runs that ended since the last change: let them go)
            running[:] = [e for e in running if e[0].callbacks is not None]
        if self._open.get(gpu):
            span = Span(start, end_u, True, self.factor)
            entry = [self.at(span.end()), start, end_u, span]
        else:
            entry = [self.at(end_u), start, end_u, None]
        running.append(entry)
        return entry

    def comm_started(self, gpu) -> None:
        n = self._open.get(gpu, 0)
        self._open[gpu] = n + 1
        if n == 0 and self._running.get(gpu):
            self._changed(gpu, True)

    def comm_ended(self, gpu) -> None:
        n = self._open[gpu] - 1
        self._open[gpu] = n
        if n == 0 and self._running.get(gpu):
            self._changed(gpu, False)

    def _changed(self, gpu, slow: bool) -> None:
        """Every run still going on `gpu` changes rate now: its end moves. The event
        already queued cannot leave SimPy's queue, so its waiters move to a new one at the
        new end and the old one fires for nobody."""
        now, keep = self.env.now, []
        for entry in self._running[gpu]:
            ev = entry[0]
            if ev.callbacks is None:  # (ended)
                continue
            span = entry[3]
            if span is None:
                span = entry[3] = Span(entry[1], entry[2], False, self.factor)
            span.change(now, slow)
            new = self.at(span.end())  # (>= now: r0 is now, end_u >= u0)
            new.callbacks, ev.callbacks = ev.callbacks, []
            entry[0] = new
            keep.append(entry)
        self._running[gpu] = keep
