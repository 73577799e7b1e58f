"""Hops, bottlenecks and routes between GPUs of one server (`RouteServers`), a part of
networks.routing's `Routes` beside the spreads.

A server here is a component of the graph without its network links (`local`: a node's
GPUs and NVSwitch). A path that leaves it crosses a network link, which alone weighs
NET_WEIGHT, more than any path inside it (latencies below ~1 ms, tuning.SERVER_NODES nodes
at most), so between two nodes of one server the shortest paths are inside it: a search of
the server's few nodes gives the distances a search of the machine gives. A tree takes one
of the equal-cost paths; where their bottlenecks differ its answer would depend on the
tie-break, so none is given then (as the spreads do). Why: a tensor-parallel group's ring
search asked a tree of the whole machine per member (32,768 groups at 131,072 GPUs:
O(groups x machine)).
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import numpy as np

from networks.routing import tuning
from networks.routing.graph import NET_WEIGHT, NS_WEIGHT, RouteGraph


class _Server(NamedTuple):
    """One server's sub-graph (`RouteServers._server`)."""

    members: np.ndarray  # its nodes' indices, sorted
    csr: object  # its links inside (no network links) as a sparse matrix over positions
    tail: np.ndarray  # each of those links' tail and head (positions in `members`),
    head: np.ndarray
    w: np.ndarray  # packed weight,
    bw: np.ndarray  # bandwidth
    links: np.ndarray  # and index in the graph's links (in link order)
    exits: tuple  # its network links out: (tail position, head node, weight) arrays
    shape: tuple  # what alike servers share: node count, tails, heads, weights


