"""Routes through a topology: which links a transfer from one node to another crosses.

The rule, in order of precedence:
1. fewest inter-node links (edges with kind='net'): traffic inside a node never leaves it
   through the inter-node fabric when an NVLink/NVSwitch/PCIe path exists, whatever the
   latencies; between nodes, the path with fewest network hops (a GPU may forward over
   NVLink to the GPU on the right rail first, as NCCL's PXN does);
2. least summed latency (mode 'latency'; skipped in mode 'hops');
3. fewest hops.
Equal-cost paths are spread by a hash of (source, destination) (ECMP).
A link's bandwidth never decides a route, as it does not in a switch's forwarding table:
a route that moved away from a link made slightly slower could land on a less loaded one
and finish sooner, so a slower link could make a run faster (issue 29).

The keys are packed into one integer-valued float per link so scipy's C Dijkstra sums
them exactly (every term stays far below 2**53), and equal-cost paths stay tied.
"""

from __future__ import annotations

import zlib

import numpy as np

LINK_KINDS = ("nvlink", "pcie", "net")
# memory for shared rows of switches (see Routes): a 16,384-GPU rail cluster's 2,056 switch
# rows over its 18,448 nodes take 303 MB; at 256 MB a few hundred were searched again per walk
HUB_ROWS_BYTES = 2**29
CANDIDATES = 2**20  # in-links weighed at once when paths are walked in a batch
# a hub with more out-links than this serves its GPUs' hop metrics from one shared spread
# (a search from a GPU under a big switch relaxes every link of it: O(N) per GPU on a star)
SPREAD_DEGREE = 256
SPREAD_LEVELS = 64  # a spread deeper than this (hops) is left to the per-source trees
# a walk looks a node's candidates up by value (not a scan of its in-links) when it has
# more than BIG_IN in-links and at least SHARED_ASKS walkers ask it with one row (a rail's
# leaf, asked by every GPU of the rail; a fat tree's hub rows are asked once each)
BIG_IN = 64
SHARED_ASKS = 8
# bit budget (sums stay below 2**53): up to 31 network hops, 1 ms of summed latency at 1 ns
# resolution, then hops
_NET = float(2**48)
_LAT = float(2**28)  # per ns


