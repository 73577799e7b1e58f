"""Extrapolate a trace of k identical layers to a model of L layers.

A transformer's decoder layers are identical, so a trace of its first k layers at full
width holds everything a trace of all L would, k at a time. `replicate` copies the
operators and tensors of layers 0..k-1 (L/k - 1 times, with new ids, parameter names and
layer names k, 2k, ... further on): forward copies go after the traced layers, backward
copies before them (backward runs the layers in reverse), per-parameter optimizer operators
after the traced layers' ones. The embedding, the head and the loss stay once. The copies are
chained: copy c reads copy c-1's output and its backward reads copy c+1's input gradient;
the head reads the last copy's output. An optimizer operator over tensor lists (foreach)
gets the copies' weights, gradients and states added to its lists, and its FLOPs (and time)
grow with the bytes of its lists.

Pure Python on the trace: no PyTorch needed.
"""

from __future__ import annotations

import math
import re

from triosim.common.errors import TracerError
from triosim.trace.flops import forward_flops
from triosim.trace.model import Operator, Tensor, Trace


def _index(name: str, prefix: str) -> int | None:
    """The layer number of a module path or parameter name under `prefix` ("layers.3.x" ->
    3), or None."""
    m = re.match(rf"^{re.escape(prefix)}\.(\d+)(?:\.|$)", name or "")
    return int(m.group(1)) if m else None


def _rename(name: str | None, prefix: str, shift: int) -> str | None:
    if name is None:
        return None
    i = _index(name, prefix)
    if i is None:
        return name
    return re.sub(rf"^{re.escape(prefix)}\.\d+", f"{prefix}.{i + shift}", name, count=1)