class RouteServers:
    """Searches and walks of one server at a time (see the module).

    Gives: `server_hop_rows(sources, targets)`: per source, (bottleneck bandwidth, packed
    distance, hops) over the targets exactly as a shortest-path tree from the source
    (rows.RouteRows.trees) gives them, or None where it does not apply (nodes in several
    servers, a server of more than tuning.SERVER_NODES nodes, a target it cannot reach
    inside, or equal-cost paths with different bottlenecks); `server_walks(pairs)`: the
    routes of the pairs inside one server, as walks.RouteWalks would walk them;
    `server_row(s)` and `server_reads(s)`: a node's distances inside its server, and the
    network links out of it with their offsets (for reads.RouteReads).
    Needs: `arrays`, a graph.RouteGraph.
    """

    def __init__(self, arrays: RouteGraph):
        self.arrays = arrays
        self._servers: dict = {}  # component -> its sub-graph (`_server`), or None: too big
        self._comp_nodes = self._comp_ptr = None  # every component's nodes (`_server`)
        self._server_rows: dict = {}  # node -> its server's nodes and its distances there
        self._shape_walks: dict = {}  # server shape -> {(from, to) positions: link positions}
        self._shape_rows: dict = {}  # (shape, bandwidths, positions) -> server_hop_rows
        self._exits_of: dict = {}  # node -> its `server_reads`

    def server_hop_rows(self, sources, targets) -> list | None:
        """`(bottleneck bandwidth, packed distance, hops)` arrays over `targets` for each
        source, as a shortest-path tree from the source gives them, or None (the module
        says when; the arrays are shared: a caller must not write into them)."""
        g = self.arrays
        idx = g.node_index
        s = np.array([idx[v] for v in sources], np.int64)
        t = np.array([idx[v] for v in targets], np.int64)
        if not len(s) or not len(t):
            return None
        comp = g.local[s[0]]
        if (g.local[s] != comp).any() or (g.local[t] != comp).any():
            return None
        sub = self._server(int(comp))
        if sub is None:
            return None
        ps, pt = np.searchsorted(sub.members, s), np.searchsorted(sub.members, t)
        # the answer is a function of the server's shape and the positions only (no
        # names: no tie-break): alike servers' groups (a cluster's TP groups) share it
        key = (sub.shape, sub.bw.tobytes(), ps.tobytes(), pt.tobytes())
        if key not in self._shape_rows:
            self._shape_rows[key] = _server_rows_of(sub, ps, pt)
        return self._shape_rows[key]

    def server_walks(self, pairs) -> dict:
        """{(src, dst): links} for the pairs of `pairs` whose ends are in one server (of at
        most tuning.SERVER_NODES nodes) and joined inside it: each route walked back as
        `walk_links` walks it, with distances from a search of the server (a tail outside
        it is never on a shortest path: reaching it costs a network link). The others are
        left out. Why: a rail cluster's intra-server ring hops read switch rows of the
        whole machine (2,056 rows of 18,448 nodes at 16,384 GPUs: 11 s)."""
        g = self.arrays

        idx, local = g.node_index, g.local
        small = np.diff(self._components()[1]) <= tuning.SERVER_NODES  # small enough to search
        s_idx = np.array([idx[a] for a, _ in pairs], np.int64)
        d_idx = np.array([idx[b] for _, b in pairs], np.int64)
        comp = local[s_idx]
        inside = np.flatnonzero((comp == local[d_idx]) & (s_idx != d_idx) & small[comp])
        by_comp: dict = {}
        for i, c, s, d in zip(
            inside.tolist(),
            comp[inside].tolist(),
            s_idx[inside].tolist(),
            d_idx[inside].tolist(),
            strict=True,
        ):
            by_comp.setdefault(c, []).append((pairs[i], s, d))
        out: dict = {}
        for comp, items in by_comp.items():
            self._walk_server(comp, items, out)
        return out

    def _walk_server(self, comp: int, items: list, out: dict) -> None:
        """`server_walks` of one server's pairs [((src, dst), s, d)], one numpy step per
        hop for all of them: at each node the in-links inside the server (in link order:
        a tail outside is never on a shortest path) whose tail's distance plus the link's
        weight is the node's are the candidates, and the walk takes the first, or where
        there are several the one crc32(f"{src!r}|{dst!r}|{node!r}") picks (ECMP)."""
        from scipy.sparse.csgraph import dijkstra

        sub = self._server(comp)
        if sub is None:
            return
        members, tail, head, w, links = sub.members, sub.tail, sub.head, sub.w, sub.links
        ps = np.searchsorted(members, np.array([s for _, s, _ in items], np.int64))
        pd = np.searchsorted(members, np.array([d for _, _, d in items], np.int64))
        # servers of one shape (the same links between the same positions, in link
        # order, with the same weights: a cluster's servers) walk a pair of positions
        # alike where no tie is met (a tie's pick hashes the nodes' names): walked once
        known = self._shape_walks.setdefault(sub.shape, {})
        left = []
        for i, (key, _, _) in enumerate(items):
            pos = known.get((int(ps[i]), int(pd[i])), False)
            if pos is False:
                left.append(i)
            elif pos is not None:
                out[key] = links[pos]
        if len(left) < len(items):
            items = [items[i] for i in left]
            ps, pd = ps[left], pd[left]
        if not items:
            return
        us, inv = np.unique(ps, return_inverse=True)
        dist = dijkstra(sub.csr, indices=us)[inv.reshape(-1)]  # (pairs, server nodes)
        m = len(members)
        order = np.argsort(head, kind="stable")  # in-links per head, in link order
        ptr = np.searchsorted(head[order], np.arange(m + 1))
        pad = np.full((m, max(1, int(np.diff(ptr).max(initial=0)))), -1, np.int64)
        pad[head[order], np.arange(len(order)) - ptr[head[order]]] = order
        joined = dist[np.arange(len(items)), pd] < NET_WEIGHT
        for i in np.flatnonzero(~joined).tolist():
            known[int(ps[i]), int(pd[i])] = None  # not joined inside: the machine's walk
        act = np.flatnonzero(joined)
        v = pd[act]
        tied = np.zeros(len(items), bool)
        steps = []
        nodes = self.arrays.nodes
        while len(act):
            if len(steps) > m:  # a shortest path has fewer hops than the server has nodes
                raise AssertionError("server walk went round a cycle")
            cand = pad[v]
            c = np.maximum(cand, 0)
            tight = (cand >= 0) & (dist[act[:, None], tail[c]] + w[c] == dist[act, v][:, None])
            pick = np.argmax(tight, axis=1)
            for i in np.flatnonzero(tight.sum(axis=1) > 1).tolist():
                (src, dst), _, _ = items[act[i]]
                ok = np.flatnonzero(tight[i])
                h = zlib.crc32(f"{src!r}|{dst!r}|{nodes[members[v[i]]]!r}".encode())
                pick[i] = ok[h % len(ok)]
                tied[act[i]] = True
            k = c[np.arange(len(act)), pick]
            steps.append((act, k))
            v = tail[k]
            keep = v != ps[act]
            act, v = act[keep], v[keep]
        got: dict = {}
        for a, lk in steps:
            for i, k in zip(a.tolist(), lk.tolist(), strict=True):
                got.setdefault(i, []).append(k)
        for i, path in got.items():
            pos = np.array(path[::-1], dtype=np.int64)
            out[items[i][0]] = links[pos]
            if not tied[i]:
                known[int(ps[i]), int(pd[i])] = pos

    def server_row(self, s: int) -> tuple:
        """(the server's nodes, sorted; node s's distances to each inside the server), for
        node s of a small server (`_server` not None); kept per source."""
        got = self._server_rows.get(s)
        if got is None:
            from scipy.sparse.csgraph import dijkstra

            sub = self._server(int(self.arrays.local[s]))
            members = sub.members
            row = dijkstra(sub.csr, indices=int(np.searchsorted(members, s)))
            got = self._server_rows[s] = (members, row)
        return got

    def server_reads(self, s: int) -> list | None:
        """For node s of a small server: (head, offset) of each network link out of the
        server that s reaches inside it, the offset its distance to the link's tail plus
        the link's weight (the least per head); None for a server over
        tuning.SERVER_NODES nodes. Any path from s out of the server leaves by one of these
        links, so s's distance to a node outside is the least over them of offset + the
        head's distance there, exactly (integer-valued weights)."""
        if s in self._exits_of:
            return self._exits_of[s]
        sub = self._server(int(self.arrays.local[s]))
        if sub is None:
            self._exits_of[s] = None
            return None
        members, row = self.server_row(s)
        ex_tail, ex_head, ex_w = sub.exits
        off = row[ex_tail] + ex_w
        best: dict = {}
        for y, o in zip(ex_head.tolist(), off.tolist(), strict=True):
            if o < best.get(y, np.inf):
                best[y] = o
        got = self._exits_of[s] = list(best.items())
        return got

    def _components(self) -> tuple:
        """Every node index grouped by component (sorted within each) and the offsets
        where each component's nodes start in it: built once."""
        g = self.arrays
        if self._comp_ptr is None:
            self._comp_nodes = np.argsort(g.local, kind="stable")
            self._comp_ptr = np.searchsorted(
                g.local[self._comp_nodes], np.arange(int(g.local.max()) + 2)
            )
        return self._comp_nodes, self._comp_ptr

    def _server(self, comp: int) -> _Server | None:
        """Component `comp` as a `_Server`, built once; None over tuning.SERVER_NODES
        nodes."""
        g = self.arrays
        if comp in self._servers:
            return self._servers[comp]
        from scipy.sparse import csr_matrix

        nodes, ptr = self._components()
        members = nodes[ptr[comp] : ptr[comp + 1]]
        if len(members) > tuning.SERVER_NODES:
            self._servers[comp] = None
            return None
        links = np.concatenate([g.in_link[g.in_ptr[v] : g.in_ptr[v + 1]] for v in members.tolist()])
        links = np.sort(links[(g.local[g.u[links]] == comp) & ~g.net_link[links]])
        tail = np.searchsorted(members, g.u[links])
        head = np.searchsorted(members, g.v[links])
        w = g.weight[links]
        m = len(members)
        # its network links out (tail inside), for `server_reads`: the heads of each
        # member's out-links from the graph's CSR, their links by `link_ids`
        indptr, indices = g.csr.indptr, g.csr.indices
        tails = np.repeat(members, indptr[members + 1] - indptr[members])
        heads = np.concatenate([indices[indptr[v] : indptr[v + 1]] for v in members.tolist()])
        outs = g.link_ids(tails, heads)
        outs = np.sort(outs[g.net_link[outs]])
        exits = (np.searchsorted(members, g.u[outs]), g.v[outs], g.weight[outs])
        out = self._servers[comp] = _Server(
            members=members,
            csr=csr_matrix((w, (tail, head)), shape=(m, m)),
            tail=tail,
            head=head,
            w=w,
            bw=g.link_values("bandwidth")[links],
            links=links,
            exits=exits,
            shape=(m, tail.tobytes(), head.tobytes(), w.tobytes()),
        )
        return out


def _server_rows_of(sub: _Server, ps: np.ndarray, pt: np.ndarray) -> list | None:
    """`server_hop_rows` on one server, positions ps to positions pt."""
    from scipy.sparse.csgraph import dijkstra

    tail, head, w, bw = sub.tail, sub.head, sub.w, sub.bw
    d = dijkstra(sub.csr, indices=ps)  # (sources, server nodes)
    dt = d[:, pt]
    if not (np.isfinite(dt).all() and (dt < NET_WEIGHT).all()):
        return None
    # the least and the most bottleneck over every shortest path, one round per hop
    # down the DAG of tight links (each at least 1 heavier than its tail: no cycle)
    tight = d[:, tail] + w == d[:, head]
    rows = np.arange(len(ps))[:, None]
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
    for a in (b_lo, dt, hops):
        a.flags.writeable = False
    return [(b_lo[i], dt[i], hops[i]) for i in range(len(ps))]
