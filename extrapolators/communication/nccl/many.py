"""A symmetric run's collectives over many groups at once (`ManyCalls`): the
representatives' group and every copy's image of it, one call of the NCCL model
(extrapolators.communication.nccl.model `run_many`, `start_many`), planned once per call and
started as one transfer group."""

from __future__ import annotations

import operator
from types import SimpleNamespace

import numpy as np

from extrapolators.communication.base import P2P_OPS
from extrapolators.communication.nccl import alike


class ManyCalls:
    """The NCCL model's calls over several groups at once.

    Gives: `start(op, groups, nbytes, then, ...)` (the model's `start_many`), `plans(op,
    groups, nbytes, roots, algorithm, sizes)` (each group's plan, their streams as one
    batch and the arrays `start` reads; kept for the same group objects, roots and call)
    and `forget()` (drop what was kept: the network routes otherwise). Its caches hold at
    most MANY_SLOTS GPU slots each.

    Needs: the model (`plan`, `_plan_of`, `analysis`, `net`, `env` and the `choices` it
    counts into)."""

    MANY_SLOTS = 4_000_000  # GPU slots (group members) in the kept calls, per cache

    def __init__(self, model) -> None:
        self.model = model
        self.calls: dict = {}  # (groups, plans, batch) per call, see `plans`
        self.keys: dict = {}  # alike keys per groups met (_group_keys)
        # `plans`' calls by the identity of their lists (groups, roots, sizes), and the GPU
        # slots in them (bounded as `calls`)
        self.same_lists: dict = {}
        self.same_slots = 0

    def forget(self) -> None:
        self.calls.clear()
        self.same_lists.clear()
        self.same_slots = 0

    def start(self, op, groups, nbytes, then, tag="", roots=None, algorithm=None, sizes=None):
        """Start the model's `run_many` collective: all the groups' streams as one
        transfer group (one network update, not one per group). When the last transfer lands (at once if none
        moves), calls `then(ends, end)`: each group's end instant, computed with `run`'s
        float operations (its transfers' last arrival, then what is left of NCCL's
        latency), and the instant the first group's `run` would have returned (its end
        when every group's transfers arrived at its instant, the symmetric case, else the
        landing instant); no event between."""
        roots = roots if roots is not None else [None] * len(groups)
        plans, batch, m = self.plans(op, groups, nbytes, roots, algorithm, sizes)
        choices = self.model.choices
        for k, count in m.choices:
            choices[k] = choices.get(k, 0) + count
        env = self.model.env
        start = env.now
        # per group, as `run` does it: its transfers' last arrival (`last`, when its
        # transfer_all would have fired), then what is left of NCCL's latency after its
        # last byte left (`rest`); the same float operations, element by element

        def landed(records):
            if m.uniform and records is not None:  # every group lands as the first one
                return then(*_uniform_ends(records.end_array()[: m.uniform], m, len(plans), env))
            last = np.full(len(plans), start)
            rest = m.rest.copy()
            if records is not None:
                arrive = arrivals(records)
                last[m.has] = np.maximum.reduceat(arrive, m.first)
                sent = np.maximum.reduceat(arrive - m.path_lat, m.first)
                rest[m.has] -= last[m.has] - sent
            ends = np.where(rest > 0, last + rest, last).tolist()
            then(ends, _first_end(env.now, float(last[0]), float(rest[0]), ends[0]))

        if batch:
            self.model.net.transfer_all_then(batch, landed, tag=tag or op)
        else:
            landed(None)

    def _alike_plans(self, op, groups, nbytes, roots, algorithm) -> list:
        """Each group's plan: groups[0]'s (the representatives') analysed; an image group
        whose analysis would repeat it GPU for GPU (`alike.fingerprints`, the same root
        position) gets it renamed (at 131,072 GPUs, analysing 32,768 tensor-parallel
        groups one by one was ~40 % of a symmetric 3D run); any other is analysed."""
        groups = [tuple(g) for g in groups]
        plans: list = [None] * len(groups)
        m = self.model
        p0 = m.plan(op, groups[0], nbytes, roots[0], algorithm) if len(groups) > 2 else None
        if p0 is not None and alike.renamed(p0, groups[0], groups[0]) is not None:
            keys = self._group_keys(groups)
            same_root = _rooted_alike(roots, groups)
            plans[0] = p0
            for k in range(1, len(groups)):
                if keys[k] is not None and keys[k] == keys[0] and same_root[k]:
                    plans[k] = alike.renamed(p0, groups[0], groups[k])
        rest = [k for k, p in enumerate(plans) if p is None]
        if op not in P2P_OPS:  # (rings' hops routed together; a send/receive takes none)
            m.analysis.prepare([groups[k] for k in rest])
        for k in rest:
            plans[k] = m.plan(op, groups[k], nbytes, roots[k], algorithm)
        return plans

    def _group_keys(self, groups) -> list:
        """`alike.fingerprints` of the groups, kept for the same group objects (a symmetric
        run's images, held by its Symmetry, meet several ops and sizes: a 3D run keyed its 4
        tensor-parallel group lists in 5 calls, now in 4)."""
        ident = tuple(map(id, groups))
        return self._held(self.keys, ident, groups, lambda: alike.fingerprints(self.model, groups))

    def _held(self, cache: dict, key, groups, make):
        """cache[key]'s value where it was made for these very group objects, else `make()`,
        kept with the groups (their ids stay theirs); the least recently used dropped
        beyond MANY_SLOTS GPU slots in the kept groups (not the first 32 calls kept)."""
        hit = cache.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], groups, strict=True)):
            cache[key] = cache.pop(key)  # the most recently used last
            return hit[1]
        value = make()
        cache.pop(key, None)
        cache[key] = (list(groups), value, sum(map(len, groups)))
        slots = sum(entry[2] for entry in cache.values())  # (made on a miss only)
        while slots > self.MANY_SLOTS and len(cache) > 1:
            slots -= cache.pop(next(iter(cache)))[2]
        return value

    def plans(self, op, groups, nbytes, roots, algorithm, sizes=None):
        """(each group's plan, all their streams checked and routed as one batch), kept for
        the same groups (the same tuple objects: a symmetric run's images, held by its
        Symmetry), roots and call: at 131,072 GPUs each of a run's ~1,300 calls over
        32,768 tensor-parallel groups looked up 32,768 plans and checked and routed 131,072
        streams again. The same plans and the same streams in the same order, so the
        same transfers."""
        # the same list objects again (a symmetric run's meetings keep them): at once
        fast = (op, nbytes, algorithm, id(groups), id(roots), id(sizes))
        hit = self.same_lists.get(fast)
        if hit is not None and hit[0] is groups and hit[1] is roots and hit[2] is sizes:
            return hit[3]
        return self._kept(fast, op, groups, nbytes, roots, algorithm, sizes)

    def _kept(self, fast, op, groups, nbytes, roots, algorithm, sizes):
        """`plans` where its lists are new: found or made, then kept under `fast`
        (apart, so that the look-up above makes no closure cells: it runs at every
        collective of a symmetric run)."""
        key = (op, float(nbytes), algorithm, tuple(roots), tuple(map(id, groups)), id(sizes))
        held = groups if sizes is None else [*groups, sizes]  # (the sizes' object kept too)
        out = self._held(
            self.calls,
            key,
            held,
            lambda: self._prepared(op, groups, nbytes, roots, algorithm, sizes),
        )
        same = self.same_lists
        slots = sum(map(len, groups))
        while same and self.same_slots + slots > self.MANY_SLOTS:  # the oldest out
            self.same_slots -= same.pop(next(iter(same)))[4]
        same[fast] = (groups, roots, sizes, out, slots)
        self.same_slots += slots
        return out

    def _prepared(self, op, groups, nbytes, roots, algorithm, sizes=None):
        """`plans` made: the plans, their streams as one batch, the arrays run_many reads."""
        m = self.model
        if sizes is not None:  # an uneven all-to-all: each group's plan as `run` makes it
            plans = [m._plan_of(op, g, nbytes, algorithm=algorithm, sizes=sizes) for g in groups]
        else:
            plans = self._alike_plans(op, groups, nbytes, roots, algorithm)
        streams = [x for p in plans for x in p.streams]
        batch = m.net.batch(streams) if streams else []
        counts = np.array([len(p.streams) for p in plans], np.int64)
        choices: dict = {}
        for p in plans:
            k = (op, p.algo, p.proto)
            choices[k] = choices.get(k, 0) + 1
        out = SimpleNamespace(
            choices=list(choices.items()),
            rest=np.array([p.latency + p.fill for p in plans], float),
            has=counts > 0,  # groups with streams, and where each one's begin in the batch
            first=(np.cumsum(counts) - counts)[counts > 0],
            path_lat=np.array([x for p in plans for x in p.path_latency], float),
        )
        out.uniform = _uniform(batch, counts, out.rest, out.path_lat)
        # the first group's path latencies and latency after, as Python floats
        out.lat0 = out.path_lat[: out.uniform].tolist()
        out.rest0 = float(out.rest[0]) if plans else 0.0
        return plans, batch, out


