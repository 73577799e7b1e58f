"""What a network sent, kept per transfer group rather than per transfer.

A collective step of N transfers is one `Group` (arrays of sizes and arrival times), a
ring collective on free links one `networks.packet.ringjob.RingJob`; per-transfer
`TransferRecord`s are built only when someone asks for them (`Network.records`,
`Network.transfers()`), so a million-transfer collective costs no million objects.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heappush

import numpy as np
import simpy
from simpy.core import NORMAL

COLUMNS = ["src", "dst", "nbytes", "start", "end", "tag"]


@dataclass(slots=True)
class TransferRecord:
    src: object
    dst: object
    nbytes: float
    start: float
    end: float = math.nan
    tag: str = ""
    max_rate: float = math.inf  # bytes/s the sender can feed (a GPU-side limit), inf: none


class Group:
    """Transfers started at one instant: sources, destinations, sizes, rate caps, and the
    arrival time of each (nan until it arrives). `events`: one event per transfer
    (`transfer_group`), or None and `done` fires once all arrived (`transfer_all`). Once
    every transfer has landed, `events` and `done` are None (a network's log keeps the
    group's transfers, not what waited on them)."""

    __slots__ = ("srcs", "dsts", "nb", "maxr", "start", "tag", "ends", "events", "done", "pending")

    def __init__(self, srcs, dsts, nb, maxr, start, tag, events=None, done=None):
        self.srcs, self.dsts, self.nb, self.maxr = srcs, dsts, nb, maxr
        self.start, self.tag, self.events, self.done = start, tag, events, done
        self.ends = np.empty(len(nb))  # (np.full costs a microsecond more per group)
        self.ends.fill(math.nan)
        self.pending = len(nb)

    def record(self, i: int) -> TransferRecord:
        return TransferRecord(
            self.srcs[i],
            self.dsts[i],
            float(self.nb[i]),
            self.start,
            float(self.ends[i]),
            self.tag,
            float(self.maxr[i]),
        )

    def columns(self):
        n = len(self.nb)
        src, dst = node_array(self.srcs), node_array(self.dsts)
        return (
            self.srcs if src is None else src,
            self.dsts if dst is None else dst,
            self.nb,
            np.full(n, self.start),
            self.ends,
            [self.tag] * n,
            self.maxr,
        )

    def succeed(self, _record=None):
        """One transfer of a `transfer_all` group arrived (a subclass's own `_deliver`)."""
        self.pending -= 1
        if self.pending == 0:
            self.finish()

    def finish(self) -> None:
        """Every transfer landed: `done` succeeded with the group's Records, and let go (a
        log keeps the group, not its waiters)."""
        done, self.done = self.done, None
        done.succeed(Records(self))


class Records(Sequence):
    """A group's TransferRecords, built when read: the value of `transfer_all`'s event."""

    def __init__(self, entry):
        self._entry, self._list = entry, None

    def _all(self) -> list:
        if self._list is None:
            self._list = _records(self._entry.columns())
        return self._list

    def __len__(self):
        return len(self._all())

    def __getitem__(self, i):
        return self._all()[i]

    def ends(self) -> list[float]:
        """Each transfer's arrival time, in order, without building the records (a
        collective reads only these: 32k records per call at 16,384 GPUs)."""
        if self._list is not None:
            return [r.end for r in self._list]
        return self._entry.ends.tolist()  # a Group's arrival times, as its columns give

    def end_array(self) -> np.ndarray:
        """`ends()` as a float array (to read, not to write)."""
        if self._list is not None:
            return np.array([r.end for r in self._list], float)
        return self._entry.ends


def node_array(nodes) -> np.ndarray | None:
    """The nodes as an int64 array when all are plain ints (tables build much faster from
    it, with the dtype pandas infers from the ints); None otherwise."""
    if not all(type(x) is int for x in nodes):
        return None
    try:
        return np.array(nodes, np.int64)
    except OverflowError:
        return None


def _listed(x) -> list:
    return x.tolist() if isinstance(x, np.ndarray) else list(x)


def _records(cols) -> list[TransferRecord]:
    src, dst, nb, start, end, tag, maxr = cols
    return [
        TransferRecord(*row)
        for row in zip(
            _listed(src),
            _listed(dst),
            np.asarray(nb, float).tolist(),
            np.asarray(start, float).tolist(),
            np.asarray(end, float).tolist(),
            tag,
            np.asarray(maxr, float).tolist(),
            strict=True,
        )
    ]


def _entry_columns(entry):
    if isinstance(entry, TransferRecord):
        r = entry
        return [r.src], [r.dst], [r.nbytes], [r.start], [r.end], [r.tag], [r.max_rate]
    return entry.columns()


def _joined(parts):
    """One column from the entries' parts: an int64 array if every part is one."""
    if parts and all(isinstance(x, np.ndarray) for x in parts):
        return np.concatenate(parts)
    return list(itertools.chain.from_iterable(_listed(x) for x in parts))


def _all_columns(log):
    """The log's transfers as columns, in order of start (a stable sort: entries that
    expand later steps of a ring keep the order the transfers would have started in)."""
    if log and all(type(e) is Group for e in log):
        src, dst, nb, start, end, tag, maxr = _group_columns(log)
    else:
        cols = [_entry_columns(e) for e in log]
        src, dst = _joined([c[0] for c in cols]), _joined([c[1] for c in cols])
        counts = [len(c[2]) for c in cols]
        tag = np.repeat(np.array([e.tag for e in log] + [None], object)[:-1], counts)
        nums = [
            np.concatenate([np.asarray(c[k], float) for c in cols]) if cols else np.zeros(0)
            for k in (2, 3, 4, 6)
        ]
        nb, start, end, maxr = nums
    if len(start) > 1 and (np.diff(start) < 0).any():
        order = np.argsort(start, kind="stable")
        src, dst = (
            [x[i] for i in order.tolist()] if isinstance(x, list) else x[order] for x in (src, dst)
        )
        tag, nb, start, end, maxr = tag[order], nb[order], start[order], end[order], maxr[order]
    return src, dst, nb, start, end, tag, maxr


def _group_columns(log):
    """As the generic path of `_all_columns` for a log of Groups only, without building
    columns per group (a point-to-point transfer is one group): node columns are int64
    arrays when every node is a plain int, else lists, as `_joined` gives."""
    counts = [len(e.nb) for e in log]
    cols = []
    for name in ("srcs", "dsts"):
        nodes = list(itertools.chain.from_iterable(_listed(getattr(e, name)) for e in log))
        arr = node_array(nodes)
        cols.append(nodes if arr is None else arr)
    nb = np.concatenate([np.asarray(e.nb, float) for e in log])
    start = np.repeat(np.array([e.start for e in log], float), counts)
    end = np.concatenate([np.asarray(e.ends, float) for e in log])
    maxr = np.concatenate([np.asarray(e.maxr, float) for e in log])
    tag = np.repeat(np.array([e.tag for e in log] + [None], object)[:-1], counts)
    return cols[0], cols[1], nb, start, end, tag, maxr


def expand_records(log) -> list[TransferRecord]:
    if all(isinstance(e, TransferRecord) for e in log):
        return list(log)
    return _records(_all_columns(log))


def transfer_table(log):
    import pandas as pd

    if all(isinstance(e, TransferRecord) for e in log):
        return pd.DataFrame(
            [(r.src, r.dst, r.nbytes, r.start, r.end, r.tag) for r in log], columns=COLUMNS
        )
    src, dst, nb, start, end, tag, _ = _all_columns(log)
    if not len(src):
        return pd.DataFrame([], columns=COLUMNS)
    return pd.DataFrame(dict(zip(COLUMNS, (src, dst, nb, start, end, tag), strict=True)))


def seq_sum(acc: float, values) -> float:
    """acc + v0 + v1 + ... added one at a time, left to right (as one add per transfer
    would), not numpy's pairwise sum."""
    values = np.asarray(values, float)
    if len(values) <= 32:  # a few adds: in Python floats (the same IEEE additions)
        for v in values.tolist():
            acc = acc + v
        return float(acc)
    return float(np.cumsum(np.concatenate(([acc], values)))[-1])


def repeat_add(acc: float, c: float, k: int) -> float:
    """acc + c + c + ... (k times, one add at a time). When every partial sum is an exact
    float (both are multiples of one power of two and the sums stay below 2**53 of it, as
    for most byte counts), that is acc + k*c, computed in integers; else the adds."""
    if k <= 0:
        return acc
    if math.isfinite(acc) and math.isfinite(c):
        (an, ad), (cn, cd) = acc.as_integer_ratio(), float(c).as_integer_ratio()
        d = max(ad, cd)  # powers of two
        a, step = an * (d // ad), cn * (d // cd)
        if max(abs(a), abs(a + k * step)) <= 2**53:
            return (a + k * step) / d
    return seq_sum(acc, np.full(k, c))


def chain(start: np.ndarray, incs) -> np.ndarray:
    """Each entry of `start` plus incs[0], then incs[1], ... one add at a time."""
    incs = np.asarray(incs, float)
    if len(incs) == 0 or len(start) == 0:
        return start.copy()
    u, inv = np.unique(start, return_inverse=True)
    if (incs == incs[0]).all():
        return np.array([repeat_add(x, float(incs[0]), len(incs)) for x in u.tolist()])[inv]
    if len(u) * len(incs) > 4_000_000:  # too big a matrix: one vector add per increment
        for d in incs.tolist():
            u = u + d
        return u[inv]
    m = np.empty((len(u), len(incs) + 1))
    m[:, 0] = u
    m[:, 1:] = incs
    return np.cumsum(m, axis=1)[:, -1][inv]


def at(env: simpy.Environment, t: float, callback) -> simpy.Event:
    """An event processed at absolute time t (>= now), calling callback(event): without
    the round-off of timeout(t - now). Uses SimPy 4's event queue, as extrapolators.execution.runtime."""
    ev = simpy.Event(env)
    ev._ok, ev._value = True, None
    ev.callbacks.append(callback)
    heappush(env._queue, (t, NORMAL, next(env._eid), ev))
    return ev


class Then:
    """A transfer group's `done` that calls `fn(records)` at once when its last transfer
    lands (`Network.transfer_all_then`), where an event would wait for the next step."""

    __slots__ = ("fn",)
    calls_back = True  # runs code that may start transfers (the fast engine defers it
    # out of a solve: networks.packet.landing)

    def __init__(self, fn) -> None:
        self.fn = fn

    def succeed(self, value=None) -> None:
        self.fn(value)


def fire_at(env: simpy.Environment, event: simpy.Event, t: float) -> None:
    """Trigger `event` (value None) to be processed at absolute time t (>= now): now, as
    `succeed` does, or later without the round-off of a timeout(t - now)."""
    if t <= env.now:
        event.succeed()
        return
    event._ok, event._value = True, None
    heappush(env._queue, (t, NORMAL, next(env._eid), event))
