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

`Routes` is built in layers, a module each, each relying only on the ones below it (none
imports this module):
- networks.routing.graph: the topology as arrays (links, packed weights, in-links, the GPUs
  that sit behind one hub or only behind switches), and `link_weight`; no distances;
- networks.routing.rows: distance rows, computed on demand and shared where they can be (a
  source's bounded search, a hub's or a switch's full row), and shortest-path trees;
- networks.routing.spreads: hops and bottlenecks from a big switch's spread, shared by the
  GPUs under it (`hub_hop_rows`);
- networks.routing.servers: the same between GPUs of one server, from a search of the
  server alone (`server_hop_rows`);
- networks.routing.reads: which rows each (source, destination) pair of a batch reads;
- networks.routing.walks: the walk back from the destinations that picks the links;
- networks.routing.tuning: memory budgets and thresholds, none of which changes a result.
"""

from __future__ import annotations

import numpy as np

from networks.routing.graph import link_weight
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


class Routes(RouteWalks, RouteSpreads):
    """Shortest paths by the rule above over a DiGraph with `bandwidth`, `latency` and
    (optional) `kind` on every edge; `mode` 'latency' or 'hops' (the rule's second key).

    What a caller may rely on (the graph must not change once the routes are built):
    - `links` (the graph's edges in its order: a link is its index there), `nodes`,
      `node_index`, `weight` (each link's packed weight), `link_ids`, `link_values`;
    - `path_links(src, dst)`, `paths_links(pairs)`, `walk_links(src, dst)`: a route's
      link indices, source first, or None (walks);
    - `trees(sources, targets)`: (distances, predecessors) of shortest-path trees
      (rows);
    - `hub_hop_rows(sources, targets)`: (bottleneck, distance, hops) over the targets
      as those trees give them, or None (spreads); `server_hop_rows`, the same from a
      search of one server (servers).
    Distances are computed per source and bounded, or read from rows that switches share;
    memory stays O(nodes near each source), not sources x nodes (rows)."""

    def distances(self, sources) -> None:
        """Kept for callers that announce their sources; rows are computed on demand, per
        source and bounded (see the class), by `path_links`."""

    def reachable(self, src, dst) -> bool:
        return self.path_links(src, dst) is not None
