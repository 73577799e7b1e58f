"""Routes through a topology: which links a transfer from one node to another crosses.

The rule, in order of precedence:
1. fewest inter-node links (edges with kind='net'): traffic inside a node never leaves it
   through the inter-node fabric when an NVLink/NVSwitch/PCIe path exists, whatever the
   latencies; between nodes, the path with fewest network hops (a GPU may forward over
   NVLink to the GPU on the right rail first, as NCCL's PXN does);
2. least summed latency (mode 'latency'; skipped in mode 'hops');
3. fewest hops.
Among equal-cost paths, network links as late as they can be (NVLink first: a relay to
another rail is at the sender, as in PXN, never a NIC writing into a GPU at the receiver);
the rest are spread by a hash of (source, destination) (ECMP).
A link's bandwidth never decides a route, as it does not in a switch's forwarding table:
a route that moved away from a link made slightly slower could land on a less loaded one
and finish sooner, so a slower link could make a run faster (issue 29).

The keys are packed into one integer-valued float per link so scipy's C Dijkstra sums
them exactly (every term stays far below 2**53), and equal-cost paths stay tied
(`link_weight`).

`Routes` is put together from objects, a module each, each owning one concern and its
state, each class's docstring its contract:
- networks.routing.graph: `RouteGraph`, the topology as arrays (links, packed weights,
  in-links, the GPUs that sit behind one hub or only behind switches), and `link_weight`;
  no distances;
- networks.routing.rows: `RouteRows`, distance rows, computed on demand and shared where
  they can be (a source's bounded search, a hub's or a switch's full row), and
  shortest-path trees;
- networks.routing.spreads: `RouteSpreads`, hops and bottlenecks from a big switch's
  spread, shared by the GPUs under it (`hub_hop_rows`);
- networks.routing.servers: `RouteServers`, the same between GPUs of one server, and the
  routes inside one server, from a search of the server alone (`server_hop_rows`);
- networks.routing.reads: `RouteReads`, which rows each (source, destination) pair of a
  batch reads;
- networks.routing.walks: `RouteWalks`, the walk back from the destinations that picks
  the links, and the routes found so far;
- networks.routing.tuning: memory budgets and thresholds, none of which changes a result.
"""

from __future__ import annotations

import numpy as np

from networks.routing.graph import RouteGraph, link_weight
from networks.routing.reads import RouteReads
from networks.routing.rows import RouteRows
from networks.routing.servers import RouteServers
from networks.routing.spreads import RouteSpreads
from networks.routing.walks import RouteWalks

__all__ = ["LINK_KINDS", "Routes", "link_weight", "path_latencies"]

LINK_KINDS = ("nvlink", "pcie", "net")


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
    (optional) `kind` on every edge; `mode` 'latency' or 'hops' (the rule's second key).

    What a caller may rely on (the graph must not change once the routes are built):
    - `graph`, `links` (the graph's edges in its order: a link is its index there),
      `link_data`, `nodes`, `node_index`, `weight` (each link's packed weight),
      `link_ids`, `link_values`;
    - `path_links(src, dst)`, `paths_links(pairs)`, `walk_links(src, dst)`: a route's
      link indices, source first, or None (walks); `server_walks(pairs)`: those inside
      one server (servers);
    - `trees(sources, targets)`: (distances, predecessors) of shortest-path trees
      (rows);
    - `hub_hop_rows(sources, targets)`: (bottleneck, distance, hops) over the targets
      as those trees give them, or None (spreads); `server_hop_rows`, the same from a
      search of one server (servers).
    Distances are computed per source and bounded, or read from rows that switches share;
    memory stays O(nodes near each source), not sources x nodes (rows). The parts are
    `arrays`, `rows`, `servers`, `spreads` and `walks` (each calls the ones it needs)."""

    def __init__(self, graph, mode: str = "latency"):
        self.mode = mode
        self.arrays = arrays = RouteGraph(graph, mode)
        self.rows = RouteRows(arrays)
        self.servers = RouteServers(arrays)
        self.spreads = RouteSpreads(arrays, self.rows)
        self.walks = RouteWalks(
            arrays, self.rows, self.servers, RouteReads(arrays, self.rows, self.servers)
        )
        self.graph, self.links, self.link_data = arrays.graph, arrays.links, arrays.link_data
        self.nodes, self.node_index, self.weight = arrays.nodes, arrays.node_index, arrays.weight

    def link_ids(self, tails: np.ndarray, heads: np.ndarray) -> np.ndarray:
        """The index in `links` of each (tail, head) pair of node indices (all links)."""
        return self.arrays.link_ids(tails, heads)

    def link_values(self, attr: str) -> np.ndarray:
        """Each link's `attr` (an edge attribute every link has), in `links` order."""
        return self.arrays.link_values(attr)

    def path_links(self, src, dst) -> np.ndarray | None:
        """Link indices from src to dst (None: no path); a caller must not write into them."""
        return self.walks.path_links(src, dst)

    def paths_links(self, pairs) -> list:
        """`path_links` of every (src, dst) pair, walked together."""
        return self.walks.paths_links(pairs)

    def walk_links(self, src, dst) -> np.ndarray | None:
        """The per-pair walk `paths_links` is checked against; not cached."""
        return self.walks.walk_links(src, dst)

    def trees(self, sources, targets=None):
        """(distances, predecessors) rows of one shortest-path tree per source."""
        return self.rows.trees(sources, targets)

    def hub_hop_rows(self, sources, targets) -> list | None:
        """(bottleneck, distance, hops) over the targets per source, from big switches'
        spreads, or None (RouteSpreads.hub_hop_rows)."""
        return self.spreads.hub_hop_rows(sources, targets)

    def server_hop_rows(self, sources, targets) -> list | None:
        """The same from a search of one server, or None (RouteServers.server_hop_rows)."""
        return self.servers.server_hop_rows(sources, targets)

    def server_walks(self, pairs) -> dict:
        """{(src, dst): links} of the pairs inside one server (RouteServers.server_walks)."""
        return self.servers.server_walks(pairs)

    def distances(self, sources) -> None:
        """Kept for callers that announce their sources; rows are computed on demand, per
        source and bounded (see the class), by `path_links`."""

    def reachable(self, src, dst) -> bool:
        return self.path_links(src, dst) is not None
