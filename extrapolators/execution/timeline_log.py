"""The runtime's log of what ran, and the timeline built from it when asked for.

The runtime logs one tuple per task (COLUMNS), except that a ComputeRun's tasks are one
`Block` (the shared run and the instants its tasks ended). At 16,384 GPUs that log
holds millions of entries for tens of millions of rows, and building the timeline table
took longer than a quarter of the simulation; so what a run reports without the table (the
iteration times, each GPU's compute rows for the memory model, the busy intervals for the
breakdown) is read from the log, and the table is built on first use.
"""

from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple

import numpy as np

from extrapolators.execution.tasks import ComputeRun

COLUMNS = (
    "gpu",
    "stream",
    "kind",
    "name",
    "layer",
    "phase",
    "start",
    "end",
    "nbytes",
    "key",
    "iteration",
    "op_id",
    "microbatch",
)


class Block(NamedTuple):
    """The rows of one ComputeRun on one stream: task i ran from acc[i] to acc[i + 1], or,
    where its GPU's host issued a task late (perfmodel.host), from starts[i] to acc[i + 1]
    (the stream idled from acc[i] to starts[i])."""

    who: tuple  # (gpu, stream, iteration)
    run: ComputeRun
    acc: np.ndarray
    starts: np.ndarray | None = None  # None: back to back (starts = acc[:-1])

    def instants(self) -> tuple[list, list]:
        """(starts, ends) of its rows as lists (the instants read once)."""
        acc = self.acc.tolist()
        return (acc[:-1] if self.starts is None else self.starts.tolist()), acc[1:]


