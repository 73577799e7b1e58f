"""Hop counts and bottlenecks shared by the GPUs under a big switch (`RouteSpreads`), a part
of networks.routing's `Routes` beside the servers.

A search from each GPU under a switch of thousands of ports relaxes all of them (O(N) per
GPU on a star). A switch's spread, by levels of its shortest-path DAG, gives the hops and
the least and most bottleneck over all its shortest paths to every node, once for all
the GPUs under it (`_spread`).
"""

from __future__ import annotations

import numpy as np

from networks.routing import tuning
from networks.routing.graph import RouteGraph
from networks.routing.rows import RouteRows


class RouteSpreads:
    """`hub_hop_rows` from switches' spreads (see the module).

    Gives: `hub_hop_rows(sources, targets)`: per source, (bottleneck bandwidth, packed
    distance, hops) over the targets exactly as a shortest-path tree from the source
    (rows.RouteRows.trees) gives them, or None where it does not apply (then the caller
    builds the trees). Needs: `arrays` (a graph.RouteGraph) and `rows` (a rows.RouteRows:
    its `switch_reads` and `full_row`).
    """

    def __init__(self, arrays: RouteGraph, rows: RouteRows):
        self.arrays, self.rows = arrays, rows
        self._spreads: dict = {}  # switch index -> (hops, least and most bottleneck) rows

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
        tuning.SPREAD_DEGREE ports (a search from each GPU under one relaxes all of them),
        or for tuning.SPREAD_SOURCES sources or more, whatever their switches' size (the
        sources under one share its spread: a 16-GPU FSDP group of one rail took 16 trees)."""
        g = self.arrays
        idx = g.node_index
        t_idx = np.array([idx[t] for t in targets], dtype=np.int64)
        bandwidth = g.link_values("bandwidth")
        out = []
        small = len(sources) >= tuning.SPREAD_SOURCES
        for s in (idx[v] for v in sources):
            reads = self.rows.switch_reads(s, t_idx, small)
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

    def _spread(self, x: int):
        """Switch x's (hops, least bottleneck, most bottleneck) over all its shortest paths to
        each node, by levels of the shortest-path DAG (links with d[u] + w == d[v]); None
        when deeper than tuning.SPREAD_LEVELS. Kept while they fit tuning.HUB_ROWS_BYTES."""
        g = self.arrays
        if x in self._spreads:
            return self._spreads[x]
        d = self.rows.full_row(x, hub=bool(g.hub_served[x]))
        u, v, bw = g.u, g.v, g.link_values("bandwidth")
        tight = np.flatnonzero(np.isfinite(d[u]) & (d[u] + g.weight == d[v]))
        level = np.full(len(g.nodes), -1, np.int64)
        least = np.zeros(len(g.nodes))
        most = np.zeros(len(g.nodes))
        level[x], least[x], most[x] = 0, np.inf, np.inf
        frontier = np.zeros(len(g.nodes), bool)
        frontier[x] = True
        result = None  # deeper than tuning.SPREAD_LEVELS unless the walk runs out first
        for depth in range(1, tuning.SPREAD_LEVELS + 2):
            e = tight[frontier[u[tight]]]
            if not len(e):
                result = (level, least, most)
                break
            if depth > tuning.SPREAD_LEVELS:
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
        if (len(self._spreads) + 1) * len(g.nodes) * 24 <= tuning.HUB_ROWS_BYTES:
            self._spreads[x] = result
        return result
