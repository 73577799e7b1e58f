"""Per-GPU memory over the simulated iteration(s): weights, gradients, optimizer states,
saved activations and communication buffers, and an out-of-memory verdict.

What each GPU holds comes from its parallelism mode (`held_weight_bytes`: DP replicates, TP
shards split layers, a pipeline stage holds its layers; `buffer_bytes`: DDP's bucket
copies), and, with the buffers all run long, PyTorch's cuBLAS workspaces
(`MemoryOptions.workspace`, resolved for the run's GPU by triosim.results.workspaces). Activations come from the timeline: a batch-scaled tensor (input or activation)
is allocated when the first operator on that GPU that writes or reads it starts (forward
outputs, received pipeline activations) and freed when the last operator on that GPU that
reads it ends (backward operators read what forward saved), separately per micro-batch
and iteration. Sizes are the trace's at this GPU's batch (per micro-batch for pipelines)
and TP shard. Gradients appear as backward produces them and are freed after the optimizer
step (`zero_grad(set_to_none=True)`, PyTorch's default).

Optimizer states and precision follow ZeRO's accounting (Rajbhandari et al., SC'20,
section 3.1): fp32 training holds 4 (weights) + 4 (gradients) + 4k bytes per parameter,
k = 2 for Adam/AdamW, 1 for SGD with momentum, 0 for plain SGD (16 bytes with Adam); mixed
precision holds 2 (bf16/fp16 weights) + 2 (gradients) + 4 (fp32 master weights) + 4k
(16 bytes with Adam, as ZeRO's 2 + 2 + 12). `memory.precision: auto` (the default) takes
the run's `precision` section as the layout holds it (`held_dtypes` of the mode): 16-bit
weights held whole (Megatron's --bf16 module weights, with or without its distributed
optimizer) are 2 bytes, their gradients the reduce dtype's (float32: 4) and a float32 main
copy kept with the optimizer states (Megatron's docs/source/api-guide/dist_optimizer.md:
"bf16 param, fp32 grads" 18 bytes, 6 + 12/d with the distributed optimizer over d GPUs);
FSDP keeps its shards as stored, so `auto` is fp32 there and without a precision section.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from itertools import repeat
from typing import Literal

import numpy as np
import pandas as pd

from triosim.common.errors import ConfigError
from triosim.common.schema import option
from triosim.trace.model import BATCH_SCALED

CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "buffers")
STATE_FACTOR = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class MemoryOptions:
    optimizer: Literal["auto", "sgd", "momentum", "adam", "adamw"] = option(
        "auto",
        help="optimizer whose states are held (auto: from the trace's optimizer "
        "states: 2x the weights is Adam, 1x momentum, none SGD)",
    )
    precision: Literal["auto", "fp32", "mixed"] = option(
        "auto",
        help="fp32; mixed precision (ZeRO's: 16-bit weights and gradients, fp32 master "
        "weights and states); auto: as the layout holds the weights at the `precision` "
        "section's dtypes (Megatron's 16-bit weights: 2 bytes, gradients in the reduce "
        "dtype, an fp32 main copy with the states), else fp32",
    )
    reserve: float = option(
        2**30,
        unit="bytes",
        ge=0,
        help="memory not available to tensors (CUDA context, allocator fragmentation)",
    )
    capacity: float | None = option(
        None, unit="bytes", gt=0, help="GPU memory (default: the target GPU's from the catalogue)"
    )
    activations: Literal["trace", "fused"] = option(
        "trace",
        help="trace: what the traced run's backward reads (an eager trace: autograd's saves "
        "per small operator); fused: what fused kernels keep (TransformerEngine, Megatron: "
        "an element-wise chain its inputs, no copies for data movement; "
        "triosim/results/fused_saves.py)",
    )
    workspace: float | None = option(
        None,
        unit="bytes",
        ge=0,
        help="library workspaces each GPU holds, counted with the buffers (default: PyTorch's "
        "two cuBLAS workspaces for the run's GPU, 64 MiB on Hopper, 16.25 MiB elsewhere; 0 "
        "when the run names no GPU; triosim.results.workspaces)",
    )


def optimizer_kind(trace, options: MemoryOptions) -> str:
    if options.optimizer != "auto":
        return options.optimizer
    w = trace.weight_bytes()
    states = math.fsum(t.nbytes for t in trace.tensors.values() if t.category == "optimizer_state")
    ratio = states / w if w else 0.0
    return "adam" if ratio > 1.5 else ("momentum" if ratio > 0.5 else "sgd")


# bytes per parameter: weights, gradients, a float32 master copy (with the optimizer states)
ACCOUNTING = {"fp32": (4, 4, 0), "mixed": (2, 2, 4)}


def accounting(options: MemoryOptions, extrapolator=None, stored: float = 4.0) -> tuple:
    """(weights, gradients, master) bytes per parameter (module docstring): the named
    accounting, or for `auto` the layout's (`extrapolator.held_dtypes()`: the dtypes it
    holds 16-bit weights and their gradients in, "trace" for the `stored` bytes; None
    where it keeps them as stored)."""
    if options.precision != "auto":
        return ACCOUNTING[options.precision]
    held = extrapolator.held_dtypes() if extrapolator is not None else None
    if held is None:
        return ACCOUNTING["fp32"]
    from triosim.trace.model import DTYPE_BYTES

    weights, grads = held
    return (DTYPE_BYTES[weights], stored if grads == "trace" else DTYPE_BYTES[grads], 4)


def static_bytes(
    held_weight_bytes: float, bytes_per_param: float, optimizer: str, precision
) -> dict:
    """Weights, gradients and optimizer states for `held_weight_bytes` of the trace's weights
    at `precision`: a name in ACCOUNTING or (weights, gradients, master) bytes per parameter."""
    params = held_weight_bytes / bytes_per_param if bytes_per_param else 0.0
    k = STATE_FACTOR[optimizer]
    w, g, master = ACCOUNTING[precision] if isinstance(precision, str) else precision
    return {
        "weights": w * params,
        "gradients": g * params,
        "optimizer_states": (master + 4 * k) * params,
    }


def _bytes_per_param(trace) -> float:
    """The element size of the trace's weights (by bytes: the dtype most of them have)."""
    from collections import Counter

    from triosim.trace.model import DTYPE_BYTES

    by_dtype = Counter()
    for t in trace.weights():
        by_dtype[t.dtype] += t.nbytes
    dtype = by_dtype.most_common(1)[0][0] if by_dtype else "float32"
    return float(DTYPE_BYTES.get(dtype, 4))