def replicate(trace: Trace, prefix: str, traced: int, total: int) -> Trace:
    """A new trace of `total` layers from `trace`, which has layers prefix.0 .. prefix.(traced-1)
    of a model whose layers are identical. `total` must be a multiple of `traced`."""
    if traced < 1 or total < traced or total % traced:
        raise TracerError(
            f"cannot replicate {traced} traced layers to {total}: the model's "
            "layer count must be a multiple of the traced one"
        )
    copies = total // traced
    ops = trace.operators
    tensors = trace.tensors
    layer_of = {o.id: _index(o.layer, prefix) for o in ops}
    seen_layers = {i for i in layer_of.values() if i is not None}
    if seen_layers != set(range(traced)):
        raise TracerError(
            f"the trace's layers under '{prefix}' are {sorted(seen_layers)}; "
            f"expected 0..{traced - 1}"
        )
    if copies == 1:
        return trace

    # -- which tensors belong to the traced layers ---------------------------------------------
    producer: dict[int, Operator] = {}
    for o in ops:
        for t in o.outputs:
            if t not in o.inputs:
                producer.setdefault(t, o)
    in_block = {o.id for o in ops if layer_of[o.id] is not None}
    named_block = {t.id for t in tensors.values() if _index(t.name, prefix) is not None}
    # a for-loop optimizer's operators on one traced layer's parameters, and the temporaries
    # they make (sqrt, div of one parameter's state)
    per_param: set[int] = set()
    temps: set[int] = set()
    for o in ops:
        if o.phase != "optimizer":
            continue
        named = [t for t in o.inputs + o.outputs if tensors[t].name]
        unnamed_in = [t for t in o.inputs if not tensors[t].name and len(tensors[t].shape)]
        if (named and all(t in named_block for t in named)) or (
            not named and unnamed_in and all(t in temps for t in unnamed_in)
        ):
            per_param.add(o.id)
            temps.update(t for t in o.outputs if not tensors[t].name)
        elif o.outputs and len(o.inputs) % len(o.outputs) == 0:
            # a foreach operator returning a list: its k-th output is its k-th input's
            for t_in, t_out in zip(o.inputs, o.outputs, strict=False):
                if (t_in in named_block or t_in in temps) and not tensors[t_out].name:
                    temps.add(t_out)
    # and every tensor a traced layer's operator is the first to touch (activations, views
    # of weights, a backward operator's temporaries)
    first: dict[int, Operator] = {}
    for o in ops:
        for t in o.inputs + o.outputs:
            first.setdefault(t, o)
    owned = set(named_block) | temps
    for t, o in first.items():
        if (
            (o.id in in_block or o.id in per_param)
            and not tensors[t].name
            and (tensors[t].category != "input")
        ):
            owned.add(t)

    def batch_scaled(t):
        return tensors[t].category in ("activation", "input")

    block_fwd = [o for o in ops if o.id in in_block and o.phase == "forward"]
    block_bwd = [o for o in ops if o.id in in_block and o.phase == "backward"]
    read_fwd = {t for o in block_fwd for t in o.inputs}
    read_bwd = {t for o in block_bwd for t in o.inputs}
    fwd_entry = sorted(
        t
        for t in read_fwd
        if t not in owned
        and batch_scaled(t)
        and (t not in producer or producer[t].phase == "forward")
    )
    bwd_entry = sorted(
        t
        for t in read_bwd - read_fwd
        if t not in owned and batch_scaled(t) and t in producer and producer[t].phase == "backward"
    )
    outside = [o for o in ops if o.id not in in_block and o.phase != "optimizer"]
    fwd_exit = sorted(
        {
            t
            for o in outside
            if o.phase == "forward"
            for t in o.inputs
            if t in owned and producer.get(t) and producer[t].phase == "forward"
        }
    )
    bwd_exit = sorted(
        {
            t
            for o in outside
            if o.phase == "backward"
            for t in o.inputs
            if t in owned and producer.get(t) and producer[t].phase == "backward"
        }
    )

    def pair(entry, exit_, what):
        if len(entry) != len(exit_):
            raise TracerError(
                f"cannot chain copies of '{prefix}': the traced layers read "
                f"{len(entry)} {what} tensors from outside and pass on "
                f"{len(exit_)}"
            )
        by_shape = {}
        for t in exit_:
            by_shape.setdefault((tensors[t].shape, tensors[t].dtype), []).append(t)
        out = {}
        for t in entry:
            cands = by_shape.get((tensors[t].shape, tensors[t].dtype), [])
            if len(cands) != 1:
                raise TracerError(
                    f"cannot chain copies of '{prefix}': {what} tensor "
                    f"{tensors[t].shape} has {len(cands)} matching outputs"
                )
            out[t] = cands[0]
        return out

    fwd_pairs = pair(fwd_entry, fwd_exit, "forward")  # entry -> exit
    bwd_pairs = pair(bwd_entry, bwd_exit, "gradient")

    # -- tensor maps per copy ------------------------------------------------------------------
    next_tensor = max(tensors) + 1
    new_tensors: dict[int, Tensor] = dict(tensors)
    maps: list[dict[int, int]] = [{} for _ in range(copies)]
    for c in range(1, copies):
        for t in sorted(owned):
            src = tensors[t]
            new_tensors[next_tensor] = Tensor(
                next_tensor,
                src.shape,
                src.dtype,
                src.nbytes,
                src.category,
                _rename(src.name, prefix, c * traced),
            )
            maps[c][t] = next_tensor
            next_tensor += 1
    for c in range(1, copies):
        for entry, exit_ in fwd_pairs.items():
            maps[c][entry] = maps[c - 1].get(exit_, exit_)
    for c in range(copies - 1):
        for entry, exit_ in bwd_pairs.items():
            maps[c][entry] = maps[c + 1].get(exit_, exit_)

    def mapped(ids, m):
        return tuple(m.get(t, t) for t in ids)

    # -- operators -------------------------------------------------------------------------------
    next_op = max(o.id for o in ops) + 1
    op_maps: list[dict[int, int]] = [{} for _ in range(copies)]
    for c in range(1, copies):
        for o in ops:
            if o.id in in_block or o.id in per_param:
                op_maps[c][o.id] = next_op
                next_op += 1

    def copy_op(o, c):
        m = maps[c]
        fwd = op_maps[c].get(o.fwd_id, o.fwd_id) if o.fwd_id is not None else None
        return Operator(
            op_maps[c][o.id],
            o.name,
            _rename(o.layer, prefix, c * traced),
            o.phase,
            o.time,
            mapped(o.inputs, m),
            mapped(o.outputs, m),
            o.flops,
            fwd,
            o.kernels,
            o.tp_split,
            o.math,
        )

    last_fwd = max(i for i, o in enumerate(ops) if o.id in in_block and o.phase == "forward")
    first_bwd = min(i for i, o in enumerate(ops) if o.id in in_block and o.phase == "backward")
    # runs of consecutive per-parameter operators (an optimizer may loop over the parameters
    # more than once): each run's copies go after it
    runs: dict[int, list[int]] = {}
    run: list[int] = []
    for i, o in enumerate(ops):
        if o.id in per_param:
            run.append(i)
        elif run:
            runs[run[-1]] = run
            run = []
    if run:
        runs[run[-1]] = run
    head = maps[copies - 1]  # what the head reads: the last copy's output
    out: list[Operator] = []
    for i, o in enumerate(ops):
        if i == first_bwd:
            for c in range(copies - 1, 0, -1):
                out += [copy_op(b, c) for b in block_bwd]
        if o.id in in_block or o.id in per_param:
            m = maps[0]
            out.append(
                Operator(
                    o.id,
                    o.name,
                    o.layer,
                    o.phase,
                    o.time,
                    mapped(o.inputs, m),
                    mapped(o.outputs, m),
                    o.flops,
                    o.fwd_id,
                    o.kernels,
                    o.tp_split,
                    o.math,
                )
            )
        elif o.phase == "optimizer":
            out.append(_extended(o, tensors, new_tensors, owned, maps))
        else:
            fm = {t: head[t] for t in fwd_exit if t in head}
            out.append(
                Operator(
                    o.id,
                    o.name,
                    o.layer,
                    o.phase,
                    o.time,
                    mapped(o.inputs, fm),
                    mapped(o.outputs, fm),
                    o.flops,
                    o.fwd_id,
                    o.kernels,
                    o.tp_split,
                    o.math,
                )
            )
        if i == last_fwd:
            for c in range(1, copies):
                out += [copy_op(f, c) for f in block_fwd]
        if i in runs:
            for c in range(1, copies):
                out += [copy_op(ops[j], c) for j in runs[i]]
    meta = dict(trace.metadata)
    weights = [t for t in new_tensors.values() if t.category == "weight"]
    meta["layers"] = {
        "module": prefix,
        "traced": traced,
        "total": total,
        "how": f"layers {prefix}.0-{traced - 1} traced and replicated "
        f"{copies} times (tracer.layers.replicate)",
    }
    if weights and meta.get("parameters"):
        meta["parameters"] = int(sum(math.prod(t.shape) for t in weights))
    return Trace(out, new_tensors, meta).validate()


