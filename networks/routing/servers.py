"""Hops and bottlenecks between GPUs of one server: a layer of networks.routing's `Routes`
beside the spreads.

A server here is a component of the graph without its network links (`_local`: a node's
GPUs and NVSwitch). A path that leaves it crosses a network link, which alone weighs
NET_WEIGHT, more than any path inside it (latencies below ~1 ms, tuning.SERVER_NODES nodes
at most), so between two nodes of one server the shortest paths are inside it: a search of
the server's few nodes gives the distances a search of the machine gives. A tree takes one
of the equal-cost paths; where their bottlenecks differ its answer would depend on the
tie-break, so none is given then (as the spreads do).

What a caller may rely on: `server_hop_rows(sources, targets)` gives, per source,
(bottleneck bandwidth, packed distance, hops) over the targets exactly as a shortest-path
tree from the source (`trees`) gives them, or None where it does not apply (nodes in
several servers, a server of more than tuning.SERVER_NODES nodes, a target it cannot reach
inside, or equal-cost paths with different bottlenecks). Why: a tensor-parallel group's
ring search asked a tree of the whole machine per member (32,768 groups at 131,072 GPUs:
O(groups x machine)). What it needs: rows.RouteRows (the graph's arrays and `_local`).
"""

from __future__ import annotations

import zlib

import numpy as np

from networks.routing import tuning
from networks.routing.graph import NET_WEIGHT, NS_WEIGHT
from networks.routing.rows import RouteRows