def static_per_gpu(trace, extrapolator, gpu, options: MemoryOptions, _kind=None) -> dict:
    """Weights, gradients and optimizer states `gpu` holds under its mode's placement
    (`_kind`: (optimizer, bytes per parameter) when the caller has them already)."""
    optimizer, bpp = _kind or (optimizer_kind(trace, options), _bytes_per_param(trace))
    how = accounting(options, extrapolator, bpp)
    shares = extrapolator.state_fractions_of(gpu)
    if shares is None:
        return static_bytes(extrapolator.held_weight_bytes(gpu), bpp, optimizer, how)
    full = static_bytes(trace.weight_bytes(), bpp, optimizer, how)
    return {k: v * shares[k] for k, v in full.items()}  # ZeRO: a share of each kind


def model_state_bytes(trace, options: MemoryOptions, extrapolator=None) -> float:
    """Weights and optimizer states of one copy of the model at the memory options'
    precision (`auto`: as `extrapolator` holds them) and optimizer: what a checkpoint
    writes (replicas hold copies of the same bytes; sharded ones together hold one)."""
    bpp = _bytes_per_param(trace)
    full = static_bytes(
        trace.weight_bytes(),
        bpp,
        optimizer_kind(trace, options),
        accounting(options, extrapolator, bpp),
    )
    return full["weights"] + full["optimizer_states"]


