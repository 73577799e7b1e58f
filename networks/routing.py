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


class Routes:
    """Shortest paths by the rule above over a DiGraph with `bandwidth`, `latency` and
    (optional) `kind` on every edge.

    Distances are computed per source, bounded: a Dijkstra from the source stops at a limit
    that first covers the destination (the direct link's weight where there is one, else a
    lower bound, raised 4x until the destination is in), and only the nodes it reached are
    kept. Every node on a shortest path to the destination is within the limit, and a
    node beyond it cannot be an equal-cost predecessor, so the paths are those of the
    unbounded rows (the packed weights sum exactly, in any order). Memory is O(nodes
    near each source), not sources x nodes (2 GB at 16,384 GPUs)."""

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
        # in-links as CSR (node -> link indices in link order, and their tails) for the walk
        order = np.argsort(v, kind="stable")
        self._in_ptr = np.searchsorted(v[order], np.arange(len(nodes) + 1))
        self._in_link, self._in_from = order, u[order]
        self._min_out = np.full(len(nodes), np.inf)
        np.minimum.at(self._min_out, u, self.weight)
        self._min_in = np.full(len(nodes), np.inf)
        np.minimum.at(self._min_in, v, self.weight)
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

    def distances(self, sources) -> None:
        """Kept for callers that announce their sources; rows are computed on demand, per
        source and bounded (see the class), by `path_links`."""

    def trees(self, sources):
        """(distances, predecessors) rows of one shortest-path tree per source."""
        from scipy.sparse.csgraph import dijkstra

        return dijkstra(self._csr, indices=[self.node_index[s] for s in sources],
                        return_predecessors=True)  # fmt: skip

    def reachable(self, src, dst) -> bool:
        return self.path_links(src, dst) is not None

    def _hub_dist(self, s: int):
        """For a source with one out-link: its distances as a function of node indices."""
        from scipy.sparse.csgraph import dijkstra

        x, w = self._hub[s]
        row = self._hub_rows.get(x)
        if row is None:
            row = self._hub_rows[x] = dijkstra(self._csr, indices=x)

        def dist(ix):
            return np.where(ix == s, 0.0, w + row[ix])

        return dist

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
            d_idx, s_idx = self.node_index[dst], self.node_index[src]
            if s_idx in self._hub:
                dist = self._hub_dist(s_idx)
            else:
                dist = self._row(s_idx, d_idx).__getitem__
            if not np.isfinite(dist(d_idx)):
                self._paths[key] = None
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
            self._paths[key] = np.array(links[::-1], dtype=np.int64)
        return self._paths[key]