class RouteServers(RouteRows):
    """`server_hop_rows` from a search of one server (see the module)."""

    def __init__(self, graph, mode: str = "latency"):
        super().__init__(graph, mode)
        self._servers: dict = {}  # component -> its sub-graph (`_server`), or None: too big
        self._comp_nodes = self._comp_ptr = None  # every component's nodes (`_server`)
        self._server_rows: dict = {}  # node -> its server's nodes and its distances there
        self._out_link = self._out_ptr = None  # out-links by tail, built when first needed

    def server_hop_rows(self, sources, targets) -> list | None:
        """`(bottleneck bandwidth, packed distance, hops)` arrays over `targets` for each
        source, as a shortest-path tree from the source gives them, or None (the module
        says when)."""
        from scipy.sparse.csgraph import dijkstra

        idx = self.node_index
        s = np.array([idx[v] for v in sources], np.int64)
        t = np.array([idx[v] for v in targets], np.int64)
        if not len(s) or not len(t):
            return None
        comp = self._local[s[0]]
        if (self._local[s] != comp).any() or (self._local[t] != comp).any():
            return None
        sub = self._server(int(comp))
        if sub is None:
            return None
        members, csr, tail, head, w, bw, _ = sub
        ps, pt = np.searchsorted(members, s), np.searchsorted(members, t)
        d = dijkstra(csr, indices=ps)  # (sources, server nodes)
        dt = d[:, pt]
        if not (np.isfinite(dt).all() and (dt < NET_WEIGHT).all()):
            return None
        # the least and the most bottleneck over every shortest path, one round per hop
        # down the DAG of tight links (each at least 1 heavier than its tail: no cycle)
        tight = d[:, tail] + w == d[:, head]
        rows = np.arange(len(s))[:, None]
        src_at = (rows[:, 0], ps)
        lo = np.full(d.shape, np.inf)
        hi = np.full(d.shape, -np.inf)
        lo[src_at] = hi[src_at] = np.inf
        for _ in range(d.shape[1]):
            new_lo = np.full(d.shape, np.inf)
            new_hi = np.full(d.shape, -np.inf)
            r, k = np.nonzero(tight)
            np.minimum.at(new_lo, (r, head[k]), np.minimum(lo[r, tail[k]], bw[k]))
            np.maximum.at(new_hi, (r, head[k]), np.minimum(hi[r, tail[k]], bw[k]))
            new_lo[src_at] = new_hi[src_at] = np.inf
            if np.array_equal(new_lo, lo) and np.array_equal(new_hi, hi):
                break
            lo, hi = new_lo, new_hi
        b_lo, b_hi = lo[:, pt], hi[:, pt]
        if not np.array_equal(b_lo, b_hi):
            return None  # the tree's tie-break would decide
        hops = np.mod(dt, NS_WEIGHT)  # each link adds 1 below its latency's ns
        return [(b_lo[i], dt[i], hops[i]) for i in range(len(s))]

    def server_walks(self, pairs) -> dict:
        """{(src, dst): links} for the pairs of `pairs` whose ends are in one server (of at
        most tuning.SERVER_NODES nodes) and joined inside it: each route walked back as
        `walk_links` walks it, with distances from a search of the server (a tail outside
        it is never on a shortest path: reaching it costs a network link). The others are
        left out. Why: a rail cluster's intra-server ring hops read switch rows of the
        whole machine (2,056 rows of 18,448 nodes at 16,384 GPUs: 11 s)."""
        from scipy.sparse.csgraph import dijkstra

        idx, local = self.node_index, self._local
        by_comp: dict = {}
        for key in pairs:
            s, d = idx[key[0]], idx[key[1]]
            if s != d and local[s] == local[d]:
                by_comp.setdefault(int(local[s]), []).append((key, s, d))
        out: dict = {}
        in_ptr, in_link, in_from, weight = self._in_ptr, self._in_link, self._in_from, self.weight
        nodes = self.nodes
        for comp, items in by_comp.items():
            sub = self._server(comp)
            if sub is None:
                continue
            members, csr = sub[0], sub[1]
            srcs = sorted({s for _, s, _ in items})
            rows = dict(
                zip(srcs, dijkstra(csr, indices=np.searchsorted(members, srcs)), strict=True)
            )
            for (src, dst), s, d in items:
                row = rows[s]

                def dist(v, row=row, members=members):
                    return _in_server(members, row, v)

                if not dist(d) < NET_WEIGHT:
                    continue  # not joined inside the server: the machine's walk
                links, v = [], d
                while v != s:
                    lo, hi = in_ptr[v], in_ptr[v + 1]
                    ks, tails = in_link[lo:hi], in_from[lo:hi]
                    ok = np.flatnonzero(dist(tails) + weight[ks] == dist(v))
                    j = ok[0]
                    if len(ok) > 1:  # ECMP, as walk_links picks
                        j = ok[zlib.crc32(f"{src!r}|{dst!r}|{nodes[v]!r}".encode()) % len(ok)]
                    links.append(int(ks[j]))
                    v = int(tails[j])
                out[src, dst] = np.array(links[::-1], dtype=np.int64)
        return out

    def server_row(self, s: int) -> tuple:
        """(the server's nodes, sorted; node s's distances to each inside the server), for
        node s of a small server (`_server` not None); kept per source."""
        got = self._server_rows.get(s)
        if got is None:
            from scipy.sparse.csgraph import dijkstra

            members, csr = self._server(int(self._local[s]))[:2]
            row = dijkstra(csr, indices=int(np.searchsorted(members, s)))
            got = self._server_rows[s] = (members, row)
        return got

    def server_reads(self, s: int) -> list | None:
        """For node s of a small server: (head, offset) of each network link out of the
        server that s reaches inside it, the offset its distance to the link's tail plus
        the link's weight (the least per head); None for a server over
        tuning.SERVER_NODES nodes. Any path from s out of the server leaves by one of these
        links, so s's distance to a node outside is the least over them of offset + the
        head's distance there, exactly (integer-valued weights)."""
        sub = self._server(int(self._local[s]))
        if sub is None:
            return None
        members, row = self.server_row(s)
        ex_tail, ex_head, ex_w = sub[6]
        off = row[ex_tail] + ex_w
        best: dict = {}
        for y, o in zip(ex_head.tolist(), off.tolist(), strict=True):
            if o < best.get(y, np.inf):
                best[y] = o
        return list(best.items())

    def _server(self, comp: int):
        """(its nodes' indices, sorted; CSR of its links; their tails, heads (positions in
        the nodes), weights and bandwidths) of component `comp`, built once; None over
        tuning.SERVER_NODES nodes."""
        if comp in self._servers:
            return self._servers[comp]
        from scipy.sparse import csr_matrix

        if self._comp_ptr is None:  # the nodes of every component, once
            self._comp_nodes = np.argsort(self._local, kind="stable")
            self._comp_ptr = np.searchsorted(
                self._local[self._comp_nodes], np.arange(int(self._local.max()) + 2)
            )
        members = self._comp_nodes[self._comp_ptr[comp] : self._comp_ptr[comp + 1]]
        if len(members) > tuning.SERVER_NODES:
            self._servers[comp] = None
            return None
        links = np.concatenate(
            [self._in_link[self._in_ptr[v] : self._in_ptr[v + 1]] for v in members.tolist()]
        )
        links = np.sort(links[(self._local[self._u[links]] == comp) & ~self._net_link[links]])
        tail = np.searchsorted(members, self._u[links])
        head = np.searchsorted(members, self._v[links])
        w = self.weight[links]
        m = len(members)
        csr = csr_matrix((w, (tail, head)), shape=(m, m))
        bw = self.link_values("bandwidth")[links]
        # its network links out (tail inside), for `server_reads`
        if self._out_ptr is None:  # out-links as CSR (node -> link indices), once
            self._out_link = np.argsort(self._u, kind="stable")
            self._out_ptr = np.searchsorted(self._u[self._out_link], np.arange(len(self.nodes) + 1))
        outs = np.concatenate(
            [self._out_link[self._out_ptr[v] : self._out_ptr[v + 1]] for v in members.tolist()]
        )
        outs = outs[self._net_link[outs]]
        exits = (np.searchsorted(members, self._u[outs]), self._v[outs], self.weight[outs])
        out = self._servers[comp] = (members, csr, tail, head, w, bw, exits)
        return out


def _in_server(members: np.ndarray, row: np.ndarray, v):
    """Node (indices) v's distance in a server's row (members sorted), inf outside it."""
    at = np.minimum(np.searchsorted(members, v), len(members) - 1)
    return np.where(members[at] == v, row[at], np.inf)