def memory_timeline(
    timeline: pd.DataFrame, trace, extrapolator, gpus, options: MemoryOptions, share: bool = True
):
    """(DataFrame gpu, time, one column per category and total; peak bytes per GPU).

    With `share`, GPUs whose compute rows and static bytes are identical (data-parallel
    replicas) get the first one's curve instead of computing it again: the same numbers,
    since the curve is a function of exactly those inputs."""
    curves, peaks = memory_curves(timeline, trace, extrapolator, gpus, options, share)
    return curves.frame(), peaks


class MemoryCurves:
    """Each GPU's memory curve, identical curves held once; `frame()` builds the table
    (one row per GPU and instant) when asked for: at 16,384 data-parallel GPUs that table
    is 9M rows (about 600 MB) of copies of one curve."""

    def __init__(self, gpus, times: list, states: list):
        self.gpus = list(gpus)
        self.times, self.states = times, states  # per GPU; shared curves are one object

    def __len__(self) -> int:
        return sum(len(t) for t in self.times)

    def expanded(self, gpus, rep_of: dict) -> MemoryCurves:
        """The curves of `gpus`, each its representative's (rep_of[g], one of ours)."""
        at = {g: i for i, g in enumerate(self.gpus)}
        which = [at[rep_of[g]] for g in gpus]
        return MemoryCurves(gpus, [self.times[i] for i in which], [self.states[i] for i in which])

    def peaks(self) -> dict:
        done: dict = {}  # id(curve) -> peak
        out = {}
        for g, d in zip(self.gpus, self.states, strict=True):
            p = done.get(id(d))
            if p is None:
                p = done[id(d)] = float(d.sum(axis=1).max())
            out[g] = p
        return out

    def frame(self) -> pd.DataFrame:
        cols = list(CATEGORIES)
        if not self.gpus:
            return pd.DataFrame(columns=["gpu", "time", *cols, "total"])
        df = pd.DataFrame(np.vstack(self.states), columns=cols)
        df.insert(0, "time", np.concatenate(self.times))
        # the gpu column from each GPU's row count (the dtype inferred from the distinct
        # GPUs, which decide it, instead of from one Python object per row)
        sizes = [len(x) for x in self.times]
        distinct = np.empty(len(self.gpus), dtype=object)
        for i, g in enumerate(self.gpus):  # element by element: a GPU may be a tuple
            distinct[i] = g
        df.insert(0, "gpu", np.repeat(_gpu_values(distinct), sizes))
        df["total"] = df[cols].sum(axis=1)
        return df


