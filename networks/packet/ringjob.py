"""A lock-step ring collective on links no other transfer uses, computed in scalars.

On exclusive links max-min fairness gives every transfer the least capacity (or rate
cap) along its path, the same in every step. So one step, started at t0, is what the
packet network's per-step engine would compute for it alone: transfers with equal rates
move in lock step ("classes"); each round solves, sets a timer at t + min(rem/rate),
subtracts rate x (t' - t), retires those the done rule retires, and each transfer lands one
path latency later; the next step starts when the last one landed. `run_step` evaluates
those same float expressions, once per class instead of once per transfer, so the step
times are those of the per-step engine (bit for bit when nothing else runs).

Rates equal to the least capacity also need the levels to be apart by more than the
solver's merge tolerance (networks.maxmin); rings that fail that take the per-step path.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from networks.groups import node_array

REL_TOL = 1e-9  # a flow with this fraction of its bytes left is done (float round-off)
TIME_TOL = 1e-12  # relative to the clock: shorter remaining times are below its resolution
_MERGE = 1e-12  # networks.maxmin freezes links within this of the lowest share together


@dataclass
class RingPaths:
    """The transfers group[i] -> group[i+1] of one ring and what a ring job needs of them."""

    srcs: list
    dsts: list
    flat: np.ndarray  # link ids of every path, one after another
    nh: np.ndarray  # links per path
    lat: np.ndarray  # latency of every path
    eligible: bool  # exclusive links, finite well-separated rates: a job may run alone
    cls: np.ndarray | None = None  # class (index into rates) of every transfer
    rates: tuple = ()  # bytes/s of each class, ascending
    lats: tuple = ()  # largest path latency in each class
    class_links: tuple = ()  # link ids used by each class
    util: float = 0.0  # highest rate / capacity over the ring's links


def ring_paths(srcs, dsts, routes, capacity: np.ndarray) -> RingPaths:
    """routes: (link ids, latency) per transfer, as the network's route cache gives."""
    paths = [r[0] for r in routes]
    nh = np.fromiter((len(p) for p in paths), np.int64, count=len(paths))
    flat = np.concatenate(paths).astype(np.int64) if paths else np.zeros(0, np.int64)
    lat = np.array([r[1] for r in routes], float)
    p = RingPaths(srcs, dsts, flat, nh, lat, False)
    if not len(nh) or (nh == 0).any() or len(np.unique(flat)) != len(flat):
        return p  # a link used twice: max-min shares it, not the closed form
    starts = np.concatenate(([0], np.cumsum(nh)[:-1]))
    rate = np.minimum.reduceat(capacity[flat], starts)
    levels = np.unique(rate)
    if not np.isfinite(levels).all() or (levels[1:] <= levels[:-1] * (1 + _MERGE) + 1e-300).any():
        return p
    cls = np.searchsorted(levels, rate)
    per_entry = np.repeat(cls, nh)
    p.eligible, p.cls, p.rates = True, cls, tuple(levels.tolist())
    p.lats = tuple(float(lat[cls == k].max()) for k in range(len(levels)))
    p.class_links = tuple(flat[per_entry == k] for k in range(len(levels)))
    p.util = float((np.repeat(rate, nh) / capacity[flat]).max())
    return p


@dataclass
class Step:
    """One step's state at time t: remaining bytes and rate of each class still sending,
    the time each class finished sending (nan: not yet), busy-time increments
    [(dt, classes sending)], and the number of rate solves."""

    t: float
    rem: list
    rate: list
    active: list
    done_at: list
    incs: list
    solves: int


def run_step(t0: float, b: float, rates: tuple, until: float = math.inf) -> Step:
    """The per-step engine on one step of `b` bytes per transfer started at t0, up to the
    last timer at or before `until`. Mirrors networks.packet.engine's `FastEngine.finish`
    and `advance`: new transfers have rate 0 at the first done check."""
    k_all = range(len(rates))
    rem, rate = [b] * len(rates), [0.0] * len(rates)
    done_at = [math.nan] * len(rates)
    active, incs, solves, t = list(k_all), [], 0, t0
    while True:
        tick = TIME_TOL * max(t, 1e-9)
        still = []
        for k in active:
            if rem[k] <= REL_TOL * b or (rate[k] > 0 and rem[k] <= rate[k] * tick):
                done_at[k] = t
            else:
                still.append(k)
        active = still
        if not active:
            return Step(t, rem, rate, active, done_at, incs, solves)
        solves += 1
        for k in active:
            rate[k] = rates[k]
        dt = min(rem[k] / rates[k] for k in active)
        t_new = t + max(dt, 0.0)
        if t_new > until:
            return Step(t, rem, rate, active, done_at, incs, solves)
        d = t_new - t
        if d > 0:
            for k in active:
                rem[k] = rem[k] - rates[k] * d
            incs.append((d, tuple(active)))
        t = t_new


class RingJob:
    """`steps` ring steps of `chunk` bytes started at t0 on free links: every step's start,
    each class's send-finish time, rate solves and busy-time increments per step. `completed` steps are this entry's transfers (records expand from it)."""

    def __init__(self, jid: int, paths: RingPaths, chunk: float, steps: int, tag: str, t0):
        self.id, self.paths, self.chunk, self.steps, self.tag = jid, paths, chunk, steps, tag
        self.starts, self.done_at, self.step_solves, self.step_incs = [], [], [], []
        lats, t = paths.lats, t0
        for _ in range(steps):
            st = run_step(t, chunk, paths.rates)
            self.starts.append(t)
            self.done_at.append(st.done_at)
            self.step_solves.append(st.solves)
            self.step_incs.append(st.incs)
            t = max(a + b for a, b in zip(st.done_at, lats, strict=True))
        self.end = t
        self.completed = 0
        self.alive = True

    def step_at(self, now: float) -> int:
        """The step under way at `now` (the last one started at or before it)."""
        return min(bisect_right(self.starts, now) - 1, self.steps - 1)

    def class_incs(self, k: int, steps: int) -> list:
        """Busy-time increments of class k over the first `steps` steps."""
        return [d for incs in self.step_incs[:steps] for d, act in incs if k in act]

    def columns(self):
        p, s = self.paths, self.completed
        n = len(p.srcs)
        ends = np.array(self.done_at[:s], float).reshape(s, len(p.rates))[:, p.cls] + p.lat[None, :]
        src, dst = node_array(p.srcs), node_array(p.dsts)
        return (
            p.srcs * s if src is None else np.tile(src, s),
            p.dsts * s if dst is None else np.tile(dst, s),
            np.full(n * s, self.chunk),
            np.repeat(np.array(self.starts[:s], float), n),
            ends.ravel(),
            [self.tag] * (n * s),
            np.full(n * s, math.inf),
        )
