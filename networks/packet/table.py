"""The packet network's flow table: the flows in flight as numpy columns (`FlowTable`).

One row per flow, in the order the flows started; each column is a view of the first rows
of a buffer that grows by doubling, so adding flows copies nothing already there. The
fast engine (networks.packet.engine) adds and removes rows; the solver
(networks.packet.solve) reads them, writes their rates and labels, and reads and clears
the change log.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from networks.groups import Group

_NO_LABEL = np.full(1, -1)  # a point-to-point flow's label column (only ever copied)
_COLUMNS = (
    ("gid", np.int64),
    ("idx", np.int64),
    ("rem", float),
    ("rate", float),
    ("nb", float),
    ("lat", float),
    ("maxr", float),
    ("nh", np.int64),
    ("flab", np.int64),
)


class FlowTable:
    """The flows in flight, one row each, as numpy columns, and what changed since the
    last solve.

    Gives: the columns `gid` (the flow's transfer group's id), `idx` (its index in the
    group), `rem` (bytes left), `rate` (bytes/s), `nb` (bytes), `lat` (path latency),
    `maxr` (rate cap, inf: none), `nh` (links on its path) and `flab` (its component
    label, -1 until a solve saw it); `flat`, the links of every flow one after another
    (flow i's are the `nh[i]` entries after those of flows 0..i-1); `occ`, the flows on
    each link, queued rows included.

    * `add` queues rows; `take_rows` appends the queued ones, in the order they were
      queued, with one copy per column however many groups queued them (the solve at that
      instant calls it). `keep` removes rows and keeps the others in order, so the flows
      on each link stay in table order: the solver's sums over a link are in that order,
      and the rates bit for bit those of the reference engine.
    * Adding or removing rows replaces the columns (`table.rem` is a new view): read them
      afresh after such a call, never keep one across it. Writing into the rows
      (`table.rate[idx] = ...`) is how the solver sets rates.
    * The change log, read and cleared by the solver: `seeds` (arrays of links whose
      flows changed, repeats allowed), `new` (rows at the end added since the last
      solve), `gone` (labels of the removed flows) and `gone_links` (their entries: link,
      the flow's rate, its label); `keep(..., seed=False)` removes rows without logging
      them (flows delivered by the solve itself); `clear_log()` empties it.
    * `entries(flows)` finds the positions of some flows' links in `flat` without a pass
      over the whole table; `incidence()` gives the whole table as max-min incidence,
      each capped flow's private link after its path (`with_private_links`).

    Needs: `capacity`, the network's links' capacities (their number sizes `occ`).
    """

    def __init__(self, capacity: np.ndarray) -> None:
        self.capacity = capacity
        self._buffers = {name: np.zeros(16, dtype) for name, dtype in _COLUMNS}
        self._buffers["flat"] = np.zeros(64, np.int64)
        for name in self._buffers:
            setattr(self, name, self._buffers[name][:0])
        self.waiting: list[tuple] = []  # queued rows, appended at the solve
        self.occ = np.zeros(len(capacity), np.int64)  # flows in the table on each link
        self.clear_log()

    def clear_log(self) -> None:
        """Forget what changed (the solver has seen it, or no flow is left)."""
        self.seeds: list[np.ndarray] = []  # links whose flows changed since the solve
        self.new = 0  # flows at the end of the table added since the last solve
        self.gone: list[np.ndarray] = []  # labels of the flows gone since the solve
        # the gone flows' links, with the flow's rate and label on each (above.py)
        self.gone_links: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, gid: int, g: Group, idx, rem, rate, lat, nh, flat, distinct: bool = False):
        """Put transfers idx of group g in the flow table (rem bytes left, sending at rate).
        The rows wait in `waiting` until the solve at this instant (`take_rows`):
        the groups started at one instant are appended with one copy per column.
        (`distinct`: no link twice in `flat`.)"""
        k = len(idx)
        if k == 1 and len(g.nb) == 1:  # the whole group: its own arrays (never written)
            nb, maxr, lab = g.nb, g.maxr, _NO_LABEL
        else:
            nb, maxr, lab = g.nb[idx], g.maxr[idx], np.full(k, -1)
        gids = np.array([gid]) if k == 1 else np.full(k, gid)  # np.full: ~1 us more
        self.waiting.append((gids, idx, rem, rate, nb, lat, maxr, nh, lab, flat))
        if distinct:
            self.occ[flat] += 1
        else:
            np.add.at(self.occ, flat, 1)
        self.seeds.append(flat)
        self.new += k

    def take_rows(self) -> None:
        """Append the waiting rows to the table, in the order they were added."""
        rows, self.waiting = self.waiting, []
        n, k = len(self.rem), sum(len(r[1]) for r in rows)
        for j, (name, _) in enumerate(_COLUMNS):
            self._append(
                name, n, rows[0][j] if len(rows) == 1 else np.concatenate([r[j] for r in rows]), k
            )
        flat = rows[0][-1] if len(rows) == 1 else np.concatenate([r[-1] for r in rows])
        self._append("flat", len(self.flat), flat, len(flat))

    def _append(self, name: str, n: int, values, k: int) -> None:
        buf = self._buffers[name]
        if n + k > len(buf):
            grown = np.empty(max(2 * len(buf), n + k), buf.dtype)
            grown[:n] = buf[:n]
            self._buffers[name] = buf = grown
        buf[n : n + k] = values
        setattr(self, name, buf[: n + k])

    def entries(self, flows: np.ndarray, ends=None) -> np.ndarray:
        """Positions in `flat` of the entries of `flows` (ascending), in order: each
        flow's first entry from the running sum of hops (`ends`: its value at `flows`,
        if known), then one repeat over these flows only (repeating a mask over the whole
        table costs ~7 ns a flow: 0.35 ms at 50,000 flows, per call)."""
        if len(flows) <= self.small_flows and len(self.nh) <= self.small_rows:  # plain Python
            hops = self.nh.tolist()
            at = list(accumulate(hops)) if ends is None else None
            out: list = []
            for j, f in enumerate(flows.tolist()):
                end = at[f] if ends is None else int(ends[j])
                out.extend(range(end - hops[f], end))
            return np.array(out, np.int64)
        nh = self.nh[flows]
        first = (np.cumsum(self.nh)[flows] if ends is None else ends) - nh
        if len(flows) == 1:
            return np.arange(first[0], first[0] + nh[0])
        return np.repeat(first - (np.cumsum(nh) - nh), nh) + np.arange(int(nh.sum()))

    def keep(self, keep: np.ndarray, seed: bool = True) -> None:
        """Keep the flows where `keep` is True (order preserved); the links of the others
        lose a flow (and are re-solved at the next solve if `seed`)."""
        drop = np.flatnonzero(~keep)
        nh = self.nh[drop]
        ends = np.cumsum(self.nh)[drop]  # where each dropped flow's entries end
        de = self.entries(drop, ends)
        gone = self.flat[de]
        np.subtract.at(self.occ, gone, 1)
        if seed:
            lab = self.flab[drop]
            self.seeds.append(gone)
            self.gone.append(lab)
            # a flow no solve saw (label -1; a split ring's may carry a rate) is not in
            # the loads: it takes nothing off them
            rate = np.where(lab >= 0, self.rate[drop], 0.0)
            self.gone_links.append((gone, np.repeat(rate, nh), np.repeat(lab, nh)))
        if self.new:
            self.new -= int(np.count_nonzero(drop >= len(keep) - self.new))
        if len(drop) <= self.SLIDE_MAX:  # a few rows: slide the stretches between them
            lo = drop.tolist()
            hi = [x + 1 for x in lo]
            self._slide("flat", (ends - nh).tolist(), ends.tolist(), len(self.flat))
            n = len(keep)
            for name, _ in _COLUMNS:
                self._slide(name, lo, hi, n)
            return
        # rows before the first one dropped stay where they are: only the rest moves
        first = int(drop[0])
        efirst = int(de[0]) if len(de) else len(self.flat)
        ent = np.ones(len(self.flat) - efirst, bool)
        ent[de - efirst] = False
        self._compact("flat", efirst, np.flatnonzero(ent) + efirst)
        idx = np.flatnonzero(keep)
        for name, _ in _COLUMNS:
            self._compact(name, first, idx[first:])

    SLIDE_MAX = 16  # flows removed from which the table is compacted by one gather
    # `entries` of up to small_flows flows in a table of up to small_rows in plain Python
    # (numpy's per-call cost exceeds the work there; tests turn them off to compare)
    small_flows, small_rows = 8, 64

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

    def incidence(self):
        """The whole table as max-min incidence (rows: links, columns: flows) and the
        capacities: the flat routes, each capped flow's private link after its path."""
        n, nh = len(self.capacity), self.nh
        capped = np.flatnonzero(self.maxr < np.inf)
        if not len(capped):
            return self.flat, np.repeat(np.arange(len(nh)), nh), self.capacity
        rows, ext = self.with_private_links(self.flat, nh, capped, n)
        cols = np.repeat(np.arange(len(nh)), ext)
        return rows, cols, np.concatenate([self.capacity, self.maxr[capped]])

    @staticmethod
    def with_private_links(flat, nh, capped, n):
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
