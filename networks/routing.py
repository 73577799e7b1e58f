"""Routes through a topology: which links a transfer from one node to another crosses.

The rule, in order of precedence:
1. fewest inter-node links (edges with kind='net'): traffic inside a node never leaves it
   through the inter-node fabric when an NVLink/NVSwitch/PCIe path exists, whatever the
   latencies; between nodes, the path with fewest network hops (a GPU may forward over
   NVLink to the GPU on the right rail first, as NCCL's PXN does);
2. least summed latency (mode 'latency'; skipped in mode 'hops');
3. fastest links: least summed 1/bandwidth (a tie-break, so a fast link beats a slow one
   of the same latency);
4. fewest hops.
Equal-cost paths are spread by a hash of (source, destination) (ECMP).

The keys are packed into one integer-valued float per link so scipy's C Dijkstra sums
them exactly (every term stays far below 2**53), and equal-cost paths stay tied.
"""

from __future__ import annotations

import zlib

import numpy as np

LINK_KINDS = ("nvlink", "pcie", "net")
HUB_ROWS_BYTES = 2**28  # memory for shared rows of switches (see Routes)
CANDIDATES = 2**20  # in-links weighed at once when paths are walked in a batch
# a hub with more out-links than this serves its GPUs' hop metrics from one shared spread
# (a search from a GPU under a big switch relaxes every link of it: O(N) per GPU on a star)
SPREAD_DEGREE = 256
SPREAD_LEVELS = 64  # a spread deeper than this (hops) is left to the per-source trees
# bit budget (sums stay below 2**53): up to 31 network hops, 1 ms of summed latency at 1 ns
# resolution, 256 hops of at most 2**12 bandwidth units each, 256 hops
_NET = float(2**48)
_LAT = float(2**28)  # per ns
_BW = float(2**8)  # per unit of 1/bandwidth: 2**-10 ns per byte (450 GB/s: 2; 1 GB/s: 1024)


def link_weight(d: dict, mode: str = "latency") -> float:
    net = 1 if d.get("kind") == "net" else 0
    lat = int(round(d.get("latency", 0.0) * 1e9)) if mode == "latency" else 0
    bw = d["bandwidth"]
    inv_bw = min(int(round(2**10 * 1e9 / bw)), 2**12) if bw < np.inf else 0
    return net * _NET + lat * _LAT + inv_bw * _BW + 1


def path_latencies(latency: np.ndarray, paths) -> list[float]:
    """float(latency[links].sum()) of each path (0.0 for an empty one), with one numpy sum
    per path length: a row of a 2-D sum is reduced as the 1-D sum is, so the floats are the
    same (checked by tests/test_route_speedups.py)."""
    out = [0.0] * len(paths)
    by_len: dict = {}
    for i, links in enumerate(paths):
        if links is not None and len(links):
            by_len.setdefault(len(links), []).append(i)
    for ids in by_len.values():
        sums = latency[np.array([paths[i] for i in ids], np.int64)].sum(axis=1).tolist()
        for i, x in zip(ids, sums, strict=True):
            out[i] = x
    return out


