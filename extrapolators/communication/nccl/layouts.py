"""Which rings a group's collectives run on: the candidate layouts, and the few worth
timing for a call.

A layout is a first ring order, a prefix of the extra rings NCCL would add over the direct
links the first leaves unused (extrapolators.communication.nccl.system), and whether each ring runs both
ways; every ring carries an equal share of the bytes, as NCCL splits a call evenly over its
channels (a ring that would slow the set down is left out by a shorter prefix).

Groups of up to `EXACT_LIMIT` GPUs in one node whose hops differ (a ring, a mesh, a DGX-1,
a degraded link) have every ring order as a candidate: a set that does not depend on the
bandwidths. A call's time is the least over the candidates, and each candidate's time
grows as any link slows (it depends on the links only through the features below, each a
most-loaded-link load over capacity or a sum of path latencies), so a slower link never
makes a call faster, and a slightly slower one makes it slightly slower (issue 29: a
ring search that weighed hops one by one took a 0.15 % slower link for a reason to route
every hop around it, 3x slower). Other groups have one layout (their ring as
`System.rings` builds it) and its shorter prefixes.

Features, per layout (positions i, j index the group's GPUs; a pair's row is its routed
path's links):
- `eff`: seconds per byte of the ring set at what NCCL believes the links carry (one byte
  per hop: the ring graph's bandwidth is 1 / eff);
- `raw[s]`: the same for the streams of structure s at the links' full bandwidth (the
  wires' bound), s in "ring" (one byte per hop), "tree" (the first ring's order as a
  chain, both ways), ("bcast", root) and ("reduce", root) (each ring cut at the root);
- `lat[s]`: each stream's path latency and whether it crosses the network, from which
  `extra` is the slow-hop latency extrapolators.communication.nccl.model charges.
A call's candidates are the layouts on the Pareto front of (eff, raw, extra) for its
structure and protocol: a layout no better in any of them is never faster.
"""

from __future__ import annotations

from itertools import permutations

import numpy as np

EXACT_LIMIT = 8  # every ring order a candidate up to here: 2,520 at 8 GPUs


def orders(hops: np.ndarray) -> np.ndarray:
    """Every ring order of positions 0..n-1 starting at 0 (rows), one of each pair of
    reverses where the ring runs both ways (every hop's way back as many hops as the way
    there, `hops` (n, n)): a ring run both ways is the same ring either way round."""
    n = len(hops)
    rest = np.array(list(permutations(range(1, n))), np.int64).reshape(-1, n - 1)
    o = np.hstack([np.zeros((len(rest), 1), np.int64), rest])
    keep = (rest[:, 0] < rest[:, -1]) | ~both_ways(hops, o) if n > 2 else np.ones(len(o), bool)
    return o[keep]


def both_ways(hops: np.ndarray, rings: np.ndarray) -> np.ndarray:
    """Per ring (rows of positions): whether every hop's way back is as many hops."""
    a = np.asarray(rings)
    b = np.roll(a, -1, axis=-1)
    return (hops[a, b] == hops[b, a]).all(axis=-1)


def extra_rings(adj: list, first: list, limit: int) -> list[list[int]]:
    """Rings over the direct links (`adj`: position -> set of positions linked both ways)
    that `first` leaves unused, found as extrapolators.communication.nccl.system's `_extra_rings` finds
    them (greedy walks, fewest remaining options first, then `first`'s order): none
    where a hop of `first` is not a direct link."""
    n = len(first)
    hops = list(zip(first, first[1:] + first[:1], strict=True))
    if not all(b in adj[a] for a, b in hops):
        return []
    left = [set(x) for x in adj]
    for a, b in hops:
        left[a].discard(b)
        left[b].discard(a)
    rank = {v: i for i, v in enumerate(first)}
    out: list = []
    while len(out) < limit:
        ring = None
        for start in first[: min(8, n)]:
            path, seen = [start], {start}
            while len(path) < n:
                options = [v for v in left[path[-1]] if v not in seen]
                if not options:
                    break
                nxt = min(
                    options, key=lambda v: (sum(1 for w in left[v] if w not in seen), rank[v])
                )
                path.append(nxt)
                seen.add(nxt)
            if len(path) == n and path[0] in left[path[-1]]:
                ring = path
                break
        if ring is None:
            break
        out.append(ring)
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
            left[a].discard(b)
            left[b].discard(a)
    return out


