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
    (optional) `kind` on every edge. Rows of distances are computed per source, lazily,
    all new sources at once."""

    def __init__(self, graph, mode: str = "latency"):
        from scipy.sparse import csr_matrix

        self.graph = graph
        self.links = list(graph.edges())
        nodes = list(graph.nodes)
        self.nodes = nodes
        self.node_index = {v: i for i, v in enumerate(nodes)}
        u = [self.node_index[a] for a, _ in self.links]
        v = [self.node_index[b] for _, b in self.links]
        self.weight = np.array([link_weight(graph.edges[e], mode) for e in self.links], float)
        self._csr = csr_matrix((self.weight, (u, v)), shape=(len(nodes), len(nodes)))
        self.in_links = [[] for _ in nodes]  # node -> [(link index, from node index)]
        for k, (a, b) in enumerate(zip(u, v, strict=True)):
            self.in_links[b].append((k, a))
        self._dist: dict = {}
        self._paths: dict = {}

    def distances(self, sources) -> None:
        """Compute the distance rows of sources not seen yet (one scipy call)."""
        from scipy.sparse.csgraph import dijkstra

        new = [s for s in dict.fromkeys(sources) if s not in self._dist]
        if new:
            rows = dijkstra(self._csr, indices=[self.node_index[s] for s in new])
            for s, row in zip(new, np.atleast_2d(rows), strict=True):
                self._dist[s] = row

    def trees(self, sources):
        """(distances, predecessors) rows of one shortest-path tree per source."""
        from scipy.sparse.csgraph import dijkstra

        return dijkstra(self._csr, indices=[self.node_index[s] for s in sources],
                        return_predecessors=True)  # fmt: skip

    def reachable(self, src, dst) -> bool:
        self.distances([src])
        return bool(np.isfinite(self._dist[src][self.node_index[dst]]))

    def path_links(self, src, dst) -> np.ndarray | None:
        """Link indices from src to dst (None: no path)."""
        key = (src, dst)
        if key not in self._paths:
            self.distances([src])
            dist = self._dist[src]
            d_idx, s_idx = self.node_index[dst], self.node_index[src]
            if not np.isfinite(dist[d_idx]):
                return None
            links, v = [], d_idx
            while v != s_idx:  # walk back, picking among equal-cost predecessors by hash (ECMP)
                options = [(k, a) for k, a in self.in_links[v]
                           if dist[a] + self.weight[k] == dist[v]]  # fmt: skip
                h = zlib.crc32(f"{src!r}|{dst!r}|{self.nodes[v]!r}".encode())
                k, v = options[h % len(options)]
                links.append(k)
            self._paths[key] = np.array(links[::-1], dtype=np.int64)
        return self._paths[key]