def memory_curves(timeline, trace, extrapolator, gpus, options: MemoryOptions, share: bool = True):
    """(MemoryCurves, peak bytes per GPU): `memory_timeline` without building the table.
    Every GPU holds `options.workspace` bytes of library workspaces throughout, with its
    buffers (None: 0 here; the Simulation resolves it for its GPU before the run:
    triosim.results.workspaces.library_bytes).
    `timeline`: the table, or the runtime's log (extrapolators.execution.timeline_log.TimelineLog),
    read without building the table (the same rows, hence the same curves). A run without
    a trace (`triosim.trace.model.no_trace()`), or whose mode runs none of the trace's
    operators (a Chakra workload: `uses_trace` False), has no tensors to hold: (None, None),
    the memory unknown, not zero."""
    from extrapolators.execution.timeline_log import TimelineLog

    if trace.metadata.get("no_trace") or not getattr(extrapolator, "uses_trace", True):
        return None, None
    from extrapolators.modes import gradient_ready

    ready = gradient_ready(trace)  # weight -> position of the op after which its grad exists
    ops = trace.operators
    grad_at: dict[int, list[int]] = {}
    for w, pos in ready.items():
        grad_at.setdefault(ops[pos].id, []).append(w)
    plan = activation_plan(trace, extrapolator, options.activations == "fused")
    columns = _plan_items(plan) if plan else None  # (the same for every GPU's curve)
    grad_bytes = {i: sum(trace.tensors[w].nbytes for w in ws) for i, ws in grad_at.items()}
    rows = timeline.compute_rows() if isinstance(timeline, TimelineLog) else _FrameRows(timeline)
    end = rows.end
    time_col, state_col = [], []
    kind = (optimizer_kind(trace, options), _bytes_per_param(trace))
    library = float(options.workspace or 0.0)
    seen: dict = {}  # inputs of a GPU's curve -> (times, states)
    for g in gpus:
        static = static_per_gpu(trace, extrapolator, g, options, kind)
        buffers = extrapolator.buffer_bytes(g) + library
        sig = None
        if share:
            sig = (tuple(static.values()), buffers, rows.signature(g))
            if sig in seen:
                t_last, d_last = seen[sig]
                time_col.append(t_last)
                state_col.append(d_last)
                continue
        cols_of = rows.columns(g)
        # changes as (time, category, bytes), in arrays; row 0 is the static state at 0
        times, cats, values = [np.zeros(1)], [], []
        _activations(cols_of, plan, times, cats, values, columns)
        _gradients(cols_of, grad_bytes, static["gradients"], times, cats, values)
        times.append(np.array([end]))  # the state after the last change, to the run's end
        t = np.concatenate(times)
        d = np.zeros((len(t), len(CATEGORIES)))
        d[0] = [static["weights"], 0.0, static["optimizer_states"], 0.0, buffers]
        if cats:
            cats = np.concatenate(cats)
            d[np.arange(1, len(cats) + 1), cats] = np.concatenate(values)
        order = np.argsort(t, kind="stable")
        t, d = t[order], np.cumsum(d[order], axis=0)
        # one row per instant: the state after every change at that instant
        last = np.r_[t[1:] != t[:-1], True]
        time_col.append(t[last])
        state_col.append(d[last])
        if sig is not None:
            seen[sig] = (time_col[-1], state_col[-1])
    curves = MemoryCurves(gpus, time_col, state_col)
    return curves, curves.peaks()


class _FrameRows:
    """Each GPU's compute rows from a timeline table (TimelineLog.compute_rows's twin)."""

    def __init__(self, timeline: pd.DataFrame):
        # numpy columns of the compute rows (a pandas row selection copies every column)
        mask = (timeline["kind"] == "compute").to_numpy(bool)
        self.end = float(timeline["end"].max()) if len(timeline) else 0.0
        # the rows of each GPU in the order a stable sort of its rows by (start, end) gives:
        # a stable sort by GPU keeps each GPU's rows in timeline order, which is already by
        # (start, end) for a single compute stream; a GPU's rows that are not are sorted in
        # `_rows` (the same order as one lexsort by (gpu, start, end)). Small integer types
        # and early deletes: these arrays have a row per task, millions at 16,384 GPUs
        codes, uniques = pd.factorize(timeline["gpu"].to_numpy()[mask], sort=False)
        codes = codes.astype(np.int16 if len(uniques) < 2**15 else np.int32)
        order = np.argsort(codes, kind="stable")
        self._cuts = np.searchsorted(codes[order], np.arange(len(uniques) + 1))
        del codes
        self._idx = np.flatnonzero(mask)[order]  # timeline rows, GPU by GPU
        del order, mask
        # whole columns without copies; each GPU gathers its own rows
        self._col = {
            c: timeline[c].to_numpy() for c in ("op_id", "start", "end", "iteration", "microbatch")
        }
        phase = timeline["phase"]
        if isinstance(phase.dtype, pd.CategoricalDtype):
            self._phase, phases = phase.cat.codes.to_numpy(), phase.cat.categories
        else:
            self._phase, phases = pd.factorize(phase, use_na_sentinel=False)
        self._phases = np.asarray(phases, dtype=object)
        self._where = {g: k for k, g in enumerate(uniques)}
        self._last = (None, None)

    def _rows(self, g) -> np.ndarray:
        """g's rows in (start, end) order (kept for the next call: `signature` and then
        `columns` ask for the same GPU)."""
        from extrapolators.execution.timeline_log import start_order

        if self._last[0] == g and self._last[1] is not None:
            return self._last[1]
        k = self._where.get(g)
        rows = (
            self._idx[:0] if k is None else self._idx[int(self._cuts[k]) : int(self._cuts[k + 1])]
        )
        order = start_order(self._col["start"][rows], self._col["end"][rows])
        if order is not None:
            rows = rows[order]
        self._last = (g, rows)
        return rows

    def signature(self, g) -> tuple:
        rows = self._rows(g)
        return (
            self._phase[rows].tobytes(),
            *(np.asarray(self._col[c][rows]).tobytes() for c in self._col),
        )

    def columns(self, g) -> dict:
        rows = self._rows(g)
        out = {c: v[rows].tolist() for c, v in self._col.items()}
        for c in ("op_id", "microbatch"):  # a missing value (NaN in a float column) is the
            # task's None, as the log gives it: NaN != NaN made each row its own micro-batch
            out[c] = [None if x != x else x for x in out[c]]
        out["phase"] = self._phases[self._phase[rows]].tolist()
        return out