def _uniform(batch, counts, rest, path_lat) -> int:
    """The number of streams of each group where every group ends as the first: the network
    moves the batch by orbits (each transfer lands with its kept flow: `expand`), every
    group's streams are the same kept flows with the same path latencies, and every group
    has the same latency after; else 0."""
    expand = getattr(batch, "expand", None)
    if expand is None or not len(counts) or counts[0] == 0 or (counts != counts[0]).any():
        return 0
    if (rest != rest[0]).any():
        return 0
    c = int(counts[0])
    e, lat = expand.reshape(-1, c).tolist(), path_lat.reshape(-1, c).tolist()
    first = sorted(zip(e[0], lat[0], strict=True))
    same = all(sorted(zip(a, b, strict=True)) == first for a, b in zip(e, lat, strict=True))
    return c if same else 0


def _uniform_ends(arrive, m, n: int, env) -> tuple:
    """`start_many`'s (ends, end) where every group ends as the first (`_uniform`):
    the first group's, with the same float operations, `arrive` its streams' arrivals
    (a few: in Python floats, the same differences and maxima as numpy's)."""
    a = arrive.tolist()
    last = max(a)
    sent = max(map(operator.sub, a, m.lat0))
    rest = m.rest0 - (last - sent)
    e = last + rest if rest > 0 else last
    return [e] * n, _first_end(env.now, last, rest, e)


def _first_end(now: float, last: float, rest: float, end: float) -> float:
    """When the first group's `run` returns, at the landing instant `now`: after waiting
    what is left of NCCL's latency (`rest`) where its transfers landed now (the same sum
    as a timeout(rest)), else at its end `end` (another group's landed later), or now."""
    if now == last and rest > 0:
        return now + rest
    return max(now, end)


def arrivals(records) -> np.ndarray:
    """The transfers' arrival times as a float array (a transfer_all's records)."""
    if hasattr(records, "end_array"):
        return records.end_array()
    return np.array([r.end for r in records], float)


def _rooted_alike(roots, groups) -> list:
    """Per group, whether its root is at the representatives' root's position."""
    r0 = roots[0]
    if r0 is None:
        return [r is None for r in roots]
    if r0 not in groups[0]:  # (the plan takes the group's first GPU): analysed
        return [True] + [False] * (len(groups) - 1)
    at = groups[0].index(r0)
    return [r is not None and g[at] == r for g, r in zip(groups, roots, strict=True)]