class Routes:
    """Shortest paths by the rule above over a DiGraph with `bandwidth`, `latency` and
    (optional) `kind` on every edge.

    Distances are computed per source, bounded: a Dijkstra from the source stops at a limit
    that first covers the destination (the direct link's weight where there is one, else a
    lower bound, raised 4x until the destination is in), and only the nodes it reached are
    kept. Every node on a shortest path to the destination is within the limit, and a
    node beyond it cannot be an equal-cost predecessor, so the paths are those of the
    unbounded rows (the packed weights sum exactly, in any order). Memory is O(nodes
    near each source), not sources x nodes (2 GB at 16,384 GPUs). A GPU whose out-links all
    go to switches takes the minimum of its switches' rows plus the links' weights instead
    (the same integers): in a cluster of servers a search from a GPU to another server
    covers the whole machine, and the switches' rows are shared."""

    def __init__(self, graph, mode: str = "latency"):
        from scipy.sparse import csr_matrix

        self.graph = graph
        self.links = list(graph.edges())
        nodes = list(graph.nodes)
        self.nodes = nodes
        self.node_index = {v: i for i, v in enumerate(nodes)}
        u = np.array([self.node_index[a] for a, _ in self.links], dtype=np.int64)
        v = np.array([self.node_index[b] for _, b in self.links], dtype=np.int64)
        self.weight = np.array([link_weight(graph.edges[e], mode) for e in self.links], float)
        self._csr = csr_matrix((self.weight, (u, v)), shape=(len(nodes), len(nodes)))
        self._u, self._v = u, v
        self._pair_keys = self._pair_link = None  # sorted tail * N + head, link of each
        self._values: dict = {}  # edge attribute -> its value per link
        # in-links as CSR (node -> link indices in link order, and their tails) for the walk
        order = np.argsort(v, kind="stable")
        self._in_ptr = np.searchsorted(v[order], np.arange(len(nodes) + 1))
        self._in_link, self._in_from = order, u[order]
        self._min_out = np.full(len(nodes), np.inf)
        np.minimum.at(self._min_out, u, self.weight)
        self._min_in = np.full(len(nodes), np.inf)
        np.minimum.at(self._min_in, v, self.weight)
        # nodes joined without network links (a server): a path between two of them that
        # are not must cross a network link, so it is at least _NET long (a bound that
        # saves the bounded searches most of their 4x steps to a GPU in another server)
        from scipy.sparse.csgraph import connected_components

        local = np.array([graph.edges[e].get("kind") != "net" for e in self.links], bool)
        self._local = connected_components(
            csr_matrix((np.ones(int(local.sum())), (u[local], v[local])),
                       shape=(len(nodes), len(nodes))), directed=False)[1]  # fmt: skip
        self._direct = {(a, b): w for a, b, w in zip(u.tolist(), v.tolist(), self.weight.tolist(),
                                                    strict=True)}  # fmt: skip
        self._balls: dict = {}  # source index -> (limit, reached node indices, distances)
        self._paths: dict = {}
        # a node whose only out-link goes to X (a GPU on a leaf switch) is w + X's row away
        # from everything else: one full row per such X serves all its GPUs, when these rows
        # fit in HUB_ROWS_BYTES (a fat tree: one per leaf)
        out_deg = np.bincount(u, minlength=len(nodes))
        single = np.flatnonzero(out_deg[u] == 1)  # links that are their tail's only one
        self._hub = {int(u[k]): (int(v[k]), float(self.weight[k])) for k in single}
        self._hub_link = {int(u[k]): int(k) for k in single}
        hubs = {x for x, _ in self._hub.values()}
        if len(hubs) * len(nodes) * 8 > HUB_ROWS_BYTES:
            self._hub, self._hub_link = {}, {}
        self._hub_rows: dict = {}  # hub index -> its full distance row
        # a GPU whose out-links all go to switches (an NVSwitch and a NIC's leaf) is, to every
        # other node, min over those links of (weight + the switch's distance): the switches'
        # rows are shared by the GPUs on them (a server's 8, a rail's thousands), so a row
        # costs a minimum of a few shared rows instead of a search of the machine
        is_switch = np.array([graph.nodes[x].get("kind", "gpu") != "gpu" for x in nodes], bool)
        bad = np.zeros(len(nodes), bool)
        np.logical_or.at(bad, u, ~is_switch[v])
        self._via_switches = (out_deg >= 2) & ~bad & ~is_switch
        # how many such GPUs each switch serves: the rows kept when they do not all fit are
        # the most shared ones (a rail's leaf serves thousands, a server's NVSwitch eight)
        self._served = np.bincount(v[self._via_switches[u]], minlength=len(nodes))
        self._switch_rows: dict = {}  # switch index -> its full distance row
        self._out_deg = out_deg
        self._spreads: dict = {}  # hub index -> (hops, least and most bottleneck) rows

    def link_ids(self, tails: np.ndarray, heads: np.ndarray) -> np.ndarray:
        """The index in `links` of each (tail, head) pair of node indices; every pair must
        be a link (one sorted search for all, not a graph lookup per hop)."""
        n = len(self.nodes)
        if self._pair_keys is None:
            keys = self._u * n + self._v
            order = np.argsort(keys, kind="stable")
            self._pair_keys, self._pair_link = keys[order], order
        k = np.searchsorted(self._pair_keys, np.asarray(tails, np.int64) * n + heads)
        return self._pair_link[k]

    def link_values(self, attr: str) -> np.ndarray:
        """Each link's `attr` (an edge attribute every link has), in `links` order."""
        out = self._values.get(attr)
        if out is None:
            edges = self.graph.edges
            out = self._values[attr] = np.array([edges[e][attr] for e in self.links], float)
        return out

    def distances(self, sources) -> None:
        """Kept for callers that announce their sources; rows are computed on demand, per
        source and bounded (see the class), by `path_links`."""

    def trees(self, sources, targets=None):
        """(distances, predecessors) rows of one shortest-path tree per source. With
        `targets`, each source's search stops at a limit that covers every target (a
        lower bound raised 4x until all are in): the same distances and predecessors for
        every node within it, since nodes are settled in the same order up to the limit
        and a node's predecessor is settled before it (a tree over a handful of GPUs under
        one switch no longer searches the whole machine: O(groups x nodes) at 16k)."""
        from scipy.sparse.csgraph import dijkstra

        src = [self.node_index[s] for s in sources]
        if targets is None:
            return dijkstra(self._csr, indices=src, return_predecessors=True)
        tgt = np.array([self.node_index[t] for t in targets], dtype=np.int64)
        fars, limits = [tgt[tgt != s] for s in src], []
        for s, far in zip(src, fars, strict=True):
            limit = float(np.max(self._min_out[s] + self._min_in[far])) if len(far) else 0.0
            limits.append(max(limit, 1.0) if np.isfinite(limit) else np.inf)
        top = max(limits)
        if len(src) > 1 and np.isfinite(top):  # one search per source, in one call, to
            # the largest limit: within each source's own limit the same settling order,
            # hence the same rows there (one call per source was ~10% of an 8-GPU group's plan)
            d, p = dijkstra(self._csr, indices=src, limit=top, return_predecessors=True)
            if np.isfinite(d[:, tgt]).all():
                return d, p
        dist = np.empty((len(src), len(self.nodes)))
        pred = np.empty((len(src), len(self.nodes)), dtype=np.int32)
        for k, s in enumerate(src):
            far, limit = fars[k], limits[k]
            for _ in range(12):
                d, p = dijkstra(self._csr, indices=s, limit=limit, return_predecessors=True)
                if np.isfinite(d[far]).all() or limit == np.inf:
                    break
                limit *= 4
            else:  # far away, or some target unreachable: the whole tree
                d, p = dijkstra(self._csr, indices=s, return_predecessors=True)
            dist[k], pred[k] = d, p
        return dist, pred

    def hub_hop_rows(self, sources, targets) -> list | None:
        """`(bottleneck bandwidth, packed distance, hops)` arrays over `targets` for each
        source, as a shortest-path tree from the source gives them, or None where this way
        does not apply (a source without a big hub, or some path's bottleneck that depends
        on which of several equal-cost paths a tree takes).

        A source with one out-link into hub x reaches every other node through x, along
        x's shortest paths (none returns through the source: its one way out is back to x).
        So its distances are the link's weight plus x's row, its hops one more than x's, and
        its bottleneck the smaller of the link's bandwidth and that of x's path. A tree
        takes one of x's equal-cost paths, which all have the same hops and distance (both
        are in the packed weight) but maybe not the same bottleneck: x's spread keeps the
        least and the most over all of them, and where the two differ (after the source's
        link) the answer would depend on the tree's tie-break, so None."""
        idx = self.node_index
        src = [idx[s] for s in sources]
        hubs = [self._hub.get(s) for s in src]
        if not all(h and self._out_deg[h[0]] > SPREAD_DEGREE for h in hubs):
            return None
        t_idx = np.array([idx[t] for t in targets], dtype=np.int64)
        bandwidth = self.link_values("bandwidth")
        out = []
        for s, (x, w) in zip(src, hubs, strict=True):
            spread = self._spread(x)
            if spread is None:
                return None
            row = self._full_row(x, hub=True)
            level, least, most = spread
            b_link = bandwidth[self._hub_link[s]]
            lo, hi = np.minimum(b_link, least[t_idx]), np.minimum(b_link, most[t_idx])
            d = w + row[t_idx]
            ok = np.isfinite(d)
            if (lo[ok] != hi[ok]).any():
                return None
            own = t_idx == s
            d[own] = 0.0
            b = np.where(ok, lo, 0.0)
            b[own] = np.inf
            hops = np.where(ok, 1.0 + level[t_idx], np.inf)
            hops[own] = 0.0
            out.append((b, d, hops))
        return out

    def _spread(self, x: int):
        """Hub x's (hops, least bottleneck, most bottleneck) over all its shortest paths to
        each node, by levels of the shortest-path DAG (links with d[u] + w == d[v]); None
        when deeper than SPREAD_LEVELS. Kept while they fit HUB_ROWS_BYTES."""
        if x in self._spreads:
            return self._spreads[x]
        d = self._full_row(x, hub=True)
        u, v, bw = self._u, self._v, self.link_values("bandwidth")
        tight = np.flatnonzero(np.isfinite(d[u]) & (d[u] + self.weight == d[v]))
        level = np.full(len(self.nodes), -1, np.int64)
        least = np.zeros(len(self.nodes))
        most = np.zeros(len(self.nodes))
        level[x], least[x], most[x] = 0, np.inf, np.inf
        frontier = np.zeros(len(self.nodes), bool)
        frontier[x] = True
        result = None  # deeper than SPREAD_LEVELS unless the walk runs out first
        for depth in range(1, SPREAD_LEVELS + 2):
            e = tight[frontier[u[tight]]]
            if not len(e):
                result = (level, least, most)
                break
            if depth > SPREAD_LEVELS:
                break
            heads = v[e]
            # every tight in-link of a head comes from the level before (the hop count is
            # in the packed weight: equal distances, equal hops)
            least[heads] = np.inf
            np.minimum.at(least, heads, np.minimum(least[u[e]], bw[e]))
            np.maximum.at(most, heads, np.minimum(most[u[e]], bw[e]))
            level[heads] = depth
            frontier[:] = False
            frontier[heads] = True
        if (len(self._spreads) + 1) * len(self.nodes) * 24 <= HUB_ROWS_BYTES:
            self._spreads[x] = result
        return result

    def reachable(self, src, dst) -> bool:
        return self.path_links(src, dst) is not None

    def _hub_dist(self, s: int):
        """For a source with one out-link: its distances as a function of node indices."""
        x, w = self._hub[s]
        row = self._full_row(x, hub=True)

        def dist(ix):
            return np.where(ix == s, 0.0, w + row[ix])

        return dist

    def _row_via_switches(self, s: int) -> np.ndarray:
        """Distances from s (a node whose out-links all go to switches): one Bellman step,
        min over its out-links of weight + the switch's row; 0 at s. The weights are
        integers (see link_weight) and their sums stay below 2**53, so these are the
        search's own distances, exactly."""
        csr = self._csr
        row = None
        for k in range(csr.indptr[s], csr.indptr[s + 1]):
            cand = csr.data[k] + self._full_row(int(csr.indices[k]), hub=False)
            row = cand if row is None else np.minimum(row, cand)
        row[s] = 0.0
        return row

    def _full_row(self, x: int, hub: bool) -> np.ndarray:
        """Node x's whole distance row, computed once: a hub's is always kept (their number
        was budgeted when the routes were built), another switch's while the rows fit."""
        row = self._hub_rows.get(x)
        if row is None:
            row = self._switch_rows.get(x)
        if row is None:
            from scipy.sparse.csgraph import dijkstra

            row = dijkstra(self._csr, indices=x)
            if hub:
                self._hub_rows[x] = row
            else:
                self._keep_switch_row(x, row)
        return row

    def _keep_switch_row(self, x: int, row: np.ndarray) -> None:
        """Keep switch x's row while the rows fit HUB_ROWS_BYTES; when they do not, in
        place of the least shared one if x serves more GPUs (NCCL asks in cycles over all
        servers, where least-recently-used would never hit)."""
        rows = self._switch_rows
        if (len(rows) + 1) * len(self.nodes) * 8 <= HUB_ROWS_BYTES:
            rows[x] = row
            return
        if rows:
            low = min(rows, key=self._served.__getitem__)
            if self._served[low] < self._served[x]:
                del rows[low]
                rows[x] = row

    def _row(self, s: int, d: int) -> np.ndarray:
        """Distances from node s, exact for every node not farther than d (inf beyond)."""
        from scipy.sparse.csgraph import dijkstra

        ball = self._balls.get(s)
        if ball is not None:
            limit, idx, dist = ball
            k = int(np.searchsorted(idx, d))
            if (k < len(idx) and idx[k] == d) or limit == np.inf:
                row = np.full(len(self.nodes), np.inf)
                row[idx] = dist
                return row
            limit *= 4
        else:
            limit = self._direct.get((s, d), self._min_out[s] + self._min_in[d])
            if self._local[s] != self._local[d] and (s, d) not in self._direct:
                limit = max(limit, _NET)
            limit = max(limit, 1.0) if np.isfinite(limit) else np.inf
        for _ in range(12):
            row = dijkstra(self._csr, indices=s, limit=limit)
            if np.isfinite(row[d]) or limit == np.inf:
                break
            limit *= 4
        else:  # far away, or unreachable: the whole row
            row, limit = dijkstra(self._csr, indices=s), np.inf
        idx = np.flatnonzero(np.isfinite(row))
        self._balls[s] = (limit, idx, row[idx])
        return row

    def path_links(self, src, dst) -> np.ndarray | None:
        """Link indices from src to dst (None: no path)."""
        key = (src, dst)
        if key not in self._paths:
            self._paths[key] = self.walk_links(src, dst)
        return self._paths[key]

    def paths_links(self, pairs) -> list:
        """`path_links` of every (src, dst) pair: the walks back from the destinations are
        done together, one numpy step per hop, since a Python walk per pair dominated
        all-to-all and large collectives. Same paths as `walk_links`, bit for bit."""
        paths = self._paths
        todo = [k for k in dict.fromkeys(pairs) if k not in paths]
        if len(todo) < 8:  # a few: the plain walk costs less than the set-up
            for k in todo:
                paths[k] = self.walk_links(*k)
        elif todo:
            self._walk_many(todo)
        return [paths[k] for k in pairs]

    def _per_source(self, s_idx: np.ndarray):
        """Per pair, from its source: the distance row it reads (a hub's shared row, or its
        own), that row's offset, its hub and its link into the hub (-1: none). Worked out
        once per distinct source."""
        u, inv = np.unique(s_idx, return_inverse=True)
        keys: dict = {}  # ('h', hub) or ('s', source) -> key number
        kid, off, hub, link = [], [], [], []
        for s in u.tolist():
            h = self._hub.get(s)
            own = ("m", s) if self._via_switches[s] else ("s", s)
            kid.append(keys.setdefault(("h", h[0]) if h else own, len(keys)))
            off.append(h[1] if h else 0.0)
            hub.append(h[0] if h else -1)
            link.append(self._hub_link[s] if h else -1)
        cols = [np.array(x)[inv] for x in (kid, off, hub, link)]
        return list(keys), *cols

    def _dist_rows(self, keys, kid, d_idx):
        """The distance rows of row keys `keys` (pairs read row kid[p], destination d_idx[p]):
        a hub's full row, or a source's bounded row (`_row`) grown until every destination
        asked of it is in. Any row exact up to the destination gives the same paths (see
        the class)."""
        rows = np.empty((len(keys), len(self.nodes)))
        order = np.argsort(kid, kind="stable")
        bounds = np.searchsorted(kid[order], np.arange(len(keys) + 1))
        for r, (kind, x) in enumerate(keys):
            if kind == "h":
                rows[r] = self._full_row(x, hub=True)
                continue
            if kind == "m":
                rows[r] = self._row_via_switches(x)
                continue
            ds = d_idx[order[bounds[r] : bounds[r + 1]]]
            out = ds[:1]
            while len(out):  # balls only grow: the last row covers every earlier one
                rows[r] = self._row(x, int(out[0]))
                out = ds[~np.isfinite(rows[r, ds])]
                if len(out) and self._balls[x][0] == np.inf:
                    break  # the rest are unreachable
        return rows

    def _walk_many(self, pairs) -> None:
        """Walk back from every destination at once, one hop per round (the rule of
        `walk_links`); store each pair's path (or None) in self._paths. Pairs go in chunks
        whose distance rows fit in HUB_ROWS_BYTES (each pair's path is its own, so any
        grouping gives the same paths)."""
        idx = self.node_index
        s_idx = np.array([idx[s] for s, _ in pairs], np.int64)
        d_idx = np.array([idx[d] for _, d in pairs], np.int64)
        keys, kid, off, hub, link = self._per_source(s_idx)
        budget = max(1, HUB_ROWS_BYTES // (8 * max(len(self.nodes), 1)))
        if len(keys) <= budget:
            self._walk_chunk(pairs, s_idx, d_idx, keys, kid, off, hub, link)
            return
        for lo in range(0, len(keys), budget):
            sel = np.flatnonzero((kid >= lo) & (kid < lo + budget))
            self._walk_chunk([pairs[i] for i in sel.tolist()], s_idx[sel], d_idx[sel],
                             keys[lo : lo + budget], kid[sel] - lo, off[sel], hub[sel],
                             link[sel])  # fmt: skip

    def _walk_chunk(self, pairs, s_idx, d_idx, keys, row, off, hub, hub_link) -> None:
        rows = self._dist_rows(keys, row, d_idx)

        def dist(p, v):
            return np.where(v == s_idx[p], 0.0, off[p] + rows[row[p], v])

        m, n = len(pairs), len(self.nodes)
        off_vals, off_cls = np.unique(off, return_inverse=True)
        n_off = len(off_vals)
        reach = np.isfinite(dist(np.arange(m), d_idx))
        act = np.flatnonzero(reach & (s_idx != d_idx))
        v = d_idx[act]
        got_p, got_k = [], []  # per round: the pairs still walking and the link each took
        in_ptr, in_link, in_from = self._in_ptr, self._in_link, self._in_from
        while len(act):
            if len(got_p) > n:  # a shortest path has fewer hops than there are nodes
                raise AssertionError("route walk went round a cycle")
            lo = in_ptr[v]
            deg = in_ptr[v + 1] - lo
            k = np.empty(len(act), np.int64)
            tail = np.empty(len(act), np.int64)
            one = deg == 1
            k[one], tail[one] = in_link[lo[one]], in_from[lo[one]]
            # the source's one out-link into its hub: any other way in costs more
            at_hub = ~one & (v == hub[act])
            k[at_hub], tail[at_hub] = hub_link[act[at_hub]], s_idx[act[at_hub]]
            multi = np.flatnonzero(~one & ~at_hub)
            if len(multi):
                p, vm = act[multi], v[multi]
                # the equal-cost candidates depend on (row, offset, v) only (the source itself
                # is never a candidate here: its one out-link is the hub's, handled above, or
                # its own row has 0 there): find them once per distinct triple
                trip = (row[p] * n_off + off_cls[p]) * n + vm
                _, first_u, inv = np.unique(trip, return_index=True, return_inverse=True)
                pu, vu = p[first_u], vm[first_u]
                ok_k, ok_t, cnt_u = self._candidates(pu, vu, dist)
                cnt = cnt_u[inv]
                pick = (np.cumsum(cnt_u) - cnt_u)[inv]  # the first equal-cost candidate
                tie = np.flatnonzero(cnt > 1)
                if len(tie):  # several: spread by a hash of (source, destination, node) (ECMP)
                    nodes = self.nodes
                    h = [zlib.crc32(f"{pairs[q][0]!r}|{pairs[q][1]!r}|{nodes[x]!r}".encode())
                         for q, x in zip(p[tie].tolist(), vm[tie].tolist(), strict=True)]  # fmt: skip
                    pick[tie] += np.array(h, np.int64) % cnt[tie]
                k[multi], tail[multi] = ok_k[pick], ok_t[pick]
            got_p.append(act)
            got_k.append(k)
            keep = tail != s_idx[act]
            act, v = act[keep], tail[keep]
        counts = np.zeros(m, np.int64)
        flat = np.zeros(0, np.int64)
        if got_p:
            gp = np.concatenate(got_p)
            rnd = np.repeat(np.arange(len(got_p)), [len(a) for a in got_p])
            flat = np.concatenate(got_k)[np.lexsort((-rnd, gp))]  # per pair, source first
            counts = np.bincount(gp, minlength=m)
        flat.flags.writeable = False  # the paths are views of it, shared through the cache
        starts = (np.cumsum(counts) - counts).tolist()
        for p, (key, a, c) in enumerate(zip(pairs, starts, counts.tolist(), strict=True)):
            self._paths[key] = flat[a : a + c] if reach[p] else None

    def _candidates(self, pu, vu, dist):
        """For each (pair pu[i], node vu[i]): the in-links of vu[i] on a shortest path from
        the pair's source (in link order) and their tails, concatenated, and how many each
        has. In slices of about CANDIDATES in-links, so memory stays bounded (a leaf switch
        of a large fat tree has hundreds of in-links)."""
        in_ptr, in_link, in_from, w = self._in_ptr, self._in_link, self._in_from, self.weight
        du = in_ptr[vu + 1] - in_ptr[vu]
        cum = np.cumsum(du)
        cuts = np.searchsorted(cum, np.arange(CANDIDATES, int(cum[-1]), CANDIDATES), "right")
        ok_k, ok_t, cnt = [], [], []
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(vu)], strict=True):
            if a == b:
                continue
            d = du[a:b]
            rep = np.repeat(np.arange(b - a), d)
            pos = in_ptr[vu[a:b]][rep] + np.arange(len(rep)) - (np.cumsum(d) - d)[rep]
            ks, tails = in_link[pos], in_from[pos]
            ok = dist(pu[a:b][rep], tails) + w[ks] == dist(pu[a:b], vu[a:b])[rep]
            ok_k.append(ks[ok])
            ok_t.append(tails[ok])
            cnt.append(np.bincount(rep[ok], minlength=b - a))
        return np.concatenate(ok_k), np.concatenate(ok_t), np.concatenate(cnt)

    def walk_links(self, src, dst) -> np.ndarray | None:
        """The straightforward per-pair walk `paths_links` replaces, kept as the reference
        it is checked against (tests/test_route_speedups.py); it does not cache."""
        d_idx, s_idx = self.node_index[dst], self.node_index[src]
        if s_idx in self._hub:
            dist = self._hub_dist(s_idx)
        else:
            dist = self._row(s_idx, d_idx).__getitem__
        if not np.isfinite(dist(d_idx)):
            return None
        links, v = [], d_idx
        hub = self._hub.get(s_idx, (None,))[0]
        while v != s_idx:  # walk back, picking among equal-cost predecessors by hash (ECMP)
            lo, hi = self._in_ptr[v], self._in_ptr[v + 1]
            if hi - lo == 1 or v == hub:
                # the only candidate: v's one in-link, or the source's one out-link into its
                # hub (any other way into the hub costs more than that link alone)
                k = int(self._in_link[lo]) if hi - lo == 1 else self._hub_link[s_idx]
                links.append(k)
                v = int(self._in_from[lo]) if hi - lo == 1 else s_idx
                continue
            ks, tails = self._in_link[lo:hi], self._in_from[lo:hi]
            ok = np.flatnonzero(dist(tails) + self.weight[ks] == dist(v))
            h = zlib.crc32(f"{src!r}|{dst!r}|{self.nodes[v]!r}".encode())
            j = ok[h % len(ok)]
            links.append(int(ks[j]))
            v = int(tails[j])
        return np.array(links[::-1], dtype=np.int64)