def _gpu_values(values: np.ndarray):
    """The gpu column with the dtype pandas would infer for it (ints stay ints)."""
    return pd.Series(list(values)).to_numpy() if len(values) else values


def activation_plan(trace, extrapolator, fused: bool = False) -> dict:
    """Per operator, once for all GPUs: (allocations it touches, ratio). An allocation is
    a storage (a tensor and its views are one) of batch-scaled tensors, as (key, bytes,
    is an output, born-at op id or None, held, read by the op, late: a weight's gradient
    that a split backward's W part makes, born with the op's last run;
    extrapolators.modes.wgrad). Two rules make it PyTorch's:
    - a tensor a backward op reads that no earlier op wrote was made inside a forward op
      (cross_entropy saves its log_softmax output, max_pool2d its indices): it is born
      when the backward op's paired forward op (fwd_id) starts, else when it is first
      touched. Real and shape-only traces alike: a shape-only trace names only the tensors
      its operators read and return (tracer.meta_trace drops what ran below the dispatch
      mode), so what a backward op reads first there is what autograd saved, as in a real
      trace (docs/memory.md lists them for every shipped model);
    - the model's output, which the loss reads, stays alive to the end of its iteration
      and micro-batch: the training loop holds it (`out = model(x)`) until the step ends.
    """
    tensors = trace.tensors
    scaled = {t.id for t in tensors.values() if t.scales_with_batch}
    reads, moved = {}, {}
    if fused:  # what the backward operators read when fused kernels ran them
        from triosim.results.fused_saves import fused_reads, moved_from

        reads, moved = fused_reads(trace), moved_from(trace)

    def key(t):
        # a storage per dtype: the tracer joins a cast's output to its input's storage
        # (`aten::to`'s schema says it may alias, which it does only when the dtype is
        # already right), but a float32 copy of a bfloat16 tensor is new memory
        x = tensors[moved.get(t, t)]
        return ("s", x.storage, x.dtype) if x.storage is not None else ("t", x.id)

    # a storage that holds a weight, a weight's cast (a buffer), a gradient or a state is no
    # activation, whatever a view of it is labelled: the tracer labels what a backward
    # operator returns "activation", and a product's backward returns a view of the weight
    # it saved (counted as a second copy of the weight while the operator ran; with a split
    # backward, from its B part to its W part)
    kept = {
        ("s", x.storage, x.dtype)
        for x in tensors.values()
        if x.storage is not None and x.category not in BATCH_SCALED
    }
    key_of = {t: key(t) for t in scaled}  # (asked for per operator that touches it)
    scaled = {t for t in scaled if key_of[t] not in kept}

    size: dict = {}
    for t in scaled:
        if t in moved:  # (fused: no memory of its own)
            continue
        k = key_of[t]
        size[k] = max(size.get(k, 0.0), tensors[t].nbytes)
    seen: set = set()
    born: dict = {}  # storage -> forward op id it was made in
    made_before_loss: set = set()
    held: set = set()
    for o in trace.operators:
        for t in reads.get(o.id, o.inputs):
            if t in scaled:
                k = key_of[t]
                if k not in seen and o.phase == "backward":
                    born[k] = o.fwd_id
                if o.layer == "loss" and o.phase == "forward" and k in made_before_loss:
                    held.add(k)
                seen.add(k)
        for t in o.outputs:
            if t in scaled:
                k = key_of[t]
                seen.add(k)
                if o.phase == "forward" and o.layer != "loss":
                    made_before_loss.add(k)
    from extrapolators.modes.wgrad import weight_grad_outputs

    late = {key_of[t] for t in weight_grad_outputs(trace) if t in scaled}
    plan = {}
    for o in trace.operators:
        items, done = [], set()
        # an output in the storage of an input (a view, an in-place op) is no new
        # allocation where it is recomputed: a recomputed view of a saved tensor is it
        ins = reads.get(o.id, o.inputs)
        read = {key_of[t] for t in ins if t in scaled}
        for t, is_out in [(t, True) for t in o.outputs] + [(t, False) for t in ins]:
            if t not in scaled or (k := key_of[t]) in done:
                continue
            done.add(k)
            items.append((k, size[k], is_out, born.get(k), k in held, k in read, k in late))
        if items:
            plan[o.id] = (items, extrapolator.activation_ratio(o))
    return plan


