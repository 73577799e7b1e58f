"""Max-min fair bandwidth allocation, vectorised with numpy.

The link-by-flow incidence is kept as two index arrays (link of each entry, flow of each
entry).

`max_min_rates` (the solver the flow engines call) freezes, each round, every flow that
crosses a *locally minimal* link: a link whose fair share (residual capacity / unfrozen
flows) is no larger than the share of any link that one of its flows also crosses. Why
this is progressive filling: shares only grow as flows freeze (a flow frozen at m <= c/n
leaves (c - m) / (n - 1) >= c / n), so nothing can freeze a flow of a locally minimal
link before the filling level reaches its share; at that level the link saturates and
all its flows stop there. The globally smallest share is always locally minimal, so every
round makes progress, and the rounds needed are the length of the longest chain of
dependent bottlenecks, not the number of distinct levels (the solves of sim_speed's
permutation on a 1,024-GPU torus have 141 levels and take 12 rounds on average). Link ids
are compressed to the live links and re-compressed as links empty, so each round costs
O(live entries + live links). When every link has the same share (a ring step, a uniform
all-to-all) there are no rounds at all. The worst case is a chain in which each level waits
on the one below: one round per level, as for the level solver, each round about 1.5-2x
dearer (benchmarks/maxmin_speed.py, "chain").

`max_min_rates_by_level` is the previous solver (one round per distinct level, the global
minimum only), kept as a reference for tests and benchmarks. The two agree to about 1e-12
relative, not bit for bit: the level solver merges levels within 1e-12 of the global
minimum (anywhere in the network, so a link gets a level up to 1e-12 below its own share;
m * (1 + 1e-12) can round to a hair more) and subtracts count x level from a link, where
the new solver keeps each link's own share and subtracts the sum of its frozen flows'
rates. The new solver is within rounding of the exact max-min rates (a link's residual
stays >= c * unfrozen / n, so no cancellation amplifies rounding); tests/test_maxmin.py
checks both against exact rational progressive filling, the new one to 1e-12 and the
level solver to 2e-12.

Every step of the new solver reads only a link's own flows and those flows' links, so
each connected component of the link-flow graph evolves exactly as if solved alone (same
floats, same order of sums). `MaxMin` uses that: it keeps the previous rates and re-solves
only the components that contain a changed link, with the same results as a full solve.

How an engine uses `MaxMin`::

    mm = MaxMin(capacity)                 # once per network; capacity[L], inf allowed
    ...                                   # whenever the set of flows in flight changes:
    rates = mm.solve(rows, cols, keys)    # rows/cols: incidence of the flows in flight now
                                          # keys[F]: a stable id per flow (e.g. a counter
                                          # assigned at arrival, never reused)

Flow ids (`cols`) may be compacted or reordered between calls: previous rates are looked
up by key. A key names one flow over one route; a flow that changes route needs a new key.
The solver finds what changed itself: the links of flows whose key is new or gone since
the last call, plus links passed to `set_capacity` (or `solve(..., changed_links=...)`).
Rates are bit-identical to `max_min_rates` on the whole incidence when the flows keep their
relative order between calls (compaction only); a reordering changes the order of each
link's float sums, so rates then agree to rounding (about 1e-15).

Cost: an O(entries) diff by key, the component labels (kept between calls and merged
when a new flow bridges components; relabelled from scratch every `relabel_every` calls,
since departures can split components), and a solve of the dirty components only. When
they hold most flows, the call is a plain full solve. It pays when changes are local
(pipelines, independent jobs); one machine-wide component (an all-to-all, a permutation
on a torus) gains nothing over `max_min_rates`.

The packet network's fast engine does not use `MaxMin`: it knows which flows came and went
at each change, so it keeps component labels of its own (networks.packet.solve,
`ComponentSolve.solve_changed`) and avoids the O(flows) diff by key per call; it relies on the same
property (a component solved alone gives the same floats as within the whole table).
"""

from __future__ import annotations

import numpy as np


