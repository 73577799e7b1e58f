"""The packet network's flow table: the flows in flight as numpy columns (a mixin).

One row per flow, in the order the flows started: `_gid` (its transfer group's id),
`_idx` (its index in the group), `_rem` (bytes left), `_rate` (bytes/s), `_nb` (bytes),
`_lat` (path latency), `_maxr` (rate cap, inf: none), `_nh` (links on its path) and
`_flab` (its component label, -1 until a solve saw it); and `_flat`, the links of every
flow one after another (flow i's are the `_nh[i]` entries after those of flows 0..i-1).
Each column is a view of the first rows of a buffer that grows by doubling, so adding
flows copies nothing already there.

What a caller may rely on:

* `_add_flows` queues rows; `_take_rows` appends the queued ones, in the order they were
  queued, with one copy per column however many groups queued them (the solve at that
  instant calls it). `_keep` removes rows and keeps the others in order, so the flows on
  each link stay in table order: the solver's sums over a link are in that order, and the
  rates bit for bit those of the reference engine.
* Adding or removing rows replaces the column attributes (`self._rem` is a new view):
  read them afresh after such a call, never keep one across it. Writing into the rows
  (`self._rate[idx] = ...`) is how the solver sets rates.
* The change log, read and cleared by the solver (networks.packet.solve): `_seeds` (arrays
  of links whose flows changed, repeats allowed), `_new` (rows at the end added since
  the last solve), `_gone` (labels of the removed flows) and `_gone_links` (their
  entries: link, the flow's rate, its label); `_occ` holds the flows on each link, queued
  rows included. `_keep(..., seed=False)` removes rows without logging them (flows
  delivered by the solve itself).
* `_entries(flows)` finds the positions of some flows' links in `_flat` without a pass
  over the whole table; `_incidence_fast` gives the whole table as max-min incidence.

What the host provides: `links` (the network's links) before `_init_table`.
"""

from __future__ import annotations

import numpy as np

from networks.groups import Group

_NO_LABEL = np.full(1, -1)  # a point-to-point flow's label column (only ever copied)
_COLUMNS = (
    ("_gid", np.int64),
    ("_idx", np.int64),
    ("_rem", float),
    ("_rate", float),
    ("_nb", float),
    ("_lat", float),
    ("_maxr", float),
    ("_nh", np.int64),
    ("_flab", np.int64),
)