def candidates(hops: np.ndarray, adj: list, limit: int) -> list:
    """Every layout of a group with `hops` (n, n) hop counts between its GPUs and `adj`
    (position -> set of positions linked directly both ways): per ring order, the first
    ring with a prefix of its extra rings (all of them first), as (rings, both-ways flags).
    Kept for the next group with the same hops and links (`structure`)."""
    n = len(hops)
    every = orders(hops)
    direct = np.zeros((n, n), bool)
    for i, js in enumerate(adj):
        direct[i, list(js)] = True
    # extra rings only where every hop of the first is a direct link; on a complete graph
    # the extra rings of an order are those of 0..n-1 renamed (the walk sees only the
    # links and the order): found once
    all_direct = direct[every, np.roll(every, -1, axis=1)].all(axis=1).tolist()
    complete = bool(direct[~np.eye(n, dtype=bool)].all())
    same = extra_rings(adj, list(range(n)), limit) if complete else None
    flags = both_ways(hops, every).tolist()
    out = []
    for o, flag, d in zip(every.tolist(), flags, all_direct, strict=True):
        if same is not None:
            extra = [[o[i] for i in r] for r in same]
        else:
            extra = extra_rings(adj, o, limit) if d else []
        if not extra:
            out.append(([o], [flag]))
            continue
        rings = [o] + extra
        more = [flag] + both_ways(hops, np.array(extra)).tolist()
        out += [(rings[:k], more[:k]) for k in range(len(rings), 0, -1)]
    return out


_STRUCTURES: dict = {}  # (n, hops, links) -> Shares, the last few groups' (bandwidth-free)
_KEEP = 8


def structure(hops: np.ndarray, adj: list, limit: int) -> Shares:
    """The layouts and their shares of a group, from its hop counts and direct links alone
    (nothing here depends on a bandwidth): kept for the next group, or model, with the same
    (a sweep over bandwidths, a system before and after a link slows down)."""
    key = (len(hops), hops.tobytes(), tuple(tuple(sorted(x)) for x in adj), limit)
    got = _STRUCTURES.get(key)
    if got is None:
        if len(_STRUCTURES) >= _KEEP:
            _STRUCTURES.pop(next(iter(_STRUCTURES)))
        got = _STRUCTURES[key] = Shares(candidates(hops, adj, limit), len(hops))
    return got


class Shares:
    """Per layout (rows), the bytes each ordered pair of positions carries (columns i*n+j)
    in each structure: "ring" (one byte per hop, each ring an equal share, half each way
    where it runs both ways), "tree" (the first ring's order as a chain, both ways),
    ("bcast", root) and ("reduce", root) (each ring cut at the root, away from it or
    towards it); and each ring's hops, way by way (for latency sums along them)."""

    def __init__(self, layouts: list, n: int):
        self.layouts, self.n = layouts, n
        L = len(layouts)
        self.ways = []  # per ring slot and way: (layout ids, hop tails, hop heads)
        ring = np.zeros((L, n * n))
        cuts = []  # (root, layout, pair, share) of each hop into a root, to cut chains there
        for j in range(max(len(r) for r, _ in layouts)):
            ks = np.array([k for k, (r, _) in enumerate(layouts) if len(r) > j], np.int64)
            a = np.array([layouts[k][0][j] for k in ks], np.int64).reshape(len(ks), n)
            b = np.roll(a, -1, axis=1)
            two = np.array([layouts[k][1][j] for k in ks], bool)
            share = np.array([1.0 / len(layouts[k][0]) for k in ks]) / np.where(two, 2, 1)
            kk = np.repeat(ks[:, None], n, axis=1)
            for x, y, on in ((a, b, slice(None)), (b, a, two)):
                idx = x[on] * n + y[on]
                c = np.repeat(share[on][:, None], n, axis=1)
                np.add.at(ring, (kk[on], idx), c)
                cuts.append((y[on], kk[on], idx, c))
                self.ways.append((ks[on], x[on], y[on]))
        self._cuts = cuts
        tree = np.zeros((L, n * n))
        first = np.array([r[0] for r, _ in layouts], np.int64).reshape(L, n)
        rows_k = np.arange(L)[:, None]
        tree[rows_k, first[:, :-1] * n + first[:, 1:]] = 1.0
        tree[rows_k, first[:, 1:] * n + first[:, :-1]] = 1.0
        self.first = first
        self.share = {"ring": ring, "tree": tree}

    def __call__(self, s) -> np.ndarray:
        """(layouts, n*n) bytes per pair of structure s (a chain's made when first asked)."""
        if s not in self.share:
            kind, root = s
            n = self.n
            chain = self.share["ring"].copy()
            for roots, kk, idx, c in self._cuts:
                on = roots == root
                np.add.at(chain, (kk[on], idx[on]), -c[on])
            if kind == "reduce":  # towards the root: every stream the other way
                chain = chain[:, np.arange(n * n).reshape(n, n).T.ravel()]
            self.share[s] = chain
        return self.share[s]