def _activations(r, plan, times, cats, values, columns=None):
    """Batch-scaled allocations: alive from the first op on this GPU that touches them (or
    the forward op they were made in) to the end of the last op on this GPU that reads
    them (the end of the iteration and micro-batch for the held model output), per
    (iteration, micro-batch). Allocations a recomputed forward op writes are a second copy
    (pass 1): the first forward's copy lives only until its last forward reader, and
    backward reads the recomputed one; one a recomputed op saved inside itself is born
    with the recomputation. A weight's gradient a split backward makes (`late`) is born
    with the op's last run (its W part), not its first (its B part).

    In arrays, row by row as one pass would take them: every (row, allocation it touches)
    pair in row order; a pair's slot is (allocation, iteration, micro-batch) and its copy
    the recomputed one from the slot's first pair where a recomputed op writes it; a copy
    starts at its first pair's row (or its maker's first run there, or its last run for a
    late gradient) and ends at its pairs' last end; copies are added in the order of their
    first pairs (the curve sums equal instants in that order). `columns`: `_plan_items`
    of `plan`, made once for every GPU's curve (else made here). The changes go into
    `times`, `cats` (category index) and `values` (bytes, + allocated, - freed) as one
    array each appended to those lists."""
    ops = r["op_id"]
    n = len(ops)
    if not n or not plan:
        return
    pos, first_item, count, item_cols = columns or _plan_items(plan)
    # (per row through map: a generator's frame per row was most of a large run's curves)
    pidx = np.fromiter(map(pos.get, ops, repeat(-1, n)), np.int64, count=n)
    sel = np.flatnonzero(pidx >= 0)
    if not len(sel):
        return
    code = _first_seen(ops)  # op id -> int (rows' ops, in the order they first ran)
    oc = np.fromiter(map(code.__getitem__, ops), np.int64, count=n)
    start = np.asarray(r["start"], float)
    stop = np.asarray(r["end"], float)
    it, mb = _codes(r["iteration"], n), _codes(r["microbatch"], n)
    redo = np.fromiter(map(operator.eq, r["phase"], repeat("recompute", n)), bool, count=n)
    span_it, span_mb = int(it.max()) + 1, int(mb.max()) + 1
    im = it * span_mb + mb  # (iteration, micro-batch)
    run = oc * (span_it * span_mb) + im  # (op, iteration, micro-batch)
    k_of, nb_of, out_of, born_of, held_of, alias_of, late_of = item_cols
    # the pairs, in row order and each row's items in plan order
    cnt = count[pidx[sel]]
    prow = np.repeat(sel, cnt)
    pitem = np.repeat(first_item[pidx[sel]], cnt) + (
        np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    )
    _, slot = np.unique(k_of[pitem] * (span_it * span_mb) + im[prow], return_inverse=True)
    slot = slot.reshape(-1)
    # each slot's recomputed copy starts at its first pair where a recomputed op writes it
    trig = np.flatnonzero(redo[prow] & out_of[pitem] & ~alias_of[pitem])
    first_trig = np.full(int(slot.max()) + 1, len(prow))
    ts, ti = np.unique(slot[trig], return_index=True)
    first_trig[ts] = trig[ti]
    rec = slot * 2 + (np.arange(len(prow)) >= first_trig[slot])
    _, made, rinv = np.unique(rec, return_index=True, return_inverse=True)
    rinv = rinv.reshape(-1)
    t1 = np.full(len(made), -np.inf)
    np.maximum.at(t1, rinv, stop[prow])
    order = np.argsort(made, kind="stable")  # copies in the order they were made
    made, t1 = made[order], t1[order]
    row0, item0 = prow[made], pitem[made]
    t0 = start[row0].copy()
    # what a recomputed op saved inside itself is born with its maker's recomputation,
    # else its maker's first run, where these ran by then
    inside = np.flatnonzero((born_of[item0] >= 0) & ~out_of[item0])
    if len(inside):
        born = born_of[item0[inside]]
        rows_in = row0[inside]
        b = np.full(len(inside), -1, np.int64)
        known = np.fromiter((code.get(x, -1) for x in born.tolist()), np.int64, len(born))
        ok = known >= 0
        b[ok] = known[ok] * (span_it * span_mb) + im[rows_in[ok]]
        t0[inside] = _first_start(b, rows_in, run, start, np.arange(n), t0[inside])
        t0[inside] = _first_start(b, rows_in, run, start, np.flatnonzero(redo), t0[inside])
    held = np.flatnonzero(held_of[item0])
    if len(held):  # the model output: to the end of its iteration and micro-batch
        ends = np.full(span_it * span_mb, -np.inf)
        np.maximum.at(ends, im, stop)
        t1[held] = np.maximum(t1[held], ends[im[row0[held]]])
    late = np.flatnonzero(late_of[item0] & out_of[item0])
    if len(late):  # born with the last run of the op that makes it
        w_rows = prow[late_of[pitem] & out_of[pitem]]
        last = {}
        for x, y in zip(run[w_rows].tolist(), w_rows.tolist(), strict=True):
            last[x] = y
        t0[late] = start[[last[x] for x in run[row0[late]].tolist()]]
    nbytes = nb_of[item0]
    times.append(np.column_stack([t0, t1]).ravel())
    cats.append(np.full(2 * len(t0), CATEGORIES.index("activations")))
    values.append(np.column_stack([nbytes, -nbytes]).ravel())


