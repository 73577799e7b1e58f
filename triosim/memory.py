"""Per-GPU memory over the simulated iteration(s): weights, gradients, optimizer states,
saved activations and communication buffers, and an out-of-memory verdict.

What each GPU holds comes from its parallelism mode (`held_weight_bytes`: DP replicates, TP
shards split layers, a pipeline stage holds its layers; `buffer_bytes`: DDP's bucket
copies). Activations come from the timeline: a batch-scaled tensor (input or activation)
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
(16 bytes with Adam, as ZeRO's 2 + 2 + 12).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

from triosim.errors import ConfigError
from triosim.schema import option

CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "buffers")
STATE_FACTOR = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class MemoryOptions:
    optimizer: Literal["auto", "sgd", "momentum", "adam", "adamw"] = option(
        "auto", help="optimizer whose states are held (auto: from the trace's optimizer "
        "states: 2x the weights is Adam, 1x momentum, none SGD)")  # fmt: skip
    precision: Literal["fp32", "mixed"] = option(
        "fp32", help="fp32, or mixed precision (16-bit weights and gradients, fp32 master "
        "weights and states)")  # fmt: skip
    reserve: float = option(2**30, unit="bytes", ge=0, help="memory not available to tensors "
                            "(CUDA context, allocator fragmentation)")  # fmt: skip
    capacity: float | None = option(None, unit="bytes", gt=0, help="GPU memory (default: the "
                                    "target GPU's from the catalogue)")  # fmt: skip


def optimizer_kind(trace, options: MemoryOptions) -> str:
    if options.optimizer != "auto":
        return options.optimizer
    w = trace.weight_bytes()
    states = math.fsum(t.nbytes for t in trace.tensors.values() if t.category == "optimizer_state")
    ratio = states / w if w else 0.0
    return "adam" if ratio > 1.5 else ("momentum" if ratio > 0.5 else "sgd")


def static_bytes(held_weight_bytes: float, bytes_per_param: float, optimizer: str,
                 precision: str) -> dict:  # fmt: skip
    """Weights, gradients and optimizer states for `held_weight_bytes` of the trace's weights."""
    params = held_weight_bytes / bytes_per_param if bytes_per_param else 0.0
    k = STATE_FACTOR[optimizer]
    if precision == "fp32":
        return {"weights": 4 * params, "gradients": 4 * params, "optimizer_states": 4 * k * params}
    return {"weights": 2 * params, "gradients": 2 * params,
            "optimizer_states": (4 + 4 * k) * params}  # fmt: skip


def _bytes_per_param(trace) -> float:
    """The element size of the trace's weights (by bytes: the dtype most of them have)."""
    from collections import Counter

    from triosim.trace import DTYPE_BYTES

    by_dtype = Counter()
    for t in trace.weights():
        by_dtype[t.dtype] += t.nbytes
    dtype = by_dtype.most_common(1)[0][0] if by_dtype else "float32"
    return float(DTYPE_BYTES.get(dtype, 4))


def static_per_gpu(trace, extrapolator, gpu, options: MemoryOptions) -> dict:
    """Weights, gradients and optimizer states `gpu` holds under its mode's placement."""
    optimizer = optimizer_kind(trace, options)
    bpp = _bytes_per_param(trace)
    shares = extrapolator.state_fractions()
    if shares is None:
        return static_bytes(extrapolator.held_weight_bytes(gpu), bpp, optimizer,
                            options.precision)  # fmt: skip
    full = static_bytes(trace.weight_bytes(), bpp, optimizer, options.precision)
    return {k: v * shares[k] for k, v in full.items()}  # ZeRO: a share of each kind


