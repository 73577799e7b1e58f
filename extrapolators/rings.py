"""Ring orders: which GPU follows which in a ring collective.

A ring is as fast as its slowest hop, so the order maximises the slowest hop's bandwidth
(a hop's bandwidth is its routed path's bottleneck, the smaller of the two directions since
a ring runs both ways), then minimises the summed hop latency, then the summed hop count.
Greedy nearest neighbour under that key, then 2-opt moves that remove the worst hop, then
2-opt moves that cut latency; the builder's known ring (`graph.graph['ring']`) competes as a
candidate. Above `DENSE_LIMIT` GPUs nothing N x N is built: the builder's ring is taken
as it is, or the greedy walk computes one row of hop metrics per step.
"""

from __future__ import annotations

import numpy as np

from networks.routing import Routes

DENSE_LIMIT = 256
_NET, _LAT = 2**48, 2**28  # networks.routing's packing: network hops, ns of latency


def hop_rows(graph, routes: Routes, sources, targets):
    """For each source, arrays over `targets` of (bottleneck bandwidth, latency in s, hops)
    along the routed path: one shortest-path tree per source, or a big switch's spread
    shared by the GPUs under it where that gives the same (`Routes.hub_hop_rows`). The
    targets' paths are walked back up the tree together, a hop of every unfinished path
    per step (O(targets x hops) in numpy: the bottleneck is a min, the same in any order)."""
    shared = routes.hub_hop_rows(sources, targets)
    if shared is not None:  # GPUs under one big switch: its spread serves them all
        return [(b, _latency(d), h) for b, d, h in shared]
    idx = routes.node_index
    t_idx = np.array([idx[t] for t in targets], dtype=np.int64)
    bandwidth = routes.link_values("bandwidth")
    out = []
    dist, pred = routes.trees(sources, targets)
    for row, prow, s in zip(np.atleast_2d(dist), np.atleast_2d(pred), sources, strict=True):
        d = row[t_idx]
        ok = np.isfinite(d)
        bott = np.full(len(t_idx), np.inf)
        hops = np.zeros(len(t_idx))
        at = np.flatnonzero(ok)  # the targets whose walk goes on, and where each has got to
        v = t_idx[at]
        while len(at):
            p = prow[v].astype(np.int64)
            on = p >= 0  # a walk ends at the tree's root (no predecessor)
            at, v, p = at[on], v[on], p[on]
            if not len(at):
                break
            bott[at] = np.minimum(bott[at], bandwidth[routes.link_ids(p, v)])
            hops[at] += 1
            v = p
        lat = _latency(d)
        b = np.where(ok, bott, 0.0)
        b[t_idx == idx[s]] = np.inf
        out.append((b, lat, np.where(ok, hops, np.inf)))
    return out


def _latency(d: np.ndarray) -> np.ndarray:
    """Seconds of summed latency in packed distances (inf where there is no path)."""
    ok = np.isfinite(d)
    return np.where(ok, np.floor(np.mod(np.where(ok, d, 0), _NET) / _LAT) * 1e-9, np.inf)


def _metrics(graph, group, routes):
    rows = hop_rows(graph, routes, group, group)
    bw = np.array([r[0] for r in rows])
    lat = np.array([r[1] for r in rows])
    hops = np.array([r[2] for r in rows])
    return np.minimum(bw, bw.T), lat, hops


def _key(order, bw, lat, hops):
    a, b = np.asarray(order), np.roll(order, -1)
    return (-bw[a, b].min(), lat[a, b].sum(), hops[a, b].sum())


def _greedy(n, bw, lat, hops, start=0):
    order, left = [start], np.ones(n, bool)
    left[start] = False
    pos = np.arange(n)
    while left.any():
        h = order[-1]
        cand = np.flatnonzero(left)
        k = np.lexsort((pos[cand], hops[h, cand], lat[h, cand], -bw[h, cand]))[0]
        order.append(int(cand[k]))
        left[cand[k]] = False
    return order