class TimelineLog:
    """The entries (tuples and Blocks) in the order they ended: the timeline's row order."""

    def __init__(self, log: list):
        self._log = log
        self._scanned = None

    def rows(self) -> list[tuple]:
        """The timeline as one tuple per task (COLUMNS), blocks expanded."""
        out = []
        for entry in self._log:
            if type(entry) is Block:
                gpu, stream, it = entry.who
                r, (st, en) = entry.run, entry.instants()
                for i in range(len(r)):
                    out.append(
                        (
                            gpu,
                            stream,
                            "compute",
                            r.names[i],
                            r.layers[i],
                            r.phases[i],
                            st[i],
                            en[i],
                            0.0,
                            None,
                            it,
                            r.op_ids[i],
                            r.mbs[i],
                        )
                    )
            else:
                out.append(entry)
        return out

    def columns(self) -> dict:
        """The timeline as {column: array}, rows in the order of `rows`, dtypes as pandas
        infers them from `rows`. Built without a tuple or a Python object per task: the
        log is split into blocks and single rows once; a column is one code per log entry
        repeated over the entry's rows (gpu, stream, kind, key, iteration: constant over
        a block) or a gather from a table of the distinct runs' codes and the single rows'
        codes (name, layer, phase, op_id, microbatch), and strings are decoded once
        (per-row Python object conversion was most of the cost at 1,000+ GPUs)."""
        log = self._log
        is_block = np.fromiter((type(e) is Block for e in log), bool, count=len(log))
        blocks = [e for e in log if type(e) is Block]
        singles = [e for e in log if type(e) is not Block]
        lens = np.ones(len(log), dtype=np.int64)
        lens[is_block] = [len(b.run) for b in blocks]
        # column by column (itemgetter in C): 3x faster than zip(*singles) at 600k rows
        scols = [list(map(itemgetter(k), singles)) for k in range(len(COLUMNS))]
        single = dict(zip(COLUMNS, scols, strict=True))
        out = {}
        # one code per entry, repeated over its rows
        per_block = {
            "gpu": [b.who[0] for b in blocks],
            "stream": [b.who[1] for b in blocks],
            "kind": ["compute"] * len(blocks),
            "key": [None] * len(blocks),
            "iteration": [b.who[2] for b in blocks],
        }
        for c, values in per_block.items():
            codes = _Codes()
            entry = np.empty(len(log), dtype=np.int32)
            entry[is_block] = codes.codes(values)
            entry[~is_block] = codes.codes(single[c])
            out[c] = codes.decode(entry, lambda a: np.repeat(a, lens))
        # per-row columns: a table of each distinct run's codes, then the singles' codes
        names = ("name", "layer", "phase", "op_id", "microbatch")
        runs: dict = {}  # id(run) -> offset in the table (runs stay alive in the log)
        distinct, run_size = [], 0
        for b in blocks:
            if id(b.run) not in runs:
                runs[id(b.run)] = run_size
                run_size += len(b.run)
                distinct.append(b.run)
        src = np.empty(len(log), dtype=np.int64)
        src[is_block] = [runs[id(b.run)] for b in blocks]
        src[~is_block] = run_size + np.arange(len(singles))
        first = np.cumsum(lens) - lens  # each entry's first row
        idx = np.repeat(src - first, lens) + np.arange(int(lens.sum()))
        for c, attr in zip(names, ("names", "layers", "phases", "op_ids", "mbs"), strict=True):
            codes = _Codes()
            table = np.concatenate(
                [*(codes.codes(getattr(r, attr)) for r in distinct), codes.codes(single[c])]
            )
            out[c] = codes.decode(table, lambda a: a[idx])
        if not blocks:  # single values only: as pandas infers them from the rows
            out.update(
                start=list(single["start"]), end=list(single["end"]), nbytes=list(single["nbytes"])
            )
        else:
            row_block = np.repeat(is_block, lens)
            accs = np.concatenate([b.acc for b in blocks])  # a block: its rows + 1 instants
            last = np.cumsum(lens[is_block] + 1) - 1
            for c, edge in (("start", last), ("end", last - lens[is_block])):
                col = np.empty(len(row_block))
                rows_of = np.ones(len(accs), bool)
                rows_of[edge] = False  # starts: all but each block's last; ends: first
                col[row_block] = accs[rows_of]
                col[~row_block] = np.array(single[c], dtype=float)
                out[c] = col
            if any(b.starts is not None for b in blocks):  # tasks a host issued late
                late = [b.acc[:-1] if b.starts is None else b.starts for b in blocks]
                out["start"][row_block] = np.concatenate(late)
            nb = np.zeros(len(row_block))
            nb[~row_block] = np.array(single["nbytes"], dtype=float)
            out["nbytes"] = nb
        return {c: out[c] for c in COLUMNS}

    def _scan(self) -> tuple:
        """One pass over the log, kept: (latest end per iteration, each GPU's compute
        entries (ComputeRows), the latest end of any row)."""
        if self._scanned is None:
            ends: dict = {}
            per: dict = {}
            for e in self._log:
                if type(e) is Block:
                    acc = e.acc
                    if len(acc) < 2:  # no rows (len(acc): no Python call)
                        continue
                    g, _, it = e.who
                    t = acc[-1]
                else:
                    it, t = e[10], e[7]
                    g = e[0] if e[2] == "compute" else None
                prev = ends.get(it)
                if prev is None or t > prev:
                    ends[it] = t
                if g is not None:
                    mine = per.get(g)
                    if mine is None:
                        mine = per[g] = []
                    mine.append(e)
            end = max(ends.values()) if ends else 0.0
            self._scanned = ({k: float(v) for k, v in ends.items()}, per, float(end))
        return self._scanned

    def iteration_ends(self) -> list[float]:
        """Per iteration present, in order: the latest end of its rows ([0.0] with none),
        as `timeline.groupby("iteration")["end"].max()` gives (a max is exact in any order;
        a block's last instant is its latest end: its durations are not negative)."""
        ends = self._scan()[0]
        return [ends[k] for k in sorted(ends)] if ends else [0.0]

    def compute_rows(self) -> ComputeRows:
        """Each GPU's compute rows, for the memory model (triosim.results.memory). Read once: the
        scan's per-GPU lists go with it (a large run's millions of entries)."""
        ends, per, end = self._scan()
        if per is None:  # read before: scan again
            self._scanned = None
            ends, per, end = self._scan()
        self._scanned = (ends, None, end)
        return ComputeRows(per, end)

    def busy(self, iteration) -> tuple:
        """The compute and communication rows of `iteration`, for the busy-time breakdown:
        (gpu values, start, end, is compute, is communication), a block as one interval
        (its rows touch end to start, so the union of any set of intervals holding them is
        the same set of merged segments with the same ends: the same union lengths)."""
        gpus, start, end, comp = [], [], [], []
        for e in self._log:
            if type(e) is Block:
                if e.who[2] != iteration or len(e.acc) < 2:
                    continue
                if e.starts is not None:  # the stream idled between some rows
                    n = len(e.starts)
                    gpus += [e.who[0]] * n
                    start += e.starts.tolist()
                    end += e.acc[1:].tolist()
                    comp += [True] * n
                    continue
                gpus.append(e.who[0])
                start.append(float(e.acc[0]))
                end.append(float(e.acc[-1]))
                comp.append(True)
            elif e[10] == iteration and e[2] in ("compute", "comm"):
                gpus.append(e[0])
                start.append(e[6])
                end.append(e[7])
                comp.append(e[2] == "compute")
        is_comp = np.array(comp, bool)
        return (gpus, np.array(start, float), np.array(end, float), is_comp, ~is_comp)