def _extended(o: Operator, tensors, new_tensors, owned, maps) -> Operator:
    """An optimizer operator over tensor lists, with the copies of the traced layers'
    tensors put in its lists after the traced layers' own (so the lists run in layer
    order); FLOPs from triosim.trace.flops for the longer lists (else, and the time, grown with
    the bytes it reads and writes)."""

    def extend(ids):  # after each run of the traced layers' tensors (one per list), copies
        out, run = [], []
        for t in (*ids, None):
            if t is not None and t in owned:
                run.append(t)
                continue
            if run:
                out += run + [m[x] for m in maps[1:] for x in run if x in m]
                run = []
            if t is not None:
                out.append(t)
        return tuple(out)

    ins, outs = extend(o.inputs), extend(o.outputs)
    if (ins, outs) == (o.inputs, o.outputs):
        return o
    before = sum(tensors[t].nbytes for t in o.inputs + o.outputs)
    after = sum(new_tensors[t].nbytes for t in ins + outs)
    r = after / before if before else 1.0
    flops = forward_flops(
        o.name, [new_tensors[t].shape for t in ins], [new_tensors[t].shape for t in outs]
    )
    if flops is None and o.flops is not None:
        flops = o.flops * r
    return Operator(
        o.id,
        o.name,
        o.layer,
        o.phase,
        o.time * r,
        ins,
        outs,
        flops,
        o.fwd_id,
        o.kernels,
        o.tp_split,
        o.math,
    )
