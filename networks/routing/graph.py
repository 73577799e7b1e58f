"""The topology as the arrays the route search works on (`RouteGraph`), the object every
other part of networks.routing's `Routes` reads.

`link_weight` packs the routing rule (see networks.routing) into one integer-valued float
per link: a network link weighs NET_WEIGHT, each ns of latency NS_WEIGHT (mode 'latency' only), each
hop 1. scipy's C Dijkstra sums them exactly (every term stays far below 2**53), so a sum
does not depend on its order and equal-cost paths stay tied.
"""

from __future__ import annotations

import numpy as np

from networks.routing import tuning

# bit budget (sums stay below 2**53): up to 31 network hops, 1 ms of summed latency at 1 ns
# resolution, then hops
NET_WEIGHT = float(2**48)
NS_WEIGHT = float(2**28)  # per ns


def link_weight(d: dict, mode: str = "latency") -> float:
    net = 1 if d.get("kind") == "net" else 0
    lat = int(round(d.get("latency", 0.0) * 1e9)) if mode == "latency" else 0
    return net * NET_WEIGHT + lat * NS_WEIGHT + 1


class RouteGraph:
    """The graph's links and nodes as numpy arrays, and the lookups by link.

    Needs: a DiGraph whose edges carry `latency`, `bandwidth` and (optional) `kind`, and
    whose nodes may carry `kind` ('gpu' unless said), which must not change after; `mode`
    'latency' or 'hops' (`link_weight`). It computes no distance (rows.RouteRows does).

    Gives, set here once and never changed:
    - `graph`, `nodes`, `node_index` (node -> index), `links` (the edges in the graph's
      order; a link is its index there), `link_data` (each link's attributes), `weight`
      (each link's packed weight), `csr` (the weighted adjacency matrix), `u`, `v` (each
      link's tail and head index), `out_deg`, `net_link` (whether each is a network link);
    - the in-links of each node as CSR, in link order: `in_link[in_ptr[v]:in_ptr[v + 1]]`
      and their tails `in_from[...]`; `in_deg`, and `in_pos` (a link's place among its
      head's in-links);
    - lower bounds: `min_out`, `min_in` (each node's lightest link out and in), `direct`
      ((tail, head) -> weight of that link), `local` (each node's component joined
      without network links: a server) and `net_bound(a, b)` (the fewest network links
      between two such components, times the lightest one);
    - GPUs that share rows: `hub` (a node whose only out-link goes to hub x: node ->
      (x, weight); empty when the hubs' rows would not fit tuning.HUB_ROWS_BYTES and each
      hub serves few nodes), `hub_link`, `hub_served` (nodes per hub), and the same as
      arrays over nodes `hub_of` (-1: none), `hub_w`, `hub_link_of`; `via_switches` (GPUs
      whose out-links, two or more, all go to switches) and `served` (how many of those
      each switch serves);
    - the core without pendant nodes (`_pendants`): `core`, `core_csr`, `pend`,
      `pend_from`, `pend_w`;
    - lookups by link: `link_ids`, `link_or_none`, `link_values`.
    """

    def __init__(self, graph, mode: str = "latency"):
        from scipy.sparse import csr_matrix

        self.graph = graph
        self.links = list(graph.edges())
        # each link's attributes, in `links` order (one pass: a lookup per link cost ~7 us)
        self.link_data = [d for *_, d in graph.edges(data=True)]
        nodes = list(graph.nodes)
        self.nodes = nodes
        self.node_index = {v: i for i, v in enumerate(nodes)}
        u = np.array([self.node_index[a] for a, _ in self.links], dtype=np.int64)
        v = np.array([self.node_index[b] for _, b in self.links], dtype=np.int64)
        self.weight = np.array([link_weight(d, mode) for d in self.link_data], float)
        self.csr = csr_matrix((self.weight, (u, v)), shape=(len(nodes), len(nodes)))
        self.u, self.v = u, v
        self._pair_keys = self._pair_link = None  # sorted tail * N + head, link of each
        self._values: dict = {}  # edge attribute -> its value per link
        # in-links as CSR (node -> link indices in link order, and their tails) for the walk
        order = np.argsort(v, kind="stable")
        self.in_ptr = np.searchsorted(v[order], np.arange(len(nodes) + 1))
        self.in_link, self.in_from = order, u[order]
        self.in_deg = np.diff(self.in_ptr)
        self.in_pos = np.empty(len(order), np.int64)  # a link's place among its head's in-links
        self.in_pos[order] = np.arange(len(order)) - self.in_ptr[v[order]]
        self.min_out = np.full(len(nodes), np.inf)
        np.minimum.at(self.min_out, u, self.weight)
        self.min_in = np.full(len(nodes), np.inf)
        np.minimum.at(self.min_in, v, self.weight)
        # nodes joined without network links (a server): a path between two of them that
        # are not must cross a network link, so it is at least NET_WEIGHT long (a bound that
        # saves the bounded searches most of their 4x steps to a GPU in another server)
        from scipy.sparse.csgraph import connected_components

        # network links: a route's count of them comes first, and among equal-cost routes
        # the walk takes them as late as it can (walks: NVLink first, PXN at the sender)
        self.net_link = np.array([d.get("kind") == "net" for d in self.link_data], bool)
        local = ~self.net_link
        self.local = connected_components(
            csr_matrix(
                (np.ones(int(local.sum())), (u[local], v[local])), shape=(len(nodes), len(nodes))
            ),
            directed=False,
        )[1]
        self.direct = {
            (a, b): w for a, b, w in zip(u.tolist(), v.tolist(), self.weight.tolist(), strict=True)
        }
        # a node whose only out-link goes to X (a GPU on a leaf switch) is w + X's row away
        # from everything else: one full row per such X serves all its GPUs (a fat tree:
        # one per leaf), when these rows fit in tuning.HUB_ROWS_BYTES or each serves enough
        # nodes (tuning.HUB_SHARED) to be worth a search of the machine; rows that do not
        # fit are searched again when asked (rows.`full_row`). Without hubs every source
        # keeps a ball of its own: at 131,072 GPUs on a fat tree (512 leaves' rows, 540 MB)
        # those covered the machine, 20 GB and growing
        out_deg = np.bincount(u, minlength=len(nodes))
        single = np.flatnonzero(out_deg[u] == 1)  # links that are their tail's only one
        self.hub = {int(u[k]): (int(v[k]), float(self.weight[k])) for k in single}
        self.hub_link = {int(u[k]): int(k) for k in single}
        self.hub_served = np.bincount(
            np.array([x for x, _ in self.hub.values()], np.int64), minlength=len(nodes)
        )
        hubs = int((self.hub_served > 0).sum())
        if (
            hubs * len(nodes) * 8 > tuning.HUB_ROWS_BYTES
            and len(self.hub) < tuning.HUB_SHARED * hubs
        ):
            self.hub, self.hub_link = {}, {}
        self.hub_of = np.full(len(nodes), -1, np.int64)  # the same as arrays over nodes
        self.hub_w = np.zeros(len(nodes))
        self.hub_link_of = np.full(len(nodes), -1, np.int64)
        for s, (x, w) in self.hub.items():
            self.hub_of[s], self.hub_w[s], self.hub_link_of[s] = x, w, self.hub_link[s]
        # a GPU whose out-links all go to switches (an NVSwitch and a NIC's leaf) is, to every
        # other node, min over those links of (weight + the switch's distance): the switches'
        # rows are shared by the GPUs on them (a server's 8, a rail's thousands), so a row
        # costs a minimum of a few shared rows instead of a search of the machine
        is_switch = np.array([graph.nodes[x].get("kind", "gpu") != "gpu" for x in nodes], bool)
        bad = np.zeros(len(nodes), bool)
        np.logical_or.at(bad, u, ~is_switch[v])
        self.via_switches = (out_deg >= 2) & ~bad & ~is_switch
        # how many such GPUs each switch serves: the rows kept when they do not all fit are
        # the most shared ones (a rail's leaf serves thousands, a server's NVSwitch eight)
        self.served = np.bincount(v[self.via_switches[u]], minlength=len(nodes))
        self._comp_graph = None  # components joined by network links (`net_bound`)
        self.out_deg = out_deg
        self._pendants(u, v, out_deg)

    NEIGHBOUR_RULE = 16  # components with at most this many neighbours: via theirs

    def _comp_hops_to(self, c: int, targets: np.ndarray) -> np.ndarray:
        """Fewest network links from component c to each of `targets`. A component with a
        few neighbours (a server: its rail leaves) is 1 + the least of its neighbours'
        counts (0 to itself), from their searches, kept: one search per leaf instead of
        one per server (at 131,072 GPUs on the rail cluster, 16,384 servers' searches
        were 30 % of a symmetric 3D run). The same integers as its own search."""
        g = self._comp_graph
        hops = self._comp_hops.get(c)
        if hops is not None:
            return hops[targets]
        nbrs = g.indices[g.indptr[c] : g.indptr[c + 1]]
        nbrs = nbrs[nbrs != c]
        if not 0 < len(nbrs) <= self.NEIGHBOUR_RULE:
            return self._comp_search(c)[targets]
        out = np.full(len(targets), np.inf)
        for w in nbrs.tolist():
            np.minimum(out, self._comp_search(w)[targets], out=out)
        out += 1.0
        out[targets == c] = 0.0
        return out

    def _comp_search(self, c: int) -> np.ndarray:
        """Fewest network links from component c to every component (a search, kept)."""
        hops = self._comp_hops.get(c)
        if hops is None:
            from scipy.sparse.csgraph import dijkstra

            hops = self._comp_hops[c] = dijkstra(self._comp_graph, indices=c, unweighted=True)
        return hops

    def _pendants(self, u, v, out_deg) -> None:
        """Pendant nodes: one link out and one in, both with the same neighbour that is not
        itself pendant (a GPU on a leaf switch). No shortest path passes through one (it
        would leave by the link it came in on), so distances between the other nodes (the
        core) are the core graph's, and a pendant is its neighbour's distance plus its
        in-link's weight: integers, so the same float as a search of the whole graph
        (rows.`full_row`: 1,280 core nodes, not 132,352, at 131,072 GPUs on a fat tree).
        `core` (node -> index in the core, -1 for a pendant), `core_csr`, `pend`,
        `pend_from`, `pend_w`."""
        n = len(self.nodes)
        head = np.full(n, -1, np.int64)
        one_out = out_deg[u] == 1
        head[u[one_out]] = v[one_out]
        tail = np.full(n, -1, np.int64)
        one_in = np.flatnonzero(self.in_deg == 1)
        tail[one_in] = self.in_from[self.in_ptr[one_in]]
        pend = (head >= 0) & (head == tail)
        pend &= ~pend[np.maximum(tail, 0)]
        self.pend = np.flatnonzero(pend)
        self.pend_from = tail[self.pend]
        self.pend_w = self.weight[self.in_link[self.in_ptr[self.pend]]]
        core = np.flatnonzero(~pend)
        self.core = np.full(n, -1, np.int64)
        self.core[core] = np.arange(len(core))
        self.core_csr = self.csr[core][:, core] if len(self.pend) else None

    def link_ids(self, tails: np.ndarray, heads: np.ndarray) -> np.ndarray:
        """The index in `links` of each (tail, head) pair of node indices; every pair must
        be a link (one sorted search for all, not a graph lookup per hop)."""
        keys, link = self._sorted_pairs()
        return link[np.searchsorted(keys, np.asarray(tails, np.int64) * len(self.nodes) + heads)]

    def _sorted_pairs(self):
        """Every link's tail * N + head, sorted, and the link of each."""
        if self._pair_keys is None:
            keys = self.u * len(self.nodes) + self.v
            order = np.argsort(keys, kind="stable")
            self._pair_keys, self._pair_link = keys[order], order
        return self._pair_keys, self._pair_link

    def link_or_none(self, tails: np.ndarray, heads: np.ndarray) -> np.ndarray:
        """`link_ids` where (tail, head) is a link, -1 where it is not."""
        keys, link = self._sorted_pairs()
        if not len(keys) or not len(tails):
            return np.full(len(tails), -1, np.int64)
        key = np.asarray(tails, np.int64) * len(self.nodes) + heads
        k = np.minimum(np.searchsorted(keys, key), len(keys) - 1)
        return np.where(keys[k] == key, link[k], -1)

    def link_values(self, attr: str) -> np.ndarray:
        """Each link's `attr` (an edge attribute every link has), in `links` order."""
        out = self._values.get(attr)
        if out is None:
            edges = self.graph.edges
            out = self._values[attr] = np.array([edges[e][attr] for e in self.links], float)
        return out

    def net_bound(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """A lower bound of the distance from a node of component a[i] to one of b[i]
        (components joined without network links): the fewest network links between
        them times the lightest network link's weight (other links weigh more than 0)."""
        if self._comp_graph is None:
            from scipy.sparse import csr_matrix

            net = np.flatnonzero(self.net_link)
            n = int(self.local.max()) + 1 if len(self.local) else 0
            cu, cv = self.local[self.u[net]], self.local[self.v[net]]
            g = csr_matrix((np.ones(len(net)), (cu, cv)), shape=(n, n))
            g.sum_duplicates()  # (sorted, distinct neighbours per row)
            self._comp_graph = g
            self._net_w = float(self.weight[net].min()) if len(net) else 0.0
            self._comp_hops: dict = {}
        out = np.empty(len(a))
        for c in np.unique(a).tolist():
            on = a == c
            out[on] = self._comp_hops_to(c, b[on])
        bound = np.full(len(out), np.inf)  # no path at all
        fin = np.isfinite(out)
        bound[fin] = out[fin] * self._net_w
        return bound
