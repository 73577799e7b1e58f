"""The walk that picks a route's links (`RouteWalks`): the top part of networks.routing's
`Routes`.

A route is found by walking back from the destination: at each node, the in-links whose
tail's distance from the source plus the link's weight is the node's distance are the
equal-cost candidates (in link order); where some are network links and some not, only
the network ones stay (network hops as late as they can be: NVLink first, a PXN relay at
the sender); the walk takes candidate crc32(f"{src!r}|{dst!r}|{node!r}") mod their
number (ECMP), until it reaches the source.
"""

from __future__ import annotations

import zlib

import numpy as np

from networks.routing import tuning
from networks.routing.graph import RouteGraph
from networks.routing.reads import RouteReads
from networks.routing.rows import RouteRows
from networks.routing.servers import RouteServers


class RouteWalks:
    """Routes walked back from their destinations (see the module), kept.

    Gives:
    - `path_links(src, dst)`: the route's link indices, source first (None: no path),
      cached and handed out as they are kept: a caller must not write into them (a
      batch's are read-only views of one array);
    - `paths_links(pairs)`: `path_links` of every pair, the same arrays bit for bit, the
      walks of a batch done together, one numpy step per hop;
    - `walk_links(src, dst)`: the straightforward per-pair walk, the reference the batch
      is checked against (tests/test_route_speedups.py); not cached.
    Needs: `arrays` (a graph.RouteGraph), `rows` (a rows.RouteRows: a single walk's
    distances), `servers` (a servers.RouteServers: pairs inside one server walked there)
    and `reads` (a reads.RouteReads: the rows each pair of a batch reads).
    """

    def __init__(
        self, arrays: RouteGraph, rows: RouteRows, servers: RouteServers, reads: RouteReads
    ):
        self.arrays, self.rows, self.servers, self.reads = arrays, rows, servers, reads
        self._paths: dict = {}  # (src, dst) -> its links, or None

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
        if len(todo) >= 8:  # pairs inside one server: a walk of the server alone
            paths.update(self.servers.server_walks(todo))
            todo = [k for k in todo if k not in paths]
        if len(todo) < 8:  # a few: the plain walk costs less than the set-up
            for k in todo:
                paths[k] = self.walk_links(*k)
        elif todo:
            self._walk_many(todo)
        return [paths[k] for k in pairs]

    def _walk_many(self, pairs) -> None:
        """Walk back from every destination at once, one hop per round (the rule of
        `walk_links`); store each pair's path (or None) in self._paths. Pairs go in chunks
        whose distance rows fit in tuning.HUB_ROWS_BYTES, sources taken in the order of the rows
        they read (each pair's path is its own, so any grouping gives the same paths)."""
        g = self.arrays
        idx = g.node_index
        s_idx = np.array([idx[s] for s, _ in pairs], np.int64)
        d_idx = np.array([idx[d] for _, d in pairs], np.int64)
        keys, kid, off, src, hub, link = self.reads.per_source(s_idx, d_idx)
        reads, offs = kid[src], off[src]
        if reads.shape[1] > 1:
            reads, offs = self.reads.bounded_reads(keys, reads, offs, d_idx)
        budget = max(1, tuning.HUB_ROWS_BYTES // (8 * max(len(g.nodes), 1)))
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

    def _walk_chunk(self, pairs, s_idx, d_idx, keys, row, off, hub, hub_link) -> None:
        """Walk one chunk's pairs back from their destinations, one hop of every pair per
        round, and store each pair's path (or None) in self._paths. A node with one
        in-link, or the source's hub, has one way back; elsewhere `_equal_cost_step`
        picks among the equal-cost in-links."""
        g = self.arrays
        rows = self.reads.dist_rows(keys, row, d_idx)
        row, off = self.reads.tight_reads(rows, row, off, s_idx, d_idx)
        width = row.shape[1]

        def dist(p, v):
            d = off[p, 0] + rows.at(row[p, 0], v)
            for j in range(1, width):
                d = np.minimum(d, off[p, j] + rows.at(row[p, j], v))
            return np.where(v == s_idx[p], 0.0, d)

        m, n = len(pairs), len(g.nodes)
        reader = _readers(row, off, hub, s_idx)
        reach = np.isfinite(dist(np.arange(m), d_idx))
        act = np.flatnonzero(reach & (s_idx != d_idx))
        v = d_idx[act]
        got_p, got_k = [], []  # per round: the pairs still walking and the link each took
        in_ptr, in_link, in_from = g.in_ptr, g.in_link, g.in_from
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
                k[multi], tail[multi] = self._equal_cost_step(
                    pairs, act[multi], v[multi], reader, row, off, rows, s_idx, dist
                )
            got_p.append(act)
            got_k.append(k)
            keep = tail != s_idx[act]
            act, v = act[keep], tail[keep]
        self._store_paths(pairs, got_p, got_k, reach)

    def _equal_cost_step(self, pairs, p, vm, reader, row, off, rows, s_idx, dist):
        """One hop back for pairs p at nodes vm (each with several in-links): the link
        each takes and its tail, among the in-links on a shortest path from the pair's
        source (in link order), picked by a hash of (source, destination, node) (ECMP)."""
        g = self.arrays
        n = len(g.nodes)
        # the equal-cost candidates depend on (rows, offsets, v) only (the source
        # itself is never a candidate here: its one out-link is the hub's, handled
        # by the caller, or its distance is 0 either way): find them once per distinct pair
        trip = reader[p] * n + vm
        _, first_u, inv = np.unique(trip, return_index=True, return_inverse=True)
        pu, vu = p[first_u], vm[first_u]
        big = g.in_deg[vu] > tuning.BIG_IN
        if big.any():  # where several ask one (row, node): a sort for them all
            at = np.flatnonzero(big)
            _, c_inv, c_n = np.unique(
                row[pu[at], 0] * n + vu[at], return_inverse=True, return_counts=True
            )
            big[at[c_n[c_inv.reshape(-1)] < tuning.SHARED_ASKS]] = False
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
        ok_k, ok_t, cnt_u = self._network_last(ok_k, ok_t, cnt_u)
        cnt = cnt_u[inv]
        pick = (np.cumsum(cnt_u) - cnt_u)[inv]  # the first equal-cost candidate
        tie = np.flatnonzero(cnt > 1)
        if len(tie):  # several: spread by a hash of (source, destination, node) (ECMP)
            nodes = g.nodes
            h = [
                zlib.crc32(f"{pairs[q][0]!r}|{pairs[q][1]!r}|{nodes[x]!r}".encode())
                for q, x in zip(p[tie].tolist(), vm[tie].tolist(), strict=True)
            ]
            pick[tie] += np.array(h, np.int64) % cnt[tie]
        return ok_k[pick], ok_t[pick]

    def _store_paths(self, pairs, got_p, got_k, reach) -> None:
        """Each pair's links, from the rounds of a walk (got_p[r]: the pairs that took a
        hop back in round r, got_k[r]: the link each took), source first, into
        self._paths (None where the destination is unreachable)."""
        m = len(pairs)
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

    def _network_last(self, ks, tails, cnt):
        """Of each item's equal-cost in-links (`_candidates`' answer), only the network
        ones where it has both network and NVLink/PCIe ones: walking back, network links
        are taken as late as they can be, so a route's NVLink hops come first. Between
        rails that puts the relay at the sender, as NCCL's PXN does (data crosses NVLink
        to the GPU on the destination's rail, then that GPU's NIC sends it); a hash
        would put it at the receiver for some pairs (a NIC writing into another GPU),
        and differently for replicas that are alike."""
        if not len(ks):
            return ks, tails, cnt
        item = np.repeat(np.arange(len(cnt)), cnt)
        net = self.arrays.net_link[ks]
        mixed = np.bincount(item, weights=net, minlength=len(cnt)) > 0
        keep = net | ~mixed[item]
        if keep.all():
            return ks, tails, cnt
        return ks[keep], tails[keep], np.bincount(item[keep], minlength=len(cnt))

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
        g = self.arrays
        in_ptr, in_link, in_from, w = g.in_ptr, g.in_link, g.in_from, g.weight
        n, width = len(g.nodes), row.shape[1]
        qi = np.repeat(np.arange(len(pu)), width)
        qkey = row[pu].ravel()
        qv = np.repeat(vu, width)
        qt = (dv[:, None] - off[pu]).ravel()
        combos, cinv = np.unique(qkey * n + qv, return_inverse=True)
        cinv = cinv.reshape(-1)
        # each combo's queries in query order (one stable sort, not a scan per combo)
        by_combo = np.argsort(cinv, kind="stable")
        cuts = np.searchsorted(cinv[by_combo], np.arange(len(combos) + 1)).tolist()
        owners, poss = [], []
        for c, code in enumerate(combos.tolist()):
            key, v = divmod(code, n)
            if rows.slot[key] < 0:  # a ball (a server's own row): only its nodes' links
                # into v can be tight (elsewhere the row is inf), not thousands of in-links
                b_nodes, b_vals = rows.ball(key)
                links = g.link_or_none(b_nodes, np.full(len(b_nodes), v))
                has = links >= 0
                at_pos = g.in_pos[links[has]]
                vals = b_vals[has] + w[links[has]]
            else:
                lo, hi = int(in_ptr[v]), int(in_ptr[v + 1])
                vals = rows.at(np.full(hi - lo, key), in_from[lo:hi]) + w[in_link[lo:hi]]
                at_pos = None
            order = np.argsort(vals, kind="stable")
            vals = vals[order]
            if at_pos is not None:
                order = at_pos[order]
            q = by_combo[cuts[c] : cuts[c + 1]]
            a = np.searchsorted(vals, qt[q], "left")
            b = np.searchsorted(vals, qt[q], "right")
            cnt = b - a
            if cnt.any():
                at = np.repeat(a - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))
                owners.append(np.repeat(qi[q], cnt))
                poss.append(order[at])
        # the source itself: dist 0, so its link u -> v is tight when w == d_v
        link = g.link_or_none(s_idx[pu], vu)
        mine = np.flatnonzero(link >= 0)
        mine = mine[w[link[mine]] == dv[mine]]
        owners.append(mine)
        poss.append(g.in_pos[link[mine]])
        code = np.unique(np.concatenate(owners) * (int(g.in_deg.max()) + 1) + np.concatenate(poss))
        owner, pos = np.divmod(code, int(g.in_deg.max()) + 1)
        at = in_ptr[vu[owner]] + pos
        return in_link[at], in_from[at], np.bincount(owner, minlength=len(pu))

    def _candidates(self, pu, vu, dist):
        """For each (pair pu[i], node vu[i]): the in-links of vu[i] on a shortest path from
        the pair's source (in link order) and their tails, concatenated, and how many each
        has. In slices of about tuning.CANDIDATES in-links, so memory stays bounded (a leaf switch
        of a large fat tree has hundreds of in-links)."""
        g = self.arrays
        in_ptr, in_link, in_from, w = g.in_ptr, g.in_link, g.in_from, g.weight
        if not len(vu):
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        du = in_ptr[vu + 1] - in_ptr[vu]
        cum = np.cumsum(du)
        cuts = np.searchsorted(
            cum, np.arange(tuning.CANDIDATES, int(cum[-1]), tuning.CANDIDATES), "right"
        )
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
        g = self.arrays
        d_idx, s_idx = g.node_index[dst], g.node_index[src]
        if s_idx in g.hub:
            dist = self.rows.hub_dist(s_idx)
        elif g.via_switches[s_idx] and g.local[s_idx] != g.local[d_idx]:
            dist = self.rows.via_dist(s_idx, d_idx)
        else:
            dist = self.rows.row(s_idx, d_idx).__getitem__
        if not np.isfinite(dist(d_idx)):
            return None
        links, v = [], d_idx
        hub = g.hub.get(s_idx, (None,))[0]
        while v != s_idx:  # walk back, picking among equal-cost predecessors by hash (ECMP)
            lo, hi = g.in_ptr[v], g.in_ptr[v + 1]
            if hi - lo == 1 or v == hub:
                # the only candidate: v's one in-link, or the source's one out-link into its
                # hub (any other way into the hub costs more than that link alone)
                k = int(g.in_link[lo]) if hi - lo == 1 else g.hub_link[s_idx]
                links.append(k)
                v = int(g.in_from[lo]) if hi - lo == 1 else s_idx
                continue
            ks, tails = g.in_link[lo:hi], g.in_from[lo:hi]
            ok = np.flatnonzero(dist(tails) + g.weight[ks] == dist(v))
            net = g.net_link[ks[ok]]
            if net.any():  # network links as late as they can be (`_network_last`)
                ok = ok[net]
            h = zlib.crc32(f"{src!r}|{dst!r}|{g.nodes[v]!r}".encode())
            j = ok[h % len(ok)]
            links.append(int(ks[j]))
            v = int(tails[j])
        return np.array(links[::-1], dtype=np.int64)