class ComputeRows:
    """Per GPU, its compute rows in timeline order, from the log: what the memory model
    reads (op_id, start, end, iteration, microbatch, phase) without the timeline table."""

    def __init__(self, per: dict, end: float):
        self._per = per  # GPU -> its entries
        self.end = end  # the latest end of any row, as timeline["end"].max()
        self._raw: dict = {}  # id(block's acc) -> its instants' bytes (`signature`)

    def signature(self, gpu) -> tuple:
        """Equal for two GPUs whose rows have equal values in those columns, in order (a
        block: the same shared run, iteration and instants; a single row: its values).
        Made when asked for (a run of representatives compares none)."""
        raw, out = self._raw, []
        for e in self._per.get(gpu, ()):
            if type(e) is Block:
                acc = e.acc
                b = raw.get(id(acc))  # ranks in lock step share one array: its bytes once
                if b is None or b[0] is not acc:
                    late = b"" if e.starts is None else e.starts.tobytes()
                    b = raw[id(acc)] = (acc, acc.tobytes() + late)
                out.append((id(e.run), e.who[2], b[1]))
            else:
                out.append((e[11], e[6], e[7], e[10], e[12], e[5]))
        return tuple(out)

    def columns(self, gpu) -> dict:
        """{column: list} of the GPU's rows, ordered by (start, end) where the timeline's
        order is not (several compute streams), as a stable lexsort would order them."""
        op, st, en, its, mb, ph = [], [], [], [], [], []
        for e in self._per.get(gpu, ()):
            if type(e) is Block:
                r, (starts, ends) = e.run, e.instants()
                op += r.op_ids
                mb += r.mbs
                ph += r.phases
                st += starts
                en += ends
                its += [e.who[2]] * len(r)
            else:
                op.append(e[11])
                st.append(e[6])
                en.append(e[7])
                its.append(e[10])
                mb.append(e[12])
                ph.append(e[5])
        out = {"op_id": op, "start": st, "end": en, "iteration": its, "microbatch": mb, "phase": ph}
        order = start_order(np.array(st, float), np.array(en, float))
        if order is not None:
            order = order.tolist()
            out = {c: [v[i] for i in order] for c, v in out.items()}
        return out


def start_order(start: np.ndarray, end: np.ndarray) -> np.ndarray | None:
    """The stable (start, end) order of rows (np.lexsort), or None when they are in it
    already (one compute stream; several interleave)."""
    s, t = start, end
    if ((s[1:] < s[:-1]) | ((s[1:] == s[:-1]) & (t[1:] < t[:-1]))).any():
        return np.lexsort((t, s))
    return None


class _Codes:
    """The distinct values of a column, each with an integer code."""

    def __init__(self):
        self.index: dict = {}  # value -> code
        self.values: list = []

    def codes(self, values) -> np.ndarray:
        """`code` of each of `values` (a list or tuple), without a Python call per value:
        new values are found by one pass in C (dict.fromkeys keeps first appearances, so
        codes are numbered in order of first appearance), then one lookup per value."""
        index, known = self.index, self.values
        for v in dict.fromkeys(values):
            if v not in index:
                index[v] = len(known)
                known.append(v)
        return np.fromiter(map(index.__getitem__, values), np.int32, count=len(values))

    def decode(self, codes: np.ndarray, expand=None):
        """The values of the rows `expand(codes)` (a repeat or a gather of `codes`; None:
        the codes themselves), expanded after mapping codes to values, so that the rows
        (tens of millions at 16,384 GPUs) are written once, not as codes and then as values.
        Numbers take the dtype pandas infers for them; text as a
        pandas Categorical with sorted categories (so sorting the column sorts it as text):
        a small code per row instead of a string (at 16,384 GPUs a string column of 13M
        rows held about 300 MB and took seconds to build). Text with missing values (the
        key column: None on computes) stays a string column, so `fillna("")` works."""
        import pandas as pd

        if expand is None:
            expand = _same
        if not self.values:
            return []
        if None not in self.index and all(type(v) is str for v in self.values):
            cats = sorted(self.values)
            rank = {v: i for i, v in enumerate(cats)}
            remap = np.array([rank[v] for v in self.values], dtype=np.int32)
            return pd.Categorical.from_codes(expand(remap[codes]), categories=cats)
        ref = pd.Series(self.values).array
        if type(ref).__name__ == "ArrowStringArray":
            import pyarrow as pa

            values = pa.array(self.values, type=pa.large_string())
            arr = pa.DictionaryArray.from_arrays(pa.array(expand(codes), pa.int32()), values)
            return pd.array(arr.cast(pa.large_string()), dtype=ref.dtype)
        values = ref.to_numpy()
        if values.dtype.kind in "iufb":
            return expand(values[codes])
        return [self.values[c] for c in expand(codes).tolist()]


def _same(a):
    return a