class Features:
    """The features above of a group's layouts (`Shares`), from its per-pair path data.

    rows: (n*n, U) link loads of each ordered pair's path over the U links any path uses;
    cap_raw, cap_eff: (U,) those links' capacities (full, and as NCCL believes them);
    lat, net: (n*n,) each pair's path latency and whether it crosses the network."""

    def __init__(self, shares: Shares, rows, cap_raw, cap_eff, lat, net):
        self.layouts, self.n, self.shares = shares.layouts, shares.n, shares
        self.rows, self.lat, self.net = rows, lat, net
        self.cap_raw = cap_raw
        self.eff = self._unit(shares("ring"), cap_eff)
        self._raw: dict = {}

    def raw(self, s) -> np.ndarray:
        """Per layout: seconds per byte of structure s at the links' full bandwidth."""
        if s not in self._raw:
            self._raw[s] = self._unit(self.shares(s), self.cap_raw)
        return self._raw[s]

    def _unit(self, share: np.ndarray, cap: np.ndarray) -> np.ndarray:
        load = share @ self.rows
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(load > 1e-12, load / cap, 0.0).max(axis=1, initial=0.0)

    def excess(self, hw_intra: float, hw_net: float) -> np.ndarray:
        """(n*n,) each pair's path latency beyond NCCL's per-hop latency for its kind."""
        x = self.lat - np.where(self.net, hw_net, hw_intra)
        return np.where(x > 0.0, x, 0.0)

    def ring_extra(self, excess: np.ndarray, steps: int) -> np.ndarray:
        """Per layout: the worst sum of `steps` consecutive hops' excess along any ring,
        either way it runs (a ring collective's chain of steps)."""
        out = np.zeros(len(self.layouts))
        for ks, x, y in self.shares.ways:
            np.maximum.at(out, ks, window_max(excess[x * self.n + y], steps))
        return out

    def stream_extra(self, s, excess: np.ndarray) -> np.ndarray:
        """Per layout: a chain's slow-hop extra (the n-1 largest excesses of its streams)
        or a tree's (twice the largest)."""
        x = np.where(self.shares(s) > 1e-12, excess[None, :], 0.0)
        if s == "tree":
            return 2 * x.max(axis=1, initial=0.0)
        return -np.sort(-x, axis=1)[:, : self.n - 1].sum(axis=1)


def pareto(*cols: np.ndarray) -> list[int]:
    """Indices of the points no other point is at most in every column and below in one
    (the first of equal points kept), in order of the columns."""
    pts = np.column_stack(cols)
    _, first = np.unique(pts, axis=0, return_index=True)  # rows sorted, the first of equals
    kept: list[int] = []
    for i in first.tolist():
        if kept and (pts[kept] <= pts[i]).all(axis=1).any():
            continue  # a kept point (earlier in the order: not worse first) is no worse
        kept.append(i)
    return kept


def window_max(e: np.ndarray, steps: int):
    """Largest sum of `steps` consecutive entries of the cyclic array e (of each row of
    a 2-D e)."""
    e = np.asarray(e, float)
    one = e.ndim == 1
    e = np.atleast_2d(e)
    n = e.shape[1]
    if n == 0 or steps <= 0:
        out = np.zeros(len(e))
    else:
        full, part = divmod(steps, n)
        c = np.concatenate([np.zeros((len(e), 1)), np.cumsum(np.hstack([e, e]), axis=1)], axis=1)
        partial = (c[:, part : part + n] - c[:, :n]).max(axis=1) if part else 0.0
        out = full * e.sum(axis=1) + partial
    return float(out[0]) if one else out