def _two_opt(order, bw, lat, hops, rounds=4):
    """Moves that replace the slowest hop, then moves that shorten the summed latency."""
    order = list(order)
    n = len(order)
    for _ in range(n):  # raise the bottleneck while some 2-opt move can
        a = np.asarray(order)
        b = np.roll(a, -1)
        worst = bw[a, b].min()
        i = int(np.flatnonzero(bw[a, b] == worst)[0])
        j = np.arange(n)
        j = j[(j != i) & (j != (i + 1) % n) & (j != (i - 1) % n)]
        # replacing hops (i, i+1) and (j, j+1) by (i, j) and (i+1, j+1)
        new_min = np.minimum(bw[a[i], a[j]], bw[a[(i + 1) % n], a[(j + 1) % n]])
        good = j[new_min > worst]
        if not len(good):
            break
        j = int(good[np.argmax(new_min[new_min > worst])])
        lo, hi = sorted((i, j))
        order = order[: lo + 1] + order[lo + 1 : hi + 1][::-1] + order[hi + 1 :]
        if _key(order, bw, lat, hops) >= _key(list(a), bw, lat, hops):
            order = list(a)
            break
    for _ in range(rounds if n <= 48 else 0):  # then latency (O(n^3) a pass: small groups)
        improved = False
        best = _key(order, bw, lat, hops)
        for i in range(n - 1):
            for j in range(i + 2, n if i else n - 1):
                cand = order[: i + 1] + order[i + 1 : j + 1][::-1] + order[j + 1 :]
                k = _key(cand, bw, lat, hops)
                if k < best:
                    order, best, improved = cand, k, True
        if not improved:
            break
    return order


_HINT: list = [None, {}]  # the last hint seen and each GPU's position in it


def _hinted(hint: list, group: list) -> list | None:
    """The GPUs of `group` in the order of the ring `hint`, or None when some are not in
    it. Positions are kept for the last hint (the same list for every group of a run:
    a pass over a 16,384-GPU ring per group in Python was most of a small group's
    ordering; comparing with a copy of the last hint is one pass in C)."""
    if _HINT[0] != hint:
        _HINT[:] = [list(hint), {g: i for i, g in enumerate(hint)}]
    pos = _HINT[1]
    if len(pos) != len(hint):  # a GPU twice in the hint: keep every copy, as listed
        members = set(group)
        return [g for g in hint if g in members] if members <= set(hint) else None
    if not all(g in pos for g in group):
        return None
    return sorted(dict.fromkeys(group), key=pos.__getitem__)


def ring_order(graph, group, routes: Routes | None = None) -> tuple:
    """Order `group` into a ring: slowest hop as fast as possible, then least latency."""
    group = list(group)
    n = len(group)
    if n <= 2:
        return tuple(group)
    hint = graph.graph.get("ring")
    hinted = _hinted(hint, group) if hint else None
    if n > DENSE_LIMIT and hinted:
        return tuple(hinted)
    routes = routes or Routes(graph)
    if n > DENSE_LIMIT:
        return tuple(_greedy_lazy(graph, group, routes))
    bw, lat, hops = _metrics(graph, group, routes)
    if all(_uniform(m) for m in (bw, lat, hops)):
        # every hop alike (GPUs under one switch: a TP group): every order is best, and
        # the search below returns the hint, else the greedy walk's, which is the group's
        return tuple(hinted) if hinted else tuple(group)
    pos = {g: i for i, g in enumerate(group)}
    candidates = [_two_opt(_greedy(n, bw, lat, hops), bw, lat, hops)]
    if hinted:
        candidates.insert(0, _two_opt([pos[g] for g in hinted], bw, lat, hops))
    best = min(candidates, key=lambda o: _key(o, bw, lat, hops))  # first of equals: the hint
    return tuple(group[i] for i in best)


def _uniform(m: np.ndarray) -> bool:
    """Every off-diagonal entry equal (and finite: a missing path is never uniform)."""
    off = m[~np.eye(len(m), dtype=bool)]
    return bool(np.isfinite(off[0]) and (off == off[0]).all())


def _greedy_lazy(graph, group, routes):
    order, left = [group[0]], list(group[1:])
    while left:
        ((b, lat, hops),) = hop_rows(graph, routes, [order[-1]], left)
        k = int(np.lexsort((np.arange(len(left)), hops, lat, -b))[0])
        order.append(left.pop(k))
    return order
