"""Distance rows, computed on demand and shared where they can be (`RouteRows`), a part of
networks.routing's `Routes`.

Distances are computed per source, bounded: a Dijkstra from the source stops at a limit
that first covers the destination (the direct link's weight where there is one, else a
lower bound, raised 4x until the destination is in), and only the nodes it reached are
kept (`ball`). Every node on a shortest path to the destination is within the limit, and
a node beyond it cannot be an equal-cost predecessor, so the paths are those of the
unbounded rows (the packed weights sum exactly, in any order). Memory is O(nodes near each
source), not sources x nodes (2 GB at 16,384 GPUs). A GPU whose out-links all go to
switches takes the minimum of its switches' rows plus the links' weights instead (the same
integers): in a cluster of servers a search from a GPU to another server covers the whole
machine, and the switches' rows are shared (`full_row`, `switch_reads`, `via_dist`).
"""

from __future__ import annotations

import numpy as np

from networks.routing import tuning
from networks.routing.graph import NET_WEIGHT, RouteGraph


class RouteRows:
    """Distance rows and shortest-path trees over the topology's arrays (see the module).

    Gives (each row exact wherever it is finite or, for a ball, for every node not
    farther than the destination it was grown to cover):
    - `trees(sources, targets)`: (distances, predecessors) of one shortest-path tree per
      source;
    - `ball(s, d)`: (limit, reached nodes in order, their distances), kept per source;
      `row(s, d)` the same as a full row (inf beyond);
    - `full_row(x, hub)`: node x's whole row; hubs' and switches' each kept while their
      rows fit tuning.HUB_ROWS_BYTES (the most shared ones kept); `search_row(x)` the
      same, searched again;
    - `switch_reads(s, targets)`: the switch rows a GPU behind switches reads, and
      `hub_dist`, `via_dist`: a source's distances as a function of node indices.
    Needs: `arrays`, a graph.RouteGraph.
    """

    def __init__(self, arrays: RouteGraph):
        self.arrays = arrays
        self._balls: dict = {}  # source index -> (limit, reached node indices, distances)
        self._hub_rows: dict = {}  # hub index -> its full distance row
        self._switch_rows: dict = {}  # switch index -> its full distance row

    def trees(self, sources, targets=None):
        """(distances, predecessors) rows of one shortest-path tree per source. With
        `targets`, each source's search stops at a limit that covers every target (a
        lower bound raised 4x until all are in): the same distances and predecessors for
        every node within it, since nodes are settled in the same order up to the limit
        and a node's predecessor is settled before it (a tree over a handful of GPUs under
        one switch no longer searches the whole machine: O(groups x nodes) at 16k)."""
        from scipy.sparse.csgraph import dijkstra

        g = self.arrays
        src = [g.node_index[s] for s in sources]
        if targets is None:
            return dijkstra(g.csr, indices=src, return_predecessors=True)
        tgt = np.array([g.node_index[t] for t in targets], dtype=np.int64)
        fars, limits = [tgt[tgt != s] for s in src], []
        for s, far in zip(src, fars, strict=True):
            limit = float(np.max(g.min_out[s] + g.min_in[far])) if len(far) else 0.0
            limits.append(max(limit, 1.0) if np.isfinite(limit) else np.inf)
        top = max(limits)
        if len(src) > 1 and np.isfinite(top):  # one search per source, in one call, to
            # the largest limit: within each source's own limit the same settling order,
            # hence the same rows there (one call per source was ~10% of an 8-GPU group's plan)
            d, p = dijkstra(g.csr, indices=src, limit=top, return_predecessors=True)
            if np.isfinite(d[:, tgt]).all():
                return d, p
        dist = np.empty((len(src), len(g.nodes)))
        pred = np.empty((len(src), len(g.nodes)), dtype=np.int32)
        for k, s in enumerate(src):
            far, limit = fars[k], limits[k]
            for _ in range(12):
                d, p = dijkstra(g.csr, indices=s, limit=limit, return_predecessors=True)
                if np.isfinite(d[far]).all() or limit == np.inf:
                    break
                limit *= 4
            else:  # far away, or some target unreachable: the whole tree
                d, p = dijkstra(g.csr, indices=s, return_predecessors=True)
            dist[k], pred[k] = d, p
        return dist, pred

    def switch_reads(self, s: int, t_idx: np.ndarray, small: bool = False) -> list | None:
        """(switch, link weight, link, switch's row) of each out-link of source s that can
        be on a shortest path to some target, the most shared switch first (its row bounds
        the distances; another is left out where a lower bound, as in reads'
        `bounded_reads`, is longer for every target); None unless s's out-links all go to
        switches and, unless `small`, those that can be on the way have more than
        tuning.SPREAD_DEGREE ports."""
        g = self.arrays
        degree = -1 if small else tuning.SPREAD_DEGREE
        h = g.hub.get(s)
        if h:
            x, w = h
            big_x = g.out_deg[x] > degree
            return [(x, w, g.hub_link[s], self.full_row(x, hub=True))] if big_x else None
        if not g.via_switches[s]:
            return None
        csr = g.csr
        heads = sorted(
            csr.indices[csr.indptr[s] : csr.indptr[s + 1]].tolist(), key=lambda x: -g.served[x]
        )
        links = g.link_ids(np.full(len(heads), s), np.array(heads, np.int64))
        reads, upper = [], None
        for x, k in zip(heads, links.tolist(), strict=True):
            w = float(g.weight[k])
            if upper is not None:
                lower = w + g.net_bound(np.full(len(t_idx), g.local[x]), g.local[t_idx])
                if (lower > upper).all():
                    continue
            if not g.out_deg[x] > degree:  # a small switch may be on the way: the trees
                # cost less (a per-node test: an array over every node per call was 14 s
                # of 131,072 groups' analyses)
                return None
            row = self.full_row(x, hub=False)
            reads.append((x, w, k, row))
            upper = w + row[t_idx] if upper is None else np.minimum(upper, w + row[t_idx])
        return reads

    def hub_dist(self, s: int):
        """For a source with one out-link: its distances as a function of node indices."""
        x, w = self.arrays.hub[s]
        row = self.full_row(x, hub=True)

        def dist(ix):
            return np.where(ix == s, 0.0, w + row[ix])

        return dist

    def via_dist(self, s: int, d: int):
        """For a GPU whose out-links all go to switches: its distances as a function of node
        indices, the least over the out-links that can be on the way to d (`switch_reads`) of
        weight + the switch's shared row (0 at s), as reads' `per_source` reads
        them. A bounded search of its own to another server covers the machine, and one
        kept per GPU took 4.8 GB at 16,384 GPUs."""
        outs = [(w, row) for _, w, _, row in self.switch_reads(s, np.array([d]), small=True)]

        def dist(ix):
            d = outs[0][0] + outs[0][1][ix]
            for w, row in outs[1:]:
                d = np.minimum(d, w + row[ix])
            return np.where(ix == s, 0.0, d)

        return dist

    def full_row(self, x: int, hub: bool) -> np.ndarray:
        """Node x's whole distance row: kept (hubs' and other switches' apart) while the
        rows fit tuning.HUB_ROWS_BYTES, the most shared first; else searched again."""
        row = self._hub_rows.get(x)
        if row is None:
            row = self._switch_rows.get(x)
        if row is None:
            row = self.search_row(x)
            if hub:
                self._keep_row(self._hub_rows, x, row, self.arrays.hub_served)
            else:
                self._keep_row(self._switch_rows, x, row, self.arrays.served)
        return row

    def search_row(self, x: int) -> np.ndarray:
        """Node x's distances to every node: a search of the core (graph.`_pendants`), the
        pendants their neighbour's distance plus their in-link's weight; or of the whole
        graph where there is no pendant or x is one."""
        from scipy.sparse.csgraph import dijkstra

        g = self.arrays
        c = g.core[x]
        if g.core_csr is None or c < 0:
            return dijkstra(g.csr, indices=x)
        core = dijkstra(g.core_csr, indices=int(c))
        row = np.empty(len(g.nodes))
        row[g.core >= 0] = core
        row[g.pend] = core[g.core[g.pend_from]] + g.pend_w
        return row

    def _keep_row(self, rows: dict, x: int, row: np.ndarray, served: np.ndarray) -> None:
        """Keep switch x's row in `rows` while they fit tuning.HUB_ROWS_BYTES; when they do
        not, in place of the least shared one if x serves more nodes (NCCL asks in cycles
        over all servers, where least-recently-used would never hit; with ties the rows
        first kept stay, and only the rest are searched again)."""
        if (len(rows) + 1) * len(self.arrays.nodes) * 8 <= tuning.HUB_ROWS_BYTES:
            rows[x] = row
            return
        if rows:
            low = min(rows, key=served.__getitem__)
            if served[low] < served[x]:
                del rows[low]
                rows[x] = row

    def row(self, s: int, d: int) -> np.ndarray:
        """Distances from node s, exact for every node not farther than d (inf beyond)."""
        _, idx, dist = self.ball(s, d)
        row = np.full(len(self.arrays.nodes), np.inf)
        row[idx] = dist
        return row

    def ball(self, s: int, d: int) -> tuple:
        """(limit, reached nodes in order, their distances) of a search from node s bounded
        to cover d: exact for every node not farther than d. Kept per source, grown 4x."""
        from scipy.sparse.csgraph import dijkstra

        g = self.arrays
        ball = self._balls.get(s)
        if ball is not None:
            limit, idx, dist = ball
            k = int(np.searchsorted(idx, d))
            if (k < len(idx) and idx[k] == d) or limit == np.inf:
                return ball
            limit *= 4
        else:
            limit = g.direct.get((s, d), g.min_out[s] + g.min_in[d])
            if g.local[s] != g.local[d] and (s, d) not in g.direct:
                limit = max(limit, NET_WEIGHT)
            limit = max(limit, 1.0) if np.isfinite(limit) else np.inf
        for _ in range(12):
            row = dijkstra(g.csr, indices=s, limit=limit)
            if np.isfinite(row[d]) or limit == np.inf:
                break
            limit *= 4
        else:  # far away, or unreachable: the whole row
            row, limit = dijkstra(g.csr, indices=s), np.inf
        idx = np.flatnonzero(np.isfinite(row))
        ball = self._balls[s] = (limit, idx, row[idx])
        return ball
