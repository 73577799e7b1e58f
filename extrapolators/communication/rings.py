"""Ring orders: which GPU follows which in a ring collective.

A ring is as fast as its most loaded link, so the order minimises the ring's time per byte:
the most loaded link's load / capacity, with every hop's routed path loaded (half each
way where the ring runs both ways: where every hop's way back is as short, in hops, as the
way there), so two hops whose paths share a link count twice (NCCL's search books each
channel's bandwidth on every link of its paths, search.cc). Then the least summed hop
latency, then the fewest summed hops. Rings within a relative 1e-9 of the best time
count as tied.

Groups of up to `EXACT_LIMIT` GPUs search every ring: the best is a minimum over a set
that does not depend on the bandwidths, so a slower link never gives a faster ring, and a
slightly slower one a ring about as fast. Larger groups weigh a few candidates by the same
key: greedy nearest neighbour (slowest hop first), 2-opt moves that remove the worst hop
and then cut latency, the builder's known ring (`graph.graph['ring']`) and the group's
own order, each as found and as improved. Above `DENSE_LIMIT` GPUs nothing N x N is
built: the builder's ring is taken as it is, or the greedy walk computes one row of hop
metrics per step.
"""

from __future__ import annotations

import numpy as np

from networks.routing import Routes
from networks.routing.graph import NET_WEIGHT, NS_WEIGHT  # the packing of route weights: hops, ns

DENSE_LIMIT = 256
EXACT_LIMIT = 8  # every ring searched: (n-1)! orders, 5,040 at 8 GPUs, in one numpy pass
_TIE = 1e-9  # rings whose time per byte is within this (relative) of the best are tied


def hop_rows(graph, routes: Routes, sources, targets):
    """For each source, arrays over `targets` of (bottleneck bandwidth, latency in s, hops)
    along the routed path: one shortest-path tree per source, or where that gives the
    same a big switch's spread shared by the GPUs under it (`Routes.hub_hop_rows`) or a
    search of the one server they are in (`Routes.server_hop_rows`). The
    targets' paths are walked back up the tree together, a hop of every unfinished path
    per step (O(targets x hops) in numpy: the bottleneck is a min, the same in any order)."""
    # GPUs of one server: a search of its nodes (first: the cheaper test), else a big
    # switch's spread
    shared = routes.server_hop_rows(sources, targets)
    if shared is None:
        shared = routes.hub_hop_rows(sources, targets)
    if shared is not None:
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
    return np.where(ok, np.floor(np.mod(np.where(ok, d, 0), NET_WEIGHT) / NS_WEIGHT) * 1e-9, np.inf)


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


def ring_order(graph, group, routes: Routes | None = None, capacity=None) -> tuple:
    """Order `group` into a ring: least time per byte (the most loaded link's load over its
    capacity, hops' paths counted where they share links), then least latency, then fewest
    hops. `capacity`: per link of `routes.links` (default: the links' bandwidths; the NCCL
    model passes what NCCL believes each link carries)."""
    return order_and_alike(graph, group, routes, capacity)[0]


def order_and_alike(graph, group, routes: Routes | None = None, capacity=None, exact=True):
    """(`ring_order`, whether every hop between the group's GPUs is alike in bandwidth,
    latency and hops: then every order is as good (None: not looked at), and the orders
    weighed, the chosen one first). For groups above EXACT_LIMIT the orders include some
    found without the bandwidths (the hint, the group's own order, a walk by latency and
    hops), which a caller that times every candidate can rely on whatever the links'
    speeds. `exact=False`: small groups are not searched ring by ring either (a caller
    that searches them itself)."""
    group = list(group)
    n = len(group)
    if n <= 2:
        return tuple(group), True, [tuple(group)]
    hint = graph.graph.get("ring")
    hinted = _hinted(hint, group) if hint else None
    if n > DENSE_LIMIT and hinted:
        return tuple(hinted), None, [tuple(hinted)]
    routes = routes or Routes(graph)
    if n > DENSE_LIMIT:
        order = tuple(_greedy_lazy(graph, group, routes))
        return order, None, [order]
    bw, lat, hops = _metrics(graph, group, routes)
    if all(_uniform(m) for m in (bw, lat, hops)):
        # every hop alike (GPUs under one switch: a TP group): every order is best, and
        # the search below returns the hint, else the greedy walk's, which is the group's
        order = tuple(hinted) if hinted else tuple(group)
        return order, True, [order]
    if n <= EXACT_LIMIT and not exact:  # the caller searches: a start, found cheaply
        order = tuple(hinted) if hinted else tuple(group[i] for i in _greedy(n, bw, lat, hops))
        return order, False, [order]
    loads = _Loads(routes, group, hops, capacity)
    if n <= EXACT_LIMIT:
        first = [[group.index(g) for g in hinted]] if hinted else []
        order = tuple(group[i] for i in loads.best(_all_rings(n, first), lat, hops))
        return order, False, [order]
    pos = {g: i for i, g in enumerate(group)}
    greedy = _greedy(n, bw, lat, hops)
    flat = np.zeros_like(bw)  # no bandwidths: latency, then hops
    by_latency = _two_opt(_greedy(n, flat, lat, hops), flat, lat, hops)
    candidates = [list(range(n)), greedy, _two_opt(greedy, bw, lat, hops), by_latency]
    if hinted:
        h = [pos[g] for g in hinted]
        candidates[:0] = [h, _two_opt(h, bw, lat, hops)]  # first of equals: the hint
    best = loads.best(np.array(candidates, np.int64), lat, hops)
    orders = [best] + [c for c in candidates if c != best]
    orders = [tuple(group[i] for i in o) for o in dict.fromkeys(map(tuple, orders))]
    return orders[0], False, orders