def memory_timeline(timeline: pd.DataFrame, trace, extrapolator, gpus, options: MemoryOptions):
    """(DataFrame gpu, time, one column per category and total; peak bytes per GPU)."""
    from extrapolators import gradient_ready

    ready = gradient_ready(trace)  # weight -> position of the op after which its grad exists
    ops = trace.operators
    grad_at: dict[int, list[int]] = {}
    for w, pos in ready.items():
        grad_at.setdefault(ops[pos].id, []).append(w)
    by_id = {o.id: o for o in ops}
    scaled = {t.id for t in trace.tensors.values() if t.scales_with_batch}
    compute = timeline[timeline["kind"] == "compute"]
    end = float(timeline["end"].max()) if len(timeline) else 0.0
    frames, peaks = [], {}
    groups = dict(tuple(compute.groupby("gpu", sort=False)))
    for g in gpus:
        rows = groups.get(g, compute.iloc[:0]).sort_values(["start", "end"], kind="stable")
        static = static_per_gpu(trace, extrapolator, g, options)
        times, deltas = [0.0], [np.zeros(len(CATEGORIES))]
        base = np.array([static["weights"], 0.0, static["optimizer_states"], 0.0,
                         extrapolator.buffer_bytes(g)])  # fmt: skip
        deltas[0] = base
        _activations(rows, by_id, scaled, trace, extrapolator, times, deltas)
        _gradients(rows, by_id, grad_at, trace, static["gradients"], times, deltas)
        times.append(end)  # the state after the last change, drawn to the end of the run
        deltas.append(np.zeros(len(CATEGORIES)))
        t = np.array(times)
        d = np.vstack(deltas)
        order = np.argsort(t, kind="stable")
        t, d = t[order], np.cumsum(d[order], axis=0)
        # one row per instant: the state after every change at that instant
        last = np.r_[t[1:] != t[:-1], True]
        df = pd.DataFrame(d[last], columns=list(CATEGORIES))
        df.insert(0, "time", t[last])
        df.insert(0, "gpu", g)
        df["total"] = df[list(CATEGORIES)].sum(axis=1)
        frames.append(df)
        peaks[g] = float(df["total"].max())
    return pd.concat(frames, ignore_index=True), peaks


def _activations(rows, by_id, scaled, trace, ex, times, deltas):
    """Batch-scaled tensors: alive from the first op on this GPU that touches them to the
    end of the last op on this GPU that reads them, per (iteration, micro-batch). Tensors a
    recomputed forward op writes are a second copy (pass 1): the first forward's copy lives
    only until its last forward reader, and backward reads the recomputed one."""
    first: dict = {}
    last: dict = {}
    size: dict = {}
    for r in rows.itertuples(index=False):
        op = by_id.get(r.op_id)
        if op is None:
            continue
        ratio = ex.activation_ratio(op)
        again = r.phase == "recompute"
        for t in op.outputs + op.inputs:
            if t not in scaled:
                continue
            key = (t, r.iteration, r.microbatch, 1)
            if not (again and t in op.outputs) and key not in first:
                key = key[:3] + (0,)  # the first forward's copy, or one never recomputed
            if key not in first:
                first[key] = r.start
                size[key] = trace.tensors[t].nbytes * ratio
            last[key] = max(last.get(key, r.end), r.end)
    k = CATEGORIES.index("activations")
    for key, t0 in first.items():
        up, down = np.zeros(len(CATEGORIES)), np.zeros(len(CATEGORIES))
        up[k], down[k] = size[key], -size[key]
        times += [t0, last[key]]
        deltas += [up, down]


def _gradients(rows, by_id, grad_at, trace, total, times, deltas):
    """This GPU's gradient bytes appear as its backward ops produce them (in proportion to
    the weights whose gradient each op completes) and go after its optimizer step."""
    made = [(r.end, r.iteration, sum(trace.tensors[w].nbytes for w in grad_at.get(r.op_id, ())))
            for r in rows.itertuples(index=False) if r.op_id in grad_at]  # fmt: skip
    k = CATEGORIES.index("gradients")
    per_iter: dict = {}
    for end, it, nbytes in made:
        per_iter.setdefault(it, []).append((end, nbytes))
    opt_end = rows[rows["phase"] == "optimizer"].groupby("iteration")["end"].max().to_dict()
    for it, items in per_iter.items():
        weight = sum(n for _, n in items)
        if not weight:
            continue
        for end, nbytes in items:
            v = np.zeros(len(CATEGORIES))
            v[k] = total * nbytes / weight
            times.append(end)
            deltas.append(v)
        free = opt_end.get(it)
        if free is not None:
            v = np.zeros(len(CATEGORIES))
            v[k] = -total
            times.append(free)
            deltas.append(v)


def capacity(options: MemoryOptions, gpu_name: str | None) -> float | None:
    """Bytes the GPU offers, or None when the GPU is not in the catalogue (a CPU trace)."""
    if options.capacity is not None:
        return options.capacity
    if not gpu_name:
        return None
    from triosim import hardware

    try:
        return hardware.gpu(gpu_name).memory_capacity
    except ConfigError:
        return None