def _codes(values, n: int) -> np.ndarray:
    """Each value's int code, equal where the values are equal as dict keys (a task's
    micro-batch None is its own, 0 and 0.0 one)."""
    return np.fromiter(map(_first_seen(values).__getitem__, values), np.int64, count=n)


def _first_seen(values) -> dict:
    """Each distinct value (as a dict key) -> its number in the order values first show it."""
    return {x: i for i, x in enumerate(dict.fromkeys(values))}


def _first_start(b, rows_at, run, start, rows, fallback):
    """Per lookup j: the start of run b[j]'s first row among `rows` if that row comes at
    or before row rows_at[j] (it has run by then), else fallback[j]."""
    out = fallback.copy()
    if not len(rows):
        return out
    codes, first = np.unique(run[rows], return_index=True)
    at = np.searchsorted(codes, b)
    at_ok = at < len(codes)
    hit = np.zeros(len(b), bool)
    hit[at_ok] = (codes[at[at_ok]] == b[at_ok]) & (b[at_ok] >= 0)
    r0 = np.where(hit, rows[first[np.minimum(at, len(codes) - 1)]], 0)
    ran = hit & (r0 <= rows_at)
    out[ran] = start[r0[ran]]
    return out


def _plan_items(plan) -> tuple:
    """The plan's items as columns (allocation key as an int, bytes x ratio, is an
    output, maker op id or -1, held, read by the op, late), with each op's position in the
    plan and its items' first and count."""
    keys: dict = {}
    first, count = [], []
    cols: tuple = ([], [], [], [], [], [], [])
    for items, ratio in plan.values():
        first.append(len(cols[0]))
        count.append(len(items))
        for k, nbytes, is_out, born_in, is_held, aliased, w_made in items:
            cols[0].append(keys.setdefault(k, len(keys)))
            cols[1].append(nbytes * ratio)
            cols[2].append(is_out)
            cols[3].append(-1 if born_in is None else born_in)
            cols[4].append(is_held)
            cols[5].append(aliased)
            cols[6].append(w_made)
    kinds = (np.int64, float, bool, np.int64, bool, bool, bool)
    arrays = tuple(np.array(c, t) for c, t in zip(cols, kinds, strict=True))
    pos = {o: i for i, o in enumerate(plan)}
    return pos, np.array(first, np.int64), np.array(count, np.int64), arrays