class FlowTable:
    def _init_table(self) -> None:
        self._buffers = {name: np.zeros(16, dtype) for name, dtype in _COLUMNS}
        self._buffers["_flat"] = np.zeros(64, np.int64)
        for name in self._buffers:
            setattr(self, name, self._buffers[name][:0])
        self._waiting_rows: list[tuple] = []  # queued rows, appended at the solve
        self._occ = np.zeros(len(self.links), np.int64)  # flows in the table on each link
        self._seeds: list[np.ndarray] = []  # links whose flows changed since the solve
        self._new = 0  # flows at the end of the table added since the last solve
        self._gone: list[np.ndarray] = []  # labels of the flows gone since the solve
        # the gone flows' links, with the flow's rate and label on each (_solve_above)
        self._gone_links: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def _add_flows(self, gid: int, g: Group, idx, rem, rate, lat, nh, flat, distinct: bool = False):
        """Put transfers idx of group g in the flow table (rem bytes left, sending at rate).
        The rows wait in `_waiting_rows` until the solve at this instant (`_take_rows`):
        the groups started at one instant are appended with one copy per column.
        (`distinct`: no link twice in `flat`.)"""
        k = len(idx)
        if k == 1 and len(g.nb) == 1:  # the whole group: its own arrays (never written)
            nb, maxr, lab = g.nb, g.maxr, _NO_LABEL
        else:
            nb, maxr, lab = g.nb[idx], g.maxr[idx], np.full(k, -1)
        gids = np.array([gid]) if k == 1 else np.full(k, gid)  # np.full: ~1 us more
        self._waiting_rows.append((gids, idx, rem, rate, nb, lat, maxr, nh, lab, flat))
        if distinct:
            self._occ[flat] += 1
        else:
            np.add.at(self._occ, flat, 1)
        self._seeds.append(flat)
        self._new += k

    def _take_rows(self) -> None:
        """Append the waiting rows to the table, in the order they were added."""
        rows, self._waiting_rows = self._waiting_rows, []
        n, k = len(self._rem), sum(len(r[1]) for r in rows)
        for j, (name, _) in enumerate(_COLUMNS):
            self._append(
                name, n, rows[0][j] if len(rows) == 1 else np.concatenate([r[j] for r in rows]), k
            )
        flat = rows[0][-1] if len(rows) == 1 else np.concatenate([r[-1] for r in rows])
        self._append("_flat", len(self._flat), flat, len(flat))

    def _append(self, name: str, n: int, values, k: int) -> None:
        buf = self._buffers[name]
        if n + k > len(buf):
            grown = np.empty(max(2 * len(buf), n + k), buf.dtype)
            grown[:n] = buf[:n]
            self._buffers[name] = buf = grown
        buf[n : n + k] = values
        setattr(self, name, buf[: n + k])

    def _entries(self, flows: np.ndarray, ends=None) -> np.ndarray:
        """Positions in `_flat` of the entries of `flows` (ascending), in order: each
        flow's first entry from the running sum of hops (`ends`: its value at `flows`,
        if known), then one repeat over these flows only (repeating a mask over the whole
        table costs ~7 ns a flow: 0.35 ms at 50,000 flows, per call)."""
        nh = self._nh[flows]
        first = (np.cumsum(self._nh)[flows] if ends is None else ends) - nh
        if len(flows) == 1:
            return np.arange(first[0], first[0] + nh[0])
        return np.repeat(first - (np.cumsum(nh) - nh), nh) + np.arange(int(nh.sum()))

    def _keep(self, keep: np.ndarray, seed: bool = True) -> None:
        """Keep the flows where `keep` is True (order preserved); the links of the others
        lose a flow (and are re-solved at the next solve if `seed`)."""
        drop = np.flatnonzero(~keep)
        nh = self._nh[drop]
        ends = np.cumsum(self._nh)[drop]  # where each dropped flow's entries end
        de = self._entries(drop, ends)
        gone = self._flat[de]
        np.subtract.at(self._occ, gone, 1)
        if seed:
            lab = self._flab[drop]
            self._seeds.append(gone)
            self._gone.append(lab)
            # a flow no solve saw (label -1; a split ring's may carry a rate) is not in
            # the loads: it takes nothing off them
            rate = np.where(lab >= 0, self._rate[drop], 0.0)
            self._gone_links.append((gone, np.repeat(rate, nh), np.repeat(lab, nh)))
        if self._new:
            self._new -= int(np.count_nonzero(drop >= len(keep) - self._new))
        if len(drop) <= self.SLIDE_MAX:  # a few rows: slide the stretches between them
            lo = drop.tolist()
            hi = [x + 1 for x in lo]
            self._slide("_flat", (ends - nh).tolist(), ends.tolist(), len(self._flat))
            n = len(keep)
            for name, _ in _COLUMNS:
                self._slide(name, lo, hi, n)
            return
        # rows before the first one dropped stay where they are: only the rest moves
        first = int(drop[0])
        efirst = int(de[0]) if len(de) else len(self._flat)
        ent = np.ones(len(self._flat) - efirst, bool)
        ent[de - efirst] = False
        self._compact("_flat", efirst, np.flatnonzero(ent) + efirst)
        idx = np.flatnonzero(keep)
        for name, _ in _COLUMNS:
            self._compact(name, first, idx[first:])

    SLIDE_MAX = 16  # flows removed from which the table is compacted by one gather

    def _slide(self, name: str, lo: list, hi: list, length: int) -> None:
        """Remove rows [lo[j], hi[j]) (ascending, disjoint) from column `name` of `length`
        rows, moving each stretch between them left by a slice copy (numpy copies
        overlapping slices correctly): the rows before the first cut stay put."""
        if not lo:
            return
        buf = self._buffers[name]
        out = lo[0]
        for j, a in enumerate(hi):
            b = lo[j + 1] if j + 1 < len(lo) else length
            if b > a:
                buf[out : out + b - a] = buf[a:b]
                out += b - a
        setattr(self, name, buf[:out])

    def _compact(self, name: str, first: int, rest: np.ndarray) -> None:
        """Keep rows :first and then the rows `rest` (ascending, all >= first)."""
        buf = self._buffers[name]
        buf[first : first + len(rest)] = buf[rest]  # the gather copies before writing
        setattr(self, name, buf[: first + len(rest)])

    def _incidence_fast(self):
        """As `_incidence`: the flat routes, each capped flow's private link after its path."""
        n, nh = len(self.links), self._nh
        capped = np.flatnonzero(self._maxr < np.inf)
        if not len(capped):
            return self._flat, np.repeat(np.arange(len(nh)), nh), self.capacity
        rows, ext = self._with_private_links(self._flat, nh, capped, n)
        cols = np.repeat(np.arange(len(nh)), ext)
        return rows, cols, np.concatenate([self.capacity, self._maxr[capped]])

    @staticmethod
    def _with_private_links(flat, nh, capped, n):
        """The entries with each capped flow's private link (n, n+1, ...) after its path."""
        ext = nh.copy()
        ext[capped] += 1
        ends = np.cumsum(ext)  # the private link is the last entry of a capped flow
        rows = np.empty(int(ends[-1]) if len(ends) else 0, np.int64)
        mask = np.ones(len(rows), bool)
        mask[ends[capped] - 1] = False
        rows[mask] = flat
        rows[~mask] = n + np.arange(len(capped))
        return rows, ext