def _all_rings(n: int, first: list) -> np.ndarray:
    """Every ring of n GPUs as an order starting at GPU 0 ((n-1)! rows; both directions,
    since a one-way ring's direction matters), after the orders in `first`."""
    from itertools import permutations

    rest = np.array(list(permutations(range(1, n))), np.int64).reshape(-1, n - 1)
    every = np.hstack([np.zeros((len(rest), 1), np.int64), rest])
    return np.vstack([np.array(first, np.int64).reshape(-1, n), every])


class _Loads:
    """Each ordered pair's routed path as a row of link loads, to weigh rings by their
    most loaded link: a ring's load is the sum of its hops' rows (half each way where it
    runs both ways), its time per byte the largest load / capacity. Only the pairs the
    weighed orders use are routed (a few orders of n hops each, not all n x n pairs: at
    256 GPUs on a ring that was 65,536 routed paths, seconds of a run that has none of
    them in its answer)."""

    def __init__(self, routes: Routes, group, hops: np.ndarray, capacity=None):
        self.n, self.hops, self.routes, self.group = len(group), hops, routes, list(group)
        self.cap_all = routes.link_values("bandwidth") if capacity is None else np.asarray(capacity)
        self._paths: dict = {}  # pair index a * n + b -> its links (None: no path)

    def _rows(self, pairs) -> tuple[np.ndarray, np.ndarray]:
        """(rows of link loads of `pairs` (pair indices), the capacities of their links)."""
        n, g = self.n, self.group
        new = [k for k in pairs if k not in self._paths]
        if new:
            paths = self.routes.paths_links([(g[k // n], g[k % n]) for k in new])
            self._paths.update(zip(new, paths, strict=True))
        paths = [self._paths[k] for k in pairs]
        used = np.unique(
            np.concatenate(
                [p for p in paths if p is not None and len(p)] or [np.zeros(0, np.int64)]
            )
        )
        col = {int(x): i for i, x in enumerate(used.tolist())}
        rows = np.zeros((len(pairs), len(used)))
        for k, p in enumerate(paths):
            if p is not None:
                np.add.at(rows[k], [col[int(x)] for x in p], 1.0)
        return rows, self.cap_all[used]

    def times(self, orders: np.ndarray) -> np.ndarray:
        """Seconds per byte of each order (rows of GPU positions) run as one ring."""
        n = self.n
        a, b = orders, np.roll(orders, -1, axis=1)
        both = (self.hops[a, b] == self.hops[b, a]).all(axis=1)
        w = np.where(both, 0.5, 1.0)[:, None]
        k = np.arange(len(orders))[:, None]
        pairs = np.unique(np.concatenate([(a * n + b).ravel(), (b * n + a).ravel()]))
        at = np.full(n * n, -1, np.int64)
        at[pairs] = np.arange(len(pairs))
        share = np.zeros((len(orders), len(pairs)))
        np.add.at(share, (k, at[a * n + b]), w)
        np.add.at(share, (k, at[b * n + a]), np.where(both, 0.5, 0.0)[:, None])
        rows, cap = self._rows(pairs.tolist())
        load = share @ rows
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(load > 0, load / cap, 0.0).max(axis=1, initial=0.0)
        return np.where(np.isfinite(self.hops[a, b]).all(axis=1), t, np.inf)  # no path: never

    def best(self, orders: np.ndarray, lat: np.ndarray, hops: np.ndarray) -> list:
        """The order with the least time per byte (ties within _TIE), then the least summed
        latency, then the fewest summed hops, then the first listed."""
        t = self.times(orders)
        a, b = orders, np.roll(orders, -1, axis=1)
        tied = np.flatnonzero(t <= t.min() * (1 + _TIE))
        key = np.lexsort(
            (tied, hops[a[tied], b[tied]].sum(axis=1), lat[a[tied], b[tied]].sum(axis=1))
        )
        return orders[tied[key[0]]].tolist()


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