def _readers(row, off, hub, s_idx) -> np.ndarray:
    """Each pair's class of readers: pairs whose sources read the same rows at the same
    offsets have the same distances everywhere but at their sources, which only a hub's
    GPUs can share (a source is never a candidate tail); other sources are their own
    class."""
    _, off_cls = np.unique(off, return_inverse=True)
    own = np.where(hub < 0, s_idx, -1)[:, None]
    return _row_classes(np.hstack([row, off_cls.reshape(off.shape), own]))


def _row_classes(m: np.ndarray) -> np.ndarray:
    """Each row's class (equal rows, equal classes) of an int matrix: the rows as one
    mixed-radix int each where they fit 62 bits (one sort of ints, in the rows' order:
    `np.unique(axis=0)`'s labels; its sort of the rows as structured records was a sixth
    of an all-to-all's route walks), else by rows."""
    lo = m.min(axis=0) if len(m) else np.zeros(m.shape[1], np.int64)
    span = (m.max(axis=0) - lo + 1) if len(m) else np.ones(m.shape[1], np.int64)
    if float(np.prod(span.astype(float))) < 2.0**62:
        code = np.zeros(len(m), np.int64)
        for j in range(m.shape[1]):
            code = code * int(span[j]) + (m[:, j] - lo[j])
        return np.unique(code, return_inverse=True)[1].reshape(-1)
    return np.unique(m, axis=0, return_inverse=True)[1].reshape(-1)