def incidence(flow_links: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(link index, flow index) of every entry of the link-by-flow incidence."""
    lens = np.fromiter((len(x) for x in flow_links), dtype=np.int64, count=len(flow_links))
    rows = np.concatenate(flow_links) if len(flow_links) else np.zeros(0, np.int64)
    return rows.astype(np.int64, copy=False), np.repeat(np.arange(len(flow_links)), lens)


def link_loads(rows, cols, rates, n_links: int) -> np.ndarray:
    """Bytes/s on each link (finite rates only)."""
    finite = np.where(np.isfinite(rates), rates, 0.0)
    return np.bincount(rows, weights=finite[cols], minlength=n_links)


def max_min_rates(rows, cols, n_flows: int, capacity: np.ndarray) -> np.ndarray:
    """Rates (bytes/s) of `n_flows` flows over links of `capacity`, given the incidence
    entries (rows: link, cols: flow). A flow crossing no link, or only links of infinite
    capacity, gets an infinite rate."""
    rate = np.full(n_flows, np.inf)
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    capacity = np.asarray(capacity, dtype=float)
    finite = np.isfinite(capacity)
    if not finite.all():  # infinite links never bind: drop their entries
        keep = finite[rows]
        rows, cols = rows[keep], cols[keep]
    if not len(rows):
        return rate
    if len(cols) > 1 and (cols[1:] < cols[:-1]).any():  # group entries by flow
        order = np.argsort(cols, kind="stable")
        rows, cols = rows[order], cols[order]
    n = np.bincount(rows, minlength=len(capacity))
    rows, cap, n = _compress(rows, capacity, n)
    share = cap / n
    if share.min() == share.max():  # one level (a ring step, all-to-all): skip the rounds
        rate[cols] = share[0]
        return rate
    # per unfrozen flow: its id, where its entries start and how many there are
    first = np.empty(len(cols), bool)
    first[0] = True
    np.not_equal(cols[1:], cols[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    fid = cols[starts]
    counts = np.diff(starts, append=len(cols))
    while True:
        with np.errstate(divide="ignore", invalid="ignore"):
            share = cap / n  # links emptied since the last compression: never read
        es = share[rows]
        fmin = np.minimum.reduceat(es, starts)  # each flow's tightest share
        fe = np.repeat(fmin, counts)
        # a link is locally minimal unless one of its flows crosses a tighter link
        local = np.ones(len(cap), bool)
        local[rows[fe < es]] = False
        frozen = np.logical_or.reduceat(local[rows], starts)
        if frozen.all():  # often the first round: one level, or all levels independent
            rate[fid] = fmin
            return rate
        rate[fid[frozen]] = fmin[frozen]
        hit = np.repeat(frozen, counts)
        cap = np.maximum(cap - np.bincount(rows[hit], weights=fe[hit], minlength=len(cap)), 0.0)
        rows = rows[~hit]
        n = np.bincount(rows, minlength=len(cap))
        keep = ~frozen
        fid, counts = fid[keep], counts[keep]
        starts = np.cumsum(counts) - counts
        if 2 * np.count_nonzero(n) < len(n):  # keep per-round work to the live links
            rows, cap, n = _compress(rows, cap, n)


def _compress(rows, cap, n):
    """Renumber the links that still carry entries (n > 0) as 0..k-1; copies `cap`."""
    alive = n > 0
    new_id = np.zeros(len(n), np.int64)
    new_id[alive] = np.arange(np.count_nonzero(alive))
    return new_id[rows], cap[alive], n[alive]


def max_min_rates_by_level(rows, cols, n_flows: int, capacity: np.ndarray) -> np.ndarray:
    """The level-by-level progressive filling (the previous `max_min_rates`): each round
    raises every unfrozen flow to the smallest share and freezes the flows crossing links
    within 1e-12 of it. One round per distinct level; a reference for tests and benchmarks."""
    rate = np.full(n_flows, np.inf)
    cap = capacity.astype(float).copy()
    n_links = len(cap)
    while len(rows):
        n = np.bincount(rows, minlength=n_links)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(n > 0, cap / n, np.inf)
        m = share.min()
        if not np.isfinite(m):
            break  # the rest cross only infinite links
        bottleneck = share <= m * (1 + 1e-12) + 1e-300
        newly = np.zeros(n_flows, bool)
        newly[cols[bottleneck[rows]]] = True
        rate[newly] = m
        hit = newly[cols]  # entries of the flows frozen now: they take m from their links
        cap = np.maximum(cap - np.bincount(rows[hit], minlength=n_links) * m, 0.0)
        rows, cols = rows[~hit], cols[~hit]
    return rate


class MaxMin:
    """Max-min rates that keep the previous solution and re-solve only the connected
    components (links joined by shared flows, infinite links left out since they never
    bind) that contain a changed link or a new flow. See the module docstring for the call
    pattern; results equal `max_min_rates` on the whole incidence."""

    relabel_every = 32  # solves between component labellings from scratch

    def __init__(self, capacity):
        self.capacity = np.array(capacity, dtype=float)  # a copy: set_capacity edits it
        self._keys = np.zeros(0, np.int64)  # previous call's keys, sorted
        self._rates = np.zeros(0)  # their rates
        self._erow = np.zeros(0, np.int64)  # previous incidence: link of each entry
        self._epos = np.zeros(0, np.int64)  # ... and its flow's position in _keys
        self._pending: list[np.ndarray] = []  # links changed by set_capacity
        # component label of each link, or None: a coarsening of the true components (a
        # departure may split one; its parts keep one label, which only re-solves more)
        self._label: np.ndarray | None = None
        self._age = 0  # solves since the labels were computed from scratch
        self.resolved = 0  # flows re-solved by the last call (for benchmarks and tests)

    def set_capacity(self, links, values) -> None:
        """Change the capacity of `links`; the next solve re-solves their components."""
        links = np.atleast_1d(np.asarray(links, dtype=np.int64))
        was_inf = np.isinf(self.capacity[links])
        self.capacity[links] = values
        if (was_inf & np.isfinite(self.capacity[links])).any():
            self._label = None  # a link that starts to bind may join components
        self._pending.append(links)

    def reset(self) -> None:
        """Forget the previous solution: the next solve is a full one."""
        self._keys, self._rates = np.zeros(0, np.int64), np.zeros(0)
        self._erow, self._epos = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self._label = None

    def solve(self, rows, cols, keys, changed_links=None) -> np.ndarray:
        """Rates of the flows `keys` (one stable key per flow) over the incidence
        (rows: link, cols: flow index into keys). `changed_links` adds links whose
        capacity or flows changed in a way the keys do not show."""
        rows = np.asarray(rows, dtype=np.int64)
        cols = np.asarray(cols, dtype=np.int64)
        keys = np.asarray(keys, dtype=np.int64)
        n_flows, n_links = len(keys), len(self.capacity)
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        if n_flows > 1 and (sorted_keys[1:] == sorted_keys[:-1]).any():
            raise ValueError("flow keys must be unique")

        # match the flows to the previous call's by key
        pos = np.minimum(np.searchsorted(self._keys, keys), max(len(self._keys) - 1, 0))
        known = self._keys[pos] == keys if len(self._keys) else np.zeros(n_flows, bool)
        kept = np.zeros(len(self._keys), bool)
        kept[pos[known]] = True

        # changed links: those of new flows, of departed flows, and those named
        changed = np.zeros(n_links, bool)
        changed[rows[~known[cols]]] = True
        changed[self._erow[~kept[self._epos]]] = True
        if changed_links is not None:
            self._pending.append(np.asarray(changed_links, dtype=np.int64))
        for links in self._pending:
            changed[links] = True
        self._pending = []
        seed = ~known  # new flows, and flows crossing a changed link (even an infinite one)
        seed[cols[changed[rows]]] = True

        if not seed.any():
            rate, self.resolved = self._rates[pos], 0
        else:
            if seed.all():
                self._label, dirty = None, None  # labels are only kept up to date below
            else:
                dirty = self._dirty_flows(rows, cols, n_flows, seed)
            if dirty is None:
                rate, self.resolved = max_min_rates(rows, cols, n_flows, self.capacity), n_flows
            else:
                rate = self._rates[pos].copy()  # the dirty flows are overwritten below
                sub = dirty[cols]
                new_id = np.cumsum(dirty) - 1  # keeps flow order, hence each link's sum order
                idx = np.flatnonzero(dirty)
                rate[idx] = max_min_rates(rows[sub], new_id[cols[sub]], len(idx), self.capacity)
                self.resolved = len(idx)

        rank = np.empty(n_flows, np.int64)
        rank[order] = np.arange(n_flows)
        self._keys, self._rates = sorted_keys, rate[order]
        self._erow, self._epos = rows, rank[cols]
        return rate

    def _dirty_flows(self, rows, cols, n_flows, seed):
        """Flows sharing a component label with a seed flow (components over finite
        links), or None when that is most flows (a full solve is then cheaper, and equal).
        Seed flows include every new flow, so merging their labels keeps the labels a
        coarsening of the components."""
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        n_links = len(self.capacity)
        fin = np.isfinite(self.capacity)[rows]
        r, c = rows[fin], cols[fin]
        self._age += 1
        if self._label is None or self._age > self.relabel_every:  # now and then: re-split
            nodes = n_links + n_flows  # links, then flows
            graph = coo_matrix((np.ones(len(r), np.int8), (r, c + n_links)), (nodes, nodes))
            _, label = connected_components(graph, directed=True, connection="weak")
            self._label, self._age = label[:n_links], 0
        label = self._label
        s = seed[c]
        rs, cs = r[s], c[s]
        first = np.full(n_flows, np.iinfo(np.int64).max)  # each seed flow's smallest label
        np.minimum.at(first, cs, label[rs])
        join = label[rs] != first[cs]
        if join.any():  # a seed flow bridges components: merge their labels
            size = int(label.max()) + 1
            edges = coo_matrix(
                (np.ones(int(join.sum()), np.int8), (first[cs[join]], label[rs[join]])),
                (size, size),
            )
            _, merged = connected_components(edges, directed=True, connection="weak")
            self._label = label = merged[label]
        bad = np.zeros(int(label.max(initial=-1)) + 1, bool)
        bad[label[rs]] = True
        dirty = seed.copy()
        dirty[c[bad[label[r]]]] = True
        return None if 2 * np.count_nonzero(dirty) > n_flows else dirty
