"""Which distance rows each (source, destination) pair of a batch reads (`RouteReads`): the
part below the walks in networks.routing's `Routes`.

A pair reads K rows at K offsets: its distance to a node is the least over j of
off[j] + row_j[node] (0 at its own source). A row is keyed ('h', hub) for a hub's full row,
('w', switch) for a switch's full row, ('s', source) for a source's own bounded ball,
('i', source) for its distances inside its server (servers.RouteServers); pairs
from one source read the same rows, and GPUs on one hub or one rail share theirs.
"""

from __future__ import annotations

import numpy as np

from networks.routing.graph import RouteGraph
from networks.routing.rows import RouteRows
from networks.routing.servers import RouteServers


class RouteReads:
    """The rows a batch of pairs reads (see the module); it keeps no state of its own.

    Gives (to walks.RouteWalks):
    - `per_source(s_idx, d_idx)`: (row keys, per distinct source its K row numbers and
      offsets, each pair's source number, hub and link into the hub), worked out once
      per distinct source;
    - `bounded_reads` and `tight_reads`: each pair's reads cut to those that can be on a
      shortest path to its destination (`_keep_reads`); the least over the kept reads is
      the least over all, exactly, wherever the walk back from the destination goes;
    - `dist_rows(keys, kid, d_idx)`: the rows as a `_Rows`, each exact up to every
      destination asked of it (`_Rows.at(r, v)`: row r's distance at node v, inf outside
      a ball).
    Needs: `arrays` (a graph.RouteGraph), `rows` (a rows.RouteRows: `full_row`, `ball`)
    and `servers` (a servers.RouteServers: `server_reads`, `server_row`).
    """

    def __init__(self, arrays: RouteGraph, rows: RouteRows, servers: RouteServers):
        self.arrays, self.rows, self.servers = arrays, rows, servers

    def per_source(self, s_idx: np.ndarray, d_idx: np.ndarray):
        """Per pair, from its source: the distance rows it reads and their offsets (pairs x
        K arrays: its distance to a node is the least of offset + row there), its hub and
        its link into the hub (-1: none). Worked out once per distinct source:
        - a source with one out-link into hub x: x's shared row, offset the link's weight;
        - a GPU whose out-links all go to switches (an NVSwitch and a NIC's leaf): each
          switch's row, offset that link's weight (one Bellman step: any path leaves by one
          of them; the weights are integers whose sums stay below 2**53, so the least is
          the search's own distance, exactly). The switches' rows are shared by the GPUs on
          them (a server's eight, a rail's thousands), and no row per GPU is made;
        - anything else, or such a GPU asked only for GPUs of its own server (its bounded
          search stays in the server; a full row of the machine per NVSwitch cost 1.5 ms
          at 16,384 GPUs, and thousands of them do not stay cached): its own bounded ball
          (`RouteRows.ball`), offset 0.
        Rows a source reads fewer than K of are repeated (the least is the same)."""
        g = self.arrays
        u, inv = np.unique(s_idx, return_inverse=True)
        far = np.zeros(len(u), bool)  # some destination outside the source's server
        np.logical_or.at(far, inv, g.local[d_idx] != g.local[s_idx])
        hub = g.hub_of[u]
        on_hub = hub >= 0
        via = np.flatnonzero(g.via_switches[u] & far & ~on_hub)
        own = ~on_hub
        own[via] = False
        hubs, at_hub = np.unique(hub[on_hub], return_inverse=True)
        keys = [("h", x) for x in hubs.tolist()] + [("s", x) for x in u[own].tolist()]
        first = np.empty(len(u), np.int64)
        first[on_hub] = at_hub.reshape(-1)
        first[own] = len(hubs) + np.arange(int(own.sum()))
        first_off = np.where(on_hub, g.hub_w[u], 0.0)
        # a GPU of a small server reads its server's own row (`server_reads`) and the rows
        # of the heads of the server's network links out, each offset by the way to the
        # link and the link: any path out leaves by one of them, and one that comes back
        # crosses another. A rail cluster's GPU then reads its server and the 8 rail
        # leaves, not its NVSwitch's row of the machine (16,384 of them at 131,072 GPUs)
        csr, entries = g.csr, []
        for s in u[via].tolist():
            out = self.servers.server_reads(s)
            if out is None:
                out = [
                    (("w", int(csr.indices[k])), float(csr.data[k]))
                    for k in range(csr.indptr[s], csr.indptr[s + 1])
                ]
            else:
                # the own row last: the first read is the one a walk's big switches look
                # candidates up by (walks: `_equal_cost_step`), shared by a rail's GPUs
                out = [(("w", y), w) for y, w in out] + [(("i", s), 0.0)]
            entries.append(out)
        number: dict = {}  # row key -> its number, after the hubs' and the own balls'
        for out in entries:
            for key, _ in out:
                number.setdefault(key, len(keys) + len(number))
        keys += list(number)
        reads = [[(number[key], w) for key, w in out] for out in entries]
        width = max([1] + [len(r) for r in reads])
        kid = np.repeat(first[:, None], width, axis=1)
        off = np.repeat(first_off[:, None], width, axis=1)
        for i, r in zip(via.tolist(), reads, strict=True):
            r = r + r[:1] * (width - len(r))  # read fewer than K: repeated (the least is the same)
            kid[i] = [k for k, _ in r]
            off[i] = [w for _, w in r]
        return keys, kid, off, inv, hub[inv], g.hub_link_of[u][inv]

    def bounded_reads(self, keys, reads, offs, d_idx):
        """Reads (switch rows) that cannot be on a shortest path to the pair's destination
        dropped before their rows are searched for (replaced by the first kept). Each pair's
        most-read row (a rail's leaf, shared by the rail's GPUs) is searched first and
        bounds the distance from above; another read j is dropped when even a lower bound
        of it, off_j + (network links any path from switch j to the destination crosses)
        x (the lightest network link), is longer. `tight_reads` would drop it too, so the
        paths are the same; an NVSwitch's row of the machine (1.5 ms at 16,384 GPUs) is
        then searched only where the NVSwitch can be on the way (PXN)."""
        g = self.arrays
        m, width = reads.shape
        count = np.bincount(reads.ravel(), minlength=len(keys))
        first = reads[np.arange(m), np.argmax(count[reads], axis=1)]
        upper = np.full(m, np.inf)
        for k in np.unique(first).tolist():
            kind, x = keys[k]
            if kind in ("s", "i"):  # a source's own ball or server: no bound from it
                continue
            row = self.rows.full_row(x, hub=kind == "h")
            for j in range(width):
                on = np.flatnonzero(reads[:, j] == k)
                upper[on] = np.minimum(upper[on], offs[on, j] + row[d_idx[on]])
        comp = g.local
        nodes = np.array([x for _, x in keys], np.int64)
        lower = np.empty((m, width))
        for j in range(width):
            lower[:, j] = offs[:, j] + g.net_bound(comp[nodes[reads[:, j]]], comp[d_idx])
        own = np.array([kind == "i" for kind, _ in keys], bool)[reads]  # see `tight_reads`
        return _keep_reads(reads, offs, ~(lower > upper[:, None]) | own)

    def dist_rows(self, keys, kid, d_idx) -> _Rows:
        """The distance rows of row keys `keys` (pairs read rows kid[p], destination
        d_idx[p]): a hub's or a switch's full row, or a source's bounded ball (`rows.ball`, only
        ever its pairs' one row) grown until every destination asked of it is in. Any row
        exact up to the destination gives the same paths (see rows)."""
        rows = _Rows(len(self.arrays.nodes), len(keys))
        first = kid[:, 0]
        order = np.argsort(first, kind="stable")
        bounds = np.searchsorted(first[order], np.arange(len(keys) + 1))
        for r, (kind, x) in enumerate(keys):
            if kind in ("h", "w"):
                rows.add_full(r, self.rows.full_row(x, hub=kind == "h"))
                continue
            if kind == "i":  # the source's distances inside its server
                rows.add_ball(r, *self.servers.server_row(x))
                continue
            ds = d_idx[order[bounds[r] : bounds[r + 1]]]
            out = ds[:1]
            while len(out):  # balls only grow: the last covers every earlier one
                ball = self.rows.ball(x, int(out[0]))
                out = ds[~_in_sorted(ball[1], ds)]
                if len(out) and ball[0] == np.inf:
                    break  # the rest are unreachable
            rows.add_ball(r, ball[1], ball[2])
        rows.close()
        return rows

    @staticmethod
    def tight_reads(rows, row, off, s_idx, d_idx):
        """Each pair's reads cut to those on a shortest path to its destination (a first
        hop j with off_j + row_j[d] == the distance; the others replaced by the first such),
        and columns every pair now repeats dropped. Exact: every node u a walk back from d
        meets lies on a shortest path whose first hop (or first link out of the server) is
        such a j, so off_j + row_j[u] is u's distance there, or u is on the way to that
        link and its distance is in the server's own row, which is kept; and the least
        over the kept reads is the least over all. A
        rail's GPU (an NVSwitch and a leaf) sending to another server reads only its leaf's
        row."""
        if row.shape[1] == 1:
            return row, off
        vals = np.stack(
            [off[:, j] + rows.at(row[:, j], d_idx) for j in range(row.shape[1])], axis=1
        )
        # a server's own row stays: the way to the link out (no first hop of the rows
        # after it) is read there
        own = rows.slot[row] < 0
        return _keep_reads(row, off, (vals == vals.min(axis=1, keepdims=True)) | own)