def _gradients(r, grad_bytes, total, times, cats, values):
    """This GPU's gradient bytes appear as its backward ops produce them (in proportion to
    the weights whose gradient each op completes) and go after its optimizer step: one
    array each appended to `times`, `cats` and `values` (lists of arrays, as in
    `_activations`)."""
    k = CATEGORIES.index("gradients")
    per_iter: dict = {}
    opt_end: dict = {}
    ops, ends, its, n = r["op_id"], r["end"], r["iteration"], len(r["op_id"])
    # the rows that complete gradients and the optimizer's, found through map (no
    # Python frame per row), then taken in row order
    grads = np.fromiter(map(grad_bytes.__contains__, ops), bool, count=n)
    for i in np.flatnonzero(grads).tolist():
        per_iter.setdefault(its[i], []).append((ends[i], grad_bytes[ops[i]]))
    opt = np.fromiter(map(operator.eq, r["phase"], repeat("optimizer", n)), bool, count=n)
    for i in np.flatnonzero(opt).tolist():
        it, stop = its[i], ends[i]
        opt_end[it] = stop if it not in opt_end else max(opt_end[it], stop)
    at, change = [], []
    for it, items in per_iter.items():
        weight = sum(nbytes for _, nbytes in items)
        if not weight:
            continue
        for stop, nbytes in items:
            at.append(stop)
            change.append(total * nbytes / weight)
        free = opt_end.get(it)
        if free is not None:
            at.append(free)
            change.append(-total)
    times.append(np.array(at, float))
    cats.append(np.full(len(at), k))
    values.append(np.array(change, float))


def capacity(options: MemoryOptions, gpu_name: str | None) -> float | None:
    """Bytes the GPU offers, or None when the GPU is not in the catalogue (a CPU trace)."""
    if options.capacity is not None:
        return options.capacity
    if not gpu_name:
        return None
    from triosim.hardware import catalogue as hardware

    try:
        return hardware.gpu(gpu_name).memory_capacity
    except ConfigError:
        return None


def check_capacity(options: MemoryOptions, gpu_name: str | None) -> None:
    """Refuse a capacity no GPU has (a bare number is bytes: `capacity: 80` is 80 bytes, not
    80 GB) and a reserve that leaves nothing for tensors, before anything runs."""
    if options.capacity is not None and options.capacity < 2**20:
        raise ConfigError(
            "memory.capacity",
            options.capacity,
            "at least 1 MiB (a bare number is bytes; write a unit, e.g. '80 GB')",
        )
    cap = capacity(options, gpu_name)
    if cap is not None and options.reserve >= cap:
        raise ConfigError(
            "memory.reserve",
            options.reserve,
            f"less than the GPU's memory "
            f"({cap:.6g} bytes{'' if options.capacity else ', ' + str(gpu_name)}): "
            "nothing would be left for tensors",
        )