def link_weight(d: dict, mode: str = "latency") -> float:
    net = 1 if d.get("kind") == "net" else 0
    lat = int(round(d.get("latency", 0.0) * 1e9)) if mode == "latency" else 0
    return net * _NET + lat * _LAT + 1


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
        self._in_deg = np.diff(self._in_ptr)
        self._in_pos = np.empty(len(order), np.int64)  # a link's place among its head's in-links
        self._in_pos[order] = np.arange(len(order)) - self._in_ptr[v[order]]
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
            csr_matrix(
                (np.ones(int(local.sum())), (u[local], v[local])), shape=(len(nodes), len(nodes))
            ),
            directed=False,
        )[1]
        self._direct = {
            (a, b): w for a, b, w in zip(u.tolist(), v.tolist(), self.weight.tolist(), strict=True)
        }
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
        self._hub_of = np.full(len(nodes), -1, np.int64)  # the same as arrays over nodes
        self._hub_w = np.zeros(len(nodes))
        self._hub_link_of = np.full(len(nodes), -1, np.int64)
        for s, (x, w) in self._hub.items():
            self._hub_of[s], self._hub_w[s], self._hub_link_of[s] = x, w, self._hub_link[s]
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
        self._comp_graph = None  # components joined by network links (`_net_bound`)
        self._out_deg = out_deg
        self._spreads: dict = {}  # switch index -> (hops, least and most bottleneck) rows

    def link_ids(self, tails: np.ndarray, heads: np.ndarray) -> np.ndarray:
        """The index in `links` of each (tail, head) pair of node indices; every pair must
        be a link (one sorted search for all, not a graph lookup per hop)."""
        keys, link = self._sorted_pairs()
        return link[np.searchsorted(keys, np.asarray(tails, np.int64) * len(self.nodes) + heads)]

    def _sorted_pairs(self):
        """Every link's tail * N + head, sorted, and the link of each."""
        if self._pair_keys is None:
            keys = self._u * len(self.nodes) + self._v
            order = np.argsort(keys, kind="stable")
            self._pair_keys, self._pair_link = keys[order], order
        return self._pair_keys, self._pair_link

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
        does not apply (a source not behind big switches, or some path's bottleneck that
        depends on which of several equal-cost paths a tree takes).

        A source whose out-links all go to switches (one link into a hub; a GPU's NVSwitch
        and rail leaf) leaves by one of them, k, and goes on along switch x_k's shortest
        paths (none returns through the source: that would be longer). So its distance is
        the least over k of w_k + x_k's row, its hops one more than x_k's for a k that
        attains it (the tight ones), and its bottleneck over the tight k the smaller of
        link k's bandwidth and that of x_k's path. A tree takes one of these equal-cost
        paths, which all have the same hops and distance (both are in the packed weight)
        but maybe not the same bottleneck: each switch's spread keeps the least and the
        most over all of them, and where the two differ over the tight k the answer would
        depend on the tree's tie-break, so None. Only for switches of more than
        SPREAD_DEGREE ports (a search from each GPU under one relaxes all of them)."""
        idx = self.node_index
        t_idx = np.array([idx[t] for t in targets], dtype=np.int64)
        bandwidth = self.link_values("bandwidth")
        out = []
        for s in (idx[v] for v in sources):
            reads = self._reads(s, t_idx)
            if reads is None:
                return None
            vals = np.array([w + row[t_idx] for _, w, _, row in reads])
            d = vals.min(axis=0)
            ok = np.isfinite(d) & (t_idx != s)
            tight = (vals == d) & ok
            lo = np.full(len(t_idx), np.inf)
            hi = np.zeros(len(t_idx))
            hops = np.full(len(t_idx), np.inf)
            for (x, _, link, _), on in zip(reads, tight, strict=True):
                if not on.any():
                    continue
                spread = self._spread(x)
                if spread is None:
                    return None
                level, least, most = spread
                b_link = bandwidth[link]
                lo[on] = np.minimum(lo[on], np.minimum(b_link, least[t_idx[on]]))
                hi[on] = np.maximum(hi[on], np.minimum(b_link, most[t_idx[on]]))
                hops[on] = 1.0 + level[t_idx[on]]
            if (lo[ok] != hi[ok]).any():
                return None
            own = t_idx == s
            d[own] = 0.0
            b = np.where(ok, lo, 0.0)
            b[own] = np.inf
            hops[own] = 0.0
            out.append((b, d, hops))
        return out

    def _reads(self, s: int, t_idx: np.ndarray, small: bool = False) -> list | None:
        """(switch, link weight, link, switch's row) of each out-link of source s that can
        be on a shortest path to some target, the most shared switch first (its row bounds
        the distances; another is left out where a lower bound, as in `_bounded_reads`,
        is longer for every target); None unless s's out-links all go to switches and,
        unless `small`, those that can be on the way have more than SPREAD_DEGREE ports."""
        big = self._out_deg > (-1 if small else SPREAD_DEGREE)
        h = self._hub.get(s)
        if h:
            x, w = h
            return [(x, w, self._hub_link[s], self._full_row(x, hub=True))] if big[x] else None
        if not self._via_switches[s]:
            return None
        csr = self._csr
        heads = sorted(
            csr.indices[csr.indptr[s] : csr.indptr[s + 1]].tolist(), key=lambda x: -self._served[x]
        )
        links = self.link_ids(np.full(len(heads), s), np.array(heads, np.int64))
        reads, upper = [], None
        for x, k in zip(heads, links.tolist(), strict=True):
            w = float(self.weight[k])
            if upper is not None:
                lower = w + self._net_bound(np.full(len(t_idx), self._local[x]), self._local[t_idx])
                if (lower > upper).all():
                    continue
            if not big[x]:  # a small switch may be on the way: the trees cost less
                return None
            row = self._full_row(x, hub=False)
            reads.append((x, w, k, row))
            upper = w + row[t_idx] if upper is None else np.minimum(upper, w + row[t_idx])
        return reads

    def _spread(self, x: int):
        """Switch x's (hops, least bottleneck, most bottleneck) over all its shortest paths to
        each node, by levels of the shortest-path DAG (links with d[u] + w == d[v]); None
        when deeper than SPREAD_LEVELS. Kept while they fit HUB_ROWS_BYTES."""
        if x in self._spreads:
            return self._spreads[x]
        d = self._full_row(x, hub=x in self._hub_rows)
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

    def _via_dist(self, s: int, d: int):
        """For a GPU whose out-links all go to switches: its distances as a function of node
        indices, the least over the out-links that can be on the way to d (`_reads`) of
        weight + the switch's shared row (0 at s), as `_per_source` reads them. A bounded
        search of its own to another server covers the machine, and one kept per GPU took
        4.8 GB at 16,384 GPUs."""
        outs = [(w, row) for _, w, _, row in self._reads(s, np.array([d]), small=True)]

        def dist(ix):
            d = outs[0][0] + outs[0][1][ix]
            for w, row in outs[1:]:
                d = np.minimum(d, w + row[ix])
            return np.where(ix == s, 0.0, d)

        return dist

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
        _, idx, dist = self._ball(s, d)
        row = np.full(len(self.nodes), np.inf)
        row[idx] = dist
        return row

    def _ball(self, s: int, d: int) -> tuple:
        """(limit, reached nodes in order, their distances) of a search from node s bounded
        to cover d: exact for every node not farther than d. Kept per source, grown 4x."""
        from scipy.sparse.csgraph import dijkstra

        ball = self._balls.get(s)
        if ball is not None:
            limit, idx, dist = ball
            k = int(np.searchsorted(idx, d))
            if (k < len(idx) and idx[k] == d) or limit == np.inf:
                return ball
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
        ball = self._balls[s] = (limit, idx, row[idx])
        return ball

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

    def _per_source(self, s_idx: np.ndarray, d_idx: np.ndarray):
        """Per pair, from its source: the distance rows it reads and their offsets (pairs x
        K arrays: its distance to a node is the least of offset + row there), its hub and
        its link into the hub (-1: none). Worked out once per distinct source:
        - a source with one out-link into hub x: x's shared row, offset the link's weight;
        - a GPU whose out-links all go to switches (an NVSwitch and a NIC's leaf): each
          switch's row, offset that link's weight (one Bellman step: any path leaves by one
          of them; the weights are integers whose sums stay below 2**53, so the least is
          the search's own distance, exactly). The switches' rows are shared by the GPUs on
          them (a server's eight, a rail's thousands), and no row per GPU is made;
        - anything else, or such a GPU asked only for GPUs of its own server (its bounded
          search stays in the server; a full row of the machine per NVSwitch cost 1.5 ms
          at 16,384 GPUs, and thousands of them do not stay cached): its own bounded ball
          (`_ball`), offset 0.
        Rows a source reads fewer than K of are repeated (the least is the same)."""
        u, inv = np.unique(s_idx, return_inverse=True)
        far = np.zeros(len(u), bool)  # some destination outside the source's server
        np.logical_or.at(far, inv, self._local[d_idx] != self._local[s_idx])
        hub = self._hub_of[u]
        on_hub = hub >= 0
        via = np.flatnonzero(self._via_switches[u] & far & ~on_hub)
        own = ~on_hub
        own[via] = False
        hubs, at_hub = np.unique(hub[on_hub], return_inverse=True)
        keys = [("h", x) for x in hubs.tolist()] + [("s", x) for x in u[own].tolist()]
        first = np.empty(len(u), np.int64)
        first[on_hub] = at_hub.reshape(-1)
        first[own] = len(hubs) + np.arange(int(own.sum()))
        first_off = np.where(on_hub, self._hub_w[u], 0.0)
        switch_key: dict = {}  # switch -> its key number
        csr, reads = self._csr, []
        for s in u[via].tolist():
            reads.append(
                [
                    (
                        switch_key.setdefault(int(csr.indices[k]), len(keys) + len(switch_key)),
                        float(csr.data[k]),
                    )
                    for k in range(csr.indptr[s], csr.indptr[s + 1])
                ]
            )
        keys += [("w", x) for x in switch_key]
        width = max([1] + [len(r) for r in reads])
        kid = np.repeat(first[:, None], width, axis=1)
        off = np.repeat(first_off[:, None], width, axis=1)
        for i, r in zip(via.tolist(), reads, strict=True):
            r = r + r[:1] * (width - len(r))  # read fewer than K: repeated (the least is the same)
            kid[i] = [k for k, _ in r]
            off[i] = [w for _, w in r]
        return keys, kid, off, inv, hub[inv], self._hub_link_of[u][inv]

    def _dist_rows(self, keys, kid, d_idx) -> _Rows:
        """The distance rows of row keys `keys` (pairs read rows kid[p], destination
        d_idx[p]): a hub's or a switch's full row, or a source's bounded ball (`_ball`, only
        ever its pairs' one row) grown until every destination asked of it is in. Any row
        exact up to the destination gives the same paths (see the class)."""
        rows = _Rows(len(self.nodes), len(keys))
        first = kid[:, 0]
        order = np.argsort(first, kind="stable")
        bounds = np.searchsorted(first[order], np.arange(len(keys) + 1))
        for r, (kind, x) in enumerate(keys):
            if kind in ("h", "w"):
                rows.add_full(r, self._full_row(x, hub=kind == "h"))
                continue
            ds = d_idx[order[bounds[r] : bounds[r + 1]]]
            out = ds[:1]
            while len(out):  # balls only grow: the last covers every earlier one
                ball = self._ball(x, int(out[0]))
                out = ds[~_in_sorted(ball[1], ds)]
                if len(out) and ball[0] == np.inf:
                    break  # the rest are unreachable
            rows.add_ball(r, ball[1], ball[2])
        rows.close()
        return rows

    def _walk_many(self, pairs) -> None:
        """Walk back from every destination at once, one hop per round (the rule of
        `walk_links`); store each pair's path (or None) in self._paths. Pairs go in chunks
        whose distance rows fit in HUB_ROWS_BYTES, sources taken in the order of the rows
        they read (each pair's path is its own, so any grouping gives the same paths)."""
        idx = self.node_index
        s_idx = np.array([idx[s] for s, _ in pairs], np.int64)
        d_idx = np.array([idx[d] for _, d in pairs], np.int64)
        keys, kid, off, src, hub, link = self._per_source(s_idx, d_idx)
        reads, offs = kid[src], off[src]
        if reads.shape[1] > 1:
            reads, offs = self._bounded_reads(keys, reads, offs, d_idx)
        budget = max(1, HUB_ROWS_BYTES // (8 * max(len(self.nodes), 1)))
        if len(np.unique(reads)) <= budget:
            chunks = [np.arange(len(pairs))]
        else:
            kinds, cls = np.unique(reads, axis=0, return_inverse=True)  # in row order
            of_kind = np.empty(len(kinds), np.int64)
            held: set = set()
            c = 0
            for i, r in enumerate(kinds.tolist()):
                mine = set(r)
                if held and len(held | mine) > budget:
                    c, held = c + 1, set()
                held |= mine
                of_kind[i] = c
            of_pair = of_kind[cls.reshape(-1)]
            chunks = [np.flatnonzero(of_pair == c) for c in range(c + 1)]
        for sel in chunks:
            rows = reads[sel]
            used = np.unique(rows)
            local = np.full(len(keys), -1, np.int64)
            local[used] = np.arange(len(used))
            self._walk_chunk(
                [pairs[i] for i in sel.tolist()],
                s_idx[sel],
                d_idx[sel],
                [keys[k] for k in used.tolist()],
                local[rows],
                offs[sel],
                hub[sel],
                link[sel],
            )

    def _bounded_reads(self, keys, reads, offs, d_idx):
        """Reads (switch rows) that cannot be on a shortest path to the pair's destination
        dropped before their rows are searched for (replaced by the first kept). Each pair's
        most-read row (a rail's leaf, shared by the rail's GPUs) is searched first and
        bounds the distance from above; another read j is dropped when even a lower bound
        of it, off_j + (network links any path from switch j to the destination crosses)
        x (the lightest network link), is longer. `_tight_reads` would drop it too, so the
        paths are the same; an NVSwitch's row of the machine (1.5 ms at 16,384 GPUs) is
        then searched only where the NVSwitch can be on the way (PXN)."""
        m, width = reads.shape
        count = np.bincount(reads.ravel(), minlength=len(keys))
        first = reads[np.arange(m), np.argmax(count[reads], axis=1)]
        upper = np.full(m, np.inf)
        for k in np.unique(first).tolist():
            kind, x = keys[k]
            if kind == "s":  # a source's own ball: its pairs read nothing else
                continue
            row = self._full_row(x, hub=kind == "h")
            for j in range(width):
                on = np.flatnonzero(reads[:, j] == k)
                upper[on] = np.minimum(upper[on], offs[on, j] + row[d_idx[on]])
        comp = self._local
        nodes = np.array([x for _, x in keys], np.int64)
        lower = np.empty((m, width))
        for j in range(width):
            lower[:, j] = offs[:, j] + self._net_bound(comp[nodes[reads[:, j]]], comp[d_idx])
        return _keep_reads(reads, offs, ~(lower > upper[:, None]))

    def _net_bound(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """A lower bound of the distance from a node of component a[i] to one of b[i]
        (components joined without network links): the fewest network links between
        them times the lightest network link's weight (other links weigh more than 0)."""
        if self._comp_graph is None:
            from scipy.sparse import csr_matrix

            net = np.flatnonzero(
                np.array([self.graph.edges[e].get("kind") == "net" for e in self.links], bool)
            )
            n = int(self._local.max()) + 1 if len(self._local) else 0
            cu, cv = self._local[self._u[net]], self._local[self._v[net]]
            self._comp_graph = csr_matrix((np.ones(len(net)), (cu, cv)), shape=(n, n))
            self._net_w = float(self.weight[net].min()) if len(net) else 0.0
            self._comp_hops: dict = {}
        out = np.empty(len(a))
        for c in np.unique(a).tolist():
            hops = self._comp_hops.get(c)
            if hops is None:
                from scipy.sparse.csgraph import dijkstra

                hops = self._comp_hops[c] = dijkstra(self._comp_graph, indices=c, unweighted=True)
            on = a == c
            out[on] = hops[b[on]]
        bound = np.full(len(out), np.inf)  # no path at all
        fin = np.isfinite(out)
        bound[fin] = out[fin] * self._net_w
        return bound

    def _walk_chunk(self, pairs, s_idx, d_idx, keys, row, off, hub, hub_link) -> None:
        rows = self._dist_rows(keys, row, d_idx)
        row, off = self._tight_reads(rows, row, off, s_idx, d_idx)
        width = row.shape[1]

        def dist(p, v):
            d = off[p, 0] + rows.at(row[p, 0], v)
            for j in range(1, width):
                d = np.minimum(d, off[p, j] + rows.at(row[p, j], v))
            return np.where(v == s_idx[p], 0.0, d)

        m, n = len(pairs), len(self.nodes)
        # pairs whose sources read the same rows at the same offsets have the same
        # distances everywhere but at their sources, which only a hub's GPUs can share
        # (below, a source is never a candidate tail); other sources are their own class
        _, off_cls = np.unique(off, return_inverse=True)
        own = np.where(hub < 0, s_idx, -1)[:, None]
        _, reader = np.unique(
            np.hstack([row, off_cls.reshape(off.shape), own]), axis=0, return_inverse=True
        )
        reader = reader.reshape(-1)
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
                # the equal-cost candidates depend on (rows, offsets, v) only (the source
                # itself is never a candidate here: its one out-link is the hub's, handled
                # above, or its distance is 0 either way): find them once per distinct pair
                trip = reader[p] * n + vm
                _, first_u, inv = np.unique(trip, return_index=True, return_inverse=True)
                pu, vu = p[first_u], vm[first_u]
                big = self._in_deg[vu] > BIG_IN
                if big.any():  # where several ask one (row, node): a sort for them all
                    at = np.flatnonzero(big)
                    _, c_inv, c_n = np.unique(
                        row[pu[at], 0] * n + vu[at], return_inverse=True, return_counts=True
                    )
                    big[at[c_n[c_inv.reshape(-1)] < SHARED_ASKS]] = False
                if big.any():  # a rail's leaf: thousands of in-links, looked up by value
                    ok_k, ok_t, cnt_u = self._merge(
                        self._candidates(pu[~big], vu[~big], dist),
                        self._candidates_big(
                            pu[big], vu[big], dist(pu[big], vu[big]), row, off, rows, s_idx
                        ),
                        ~big,
                    )
                else:
                    ok_k, ok_t, cnt_u = self._candidates(pu, vu, dist)
                cnt = cnt_u[inv]
                pick = (np.cumsum(cnt_u) - cnt_u)[inv]  # the first equal-cost candidate
                tie = np.flatnonzero(cnt > 1)
                if len(tie):  # several: spread by a hash of (source, destination, node) (ECMP)
                    nodes = self.nodes
                    h = [
                        zlib.crc32(f"{pairs[q][0]!r}|{pairs[q][1]!r}|{nodes[x]!r}".encode())
                        for q, x in zip(p[tie].tolist(), vm[tie].tolist(), strict=True)
                    ]
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

    @staticmethod
    def _tight_reads(rows, row, off, s_idx, d_idx):
        """Each pair's reads cut to those on a shortest path to its destination (a first
        hop j with off_j + row_j[d] == the distance; the others replaced by the first such),
        and columns every pair now repeats dropped. Exact: every node u a walk back from d
        meets lies on a shortest path whose first hop is such a j, so off_j + row_j[u] is
        u's distance there, and the least over the kept reads is the least over all. A
        rail's GPU (an NVSwitch and a leaf) sending to another server reads only its leaf's
        row."""
        if row.shape[1] == 1:
            return row, off
        vals = np.stack(
            [off[:, j] + rows.at(row[:, j], d_idx) for j in range(row.shape[1])], axis=1
        )
        return _keep_reads(row, off, vals == vals.min(axis=1, keepdims=True))

    @staticmethod
    def _merge(a, b, in_a):
        """Two `_candidates` answers over complementary subsets (in_a: which items are a's)
        merged into one, in item order."""
        ka, ta, ca = a
        kb, tb, cb = b
        owner = np.concatenate(
            [np.repeat(np.flatnonzero(in_a), ca), np.repeat(np.flatnonzero(~in_a), cb)]
        )
        order = np.argsort(owner, kind="stable")
        cnt = np.zeros(len(in_a), np.int64)
        cnt[in_a], cnt[~in_a] = ca, cb
        return np.concatenate([ka, kb])[order], np.concatenate([ta, tb])[order], cnt

    def _candidates_big(self, pu, vu, dv, row, off, rows, s_idx):
        """`_candidates` for nodes with many in-links, by value: in-link u -> v is on a
        shortest path from p's source iff some read j has row_j[u] + w == d_v - off_j
        (every read is at least the distance, and the distance at u plus w is at least
        d_v), or u is the source itself and w == d_v. Per distinct (read, node) the
        in-links' row_j[u] + w are sorted once and each pair looks its value up."""
        in_ptr, in_link, in_from, w = self._in_ptr, self._in_link, self._in_from, self.weight
        n, width = len(self.nodes), row.shape[1]
        qi = np.repeat(np.arange(len(pu)), width)
        qkey = row[pu].ravel()
        qv = np.repeat(vu, width)
        qt = (dv[:, None] - off[pu]).ravel()
        combos, cinv = np.unique(qkey * n + qv, return_inverse=True)
        cinv = cinv.reshape(-1)
        owners, poss = [], []
        for c, code in enumerate(combos.tolist()):
            key, v = divmod(code, n)
            lo, hi = int(in_ptr[v]), int(in_ptr[v + 1])
            vals = rows.at(np.full(hi - lo, key), in_from[lo:hi]) + w[in_link[lo:hi]]
            order = np.argsort(vals, kind="stable")
            vals = vals[order]
            q = np.flatnonzero(cinv == c)
            a = np.searchsorted(vals, qt[q], "left")
            b = np.searchsorted(vals, qt[q], "right")
            cnt = b - a
            if cnt.any():
                at = np.repeat(a - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))
                owners.append(np.repeat(qi[q], cnt))
                poss.append(order[at])
        # the source itself: dist 0, so its link u -> v is tight when w == d_v
        link = self._link_or_none(s_idx[pu], vu)
        mine = np.flatnonzero(link >= 0)
        mine = mine[w[link[mine]] == dv[mine]]
        owners.append(mine)
        poss.append(self._in_pos[link[mine]])
        code = np.unique(
            np.concatenate(owners) * (int(self._in_deg.max()) + 1) + np.concatenate(poss)
        )
        owner, pos = np.divmod(code, int(self._in_deg.max()) + 1)
        at = in_ptr[vu[owner]] + pos
        return in_link[at], in_from[at], np.bincount(owner, minlength=len(pu))

    def _link_or_none(self, tails: np.ndarray, heads: np.ndarray) -> np.ndarray:
        """`link_ids` where (tail, head) is a link, -1 where it is not."""
        keys, link = self._sorted_pairs()
        if not len(keys) or not len(tails):
            return np.full(len(tails), -1, np.int64)
        key = np.asarray(tails, np.int64) * len(self.nodes) + heads
        k = np.minimum(np.searchsorted(keys, key), len(keys) - 1)
        return np.where(keys[k] == key, link[k], -1)

    def _candidates(self, pu, vu, dist):
        """For each (pair pu[i], node vu[i]): the in-links of vu[i] on a shortest path from
        the pair's source (in link order) and their tails, concatenated, and how many each
        has. In slices of about CANDIDATES in-links, so memory stays bounded (a leaf switch
        of a large fat tree has hundreds of in-links)."""
        in_ptr, in_link, in_from, w = self._in_ptr, self._in_link, self._in_from, self.weight
        if not len(vu):
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
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
        elif self._via_switches[s_idx] and self._local[s_idx] != self._local[d_idx]:
            dist = self._via_dist(s_idx, d_idx)
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


def _keep_reads(reads: np.ndarray, offs: np.ndarray, keep: np.ndarray):
    """Each pair's reads where `keep` says (the others replaced by its first kept one: the
    least over them is the same), then the columns every pair now repeats dropped."""
    m, width = reads.shape
    sel = np.where(keep, np.arange(width), np.argmax(keep, axis=1)[:, None])
    reads = reads[np.arange(m)[:, None], sel]
    offs = offs[np.arange(m)[:, None], sel]
    cols = [0] + [
        j
        for j in range(1, width)
        if (reads[:, j] != reads[:, 0]).any() or (offs[:, j] != offs[:, 0]).any()
    ]
    return reads[:, cols], offs[:, cols]


def _in_sorted(sorted_ids: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Whether each of x is in the sorted array."""
    if not len(sorted_ids):
        return np.zeros(len(x), bool)
    k = np.minimum(np.searchsorted(sorted_ids, x), len(sorted_ids) - 1)
    return sorted_ids[k] == x


class _Rows:
    """The distance rows one walk reads: full rows (hubs', switches') in one matrix, and
    bounded balls (a source's own search) as sorted (row, node) codes, so a walk of a few
    GPUs in a big machine does not fill a row of every node per source (a tensor-parallel
    group's ring in a 16,384-GPU cluster: its balls hold a server each)."""

    def __init__(self, n: int, n_keys: int):
        self.n = n
        self.slot = np.full(n_keys, -1, np.int64)  # key -> its row in the matrix, or -1
        self._full: list = []
        self._codes: list = []
        self._vals: list = []

    def add_full(self, r: int, row: np.ndarray) -> None:
        self.slot[r] = len(self._full)
        self._full.append(row)

    def add_ball(self, r: int, idx: np.ndarray, dist: np.ndarray) -> None:
        self._codes.append(r * self.n + idx)
        self._vals.append(dist)

    def close(self) -> None:
        self.matrix = np.stack(self._full) if self._full else np.zeros((0, self.n))
        codes = np.concatenate(self._codes) if self._codes else np.zeros(0, np.int64)
        vals = np.concatenate(self._vals) if self._vals else np.zeros(0)
        order = np.argsort(codes, kind="stable")  # keys were added in order: a no-op sort
        self.codes, self.vals = codes[order], vals[order]
        self._full = self._codes = self._vals = None

    def at(self, r: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Row r[i]'s distance at node v[i] (inf outside a ball)."""
        slot = self.slot[r]
        full = slot >= 0
        if full.all():
            return self.matrix[slot, v]
        out = np.full(len(r), np.inf)
        if full.any():
            out[full] = self.matrix[slot[full], v[full]]
        ball = np.flatnonzero(~full)
        code = r[ball] * self.n + v[ball]
        hit = _in_sorted(self.codes, code)
        k = np.searchsorted(self.codes, code[hit])
        out[ball[hit]] = self.vals[k]
        return out