def _keep_reads(reads: np.ndarray, offs: np.ndarray, keep: np.ndarray):
    """Each pair's reads where `keep` says (the others replaced by its first kept one: the
    least over them is the same), then the columns every pair now repeats dropped."""
    m, width = reads.shape
    sel = np.where(keep, np.arange(width), np.argmax(keep, axis=1)[:, None])
    reads = reads[np.arange(m)[:, None], sel]
    offs = offs[np.arange(m)[:, None], sel]
    cols = [0] + [
        j
        for j in range(1, width)
        if (reads[:, j] != reads[:, 0]).any() or (offs[:, j] != offs[:, 0]).any()
    ]
    return reads[:, cols], offs[:, cols]


def _in_sorted(sorted_ids: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Whether each of x is in the sorted array."""
    if not len(sorted_ids):
        return np.zeros(len(x), bool)
    k = np.minimum(np.searchsorted(sorted_ids, x), len(sorted_ids) - 1)
    return sorted_ids[k] == x


class _Rows:
    """The distance rows one walk reads: full rows (hubs', switches') in one matrix, and
    bounded balls (a source's own search) as sorted (row, node) codes, so a walk of a few
    GPUs in a big machine does not fill a row of every node per source (a tensor-parallel
    group's ring in a 16,384-GPU cluster: its balls hold a server each)."""

    def __init__(self, n: int, n_keys: int):
        self.n = n
        self.slot = np.full(n_keys, -1, np.int64)  # key -> its row in the matrix, or -1
        self._full: list = []
        self._codes: list = []
        self._vals: list = []

    def add_full(self, r: int, row: np.ndarray) -> None:
        self.slot[r] = len(self._full)
        self._full.append(row)

    def add_ball(self, r: int, idx: np.ndarray, dist: np.ndarray) -> None:
        self._codes.append(r * self.n + idx)
        self._vals.append(dist)

    def close(self) -> None:
        self.matrix = np.stack(self._full) if self._full else np.zeros((0, self.n))
        codes = np.concatenate(self._codes) if self._codes else np.zeros(0, np.int64)
        vals = np.concatenate(self._vals) if self._vals else np.zeros(0)
        order = np.argsort(codes, kind="stable")  # keys were added in order: a no-op sort
        self.codes, self.vals = codes[order], vals[order]
        self._full = self._codes = self._vals = None

    def ball(self, r: int) -> tuple:
        """Ball row r's nodes and distances (the nodes it holds, in order)."""
        lo, hi = np.searchsorted(self.codes, [r * self.n, (r + 1) * self.n])
        return self.codes[lo:hi] - r * self.n, self.vals[lo:hi]

    def at(self, r: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Row r[i]'s distance at node v[i] (inf outside a ball)."""
        slot = self.slot[r]
        full = slot >= 0
        if full.all():
            return self.matrix[slot, v]
        out = np.full(len(r), np.inf)
        if full.any():
            out[full] = self.matrix[slot[full], v[full]]
        ball = np.flatnonzero(~full)
        code = r[ball] * self.n + v[ball]
        hit = _in_sorted(self.codes, code)
        k = np.searchsorted(self.codes, code[hit])
        out[ball[hit]] = self.vals[k]
        return out
