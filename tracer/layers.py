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

The steps: `_check_layers` (the trace has layers 0..k-1, L a multiple of k),
`tracer.layer_block.find_block` (what the traced layers own and how copies chain),
`_tensor_maps` and `_operator_maps` (the copies' new ids), `_assemble` (the operators in
order), `tracer.layer_storage.copy_storages` (a copy's tensors share storage where the traced
layers' do: views, saved tensors unpacked in backward), `_metadata`. The input trace is not changed; the result shares its Tensor objects.

Pure Python on the trace: no PyTorch needed.
"""

from __future__ import annotations

import math
import re

from tracer.layer_block import Block, find_block
from tracer.layer_block import layer_index as _index
from tracer.layer_storage import copy_storages
from triosim.common.errors import TracerError
from triosim.trace.flops import forward_flops
from triosim.trace.model import Operator, Tensor, Trace


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
    layer_of = _check_layers(trace, prefix, traced, total)
    copies = total // traced
    if copies == 1:
        return trace
    ops = trace.operators
    block = find_block(ops, trace.tensors, layer_of, prefix)
    new_tensors, maps = _tensor_maps(trace.tensors, block, copies, prefix, traced)
    op_maps = _operator_maps(ops, block, copies)
    out = _assemble(ops, trace.tensors, new_tensors, block, maps, op_maps, prefix, traced)
    head = {t: maps[copies - 1][t] for t in block.fwd_exit if t in maps[copies - 1]}
    new_tensors = copy_storages(ops, trace.tensors, new_tensors, block, maps, head)
    meta = _metadata(trace.metadata, new_tensors, prefix, traced, total)
    return Trace(out, new_tensors, meta).validate()


def _check_layers(trace: Trace, prefix: str, traced: int, total: int) -> dict:
    """Operator id -> its layer number under `prefix` (None outside); TracerError unless
    `total` is a multiple of `traced` and the trace has exactly layers 0..traced-1."""
    if traced < 1 or total < traced or total % traced:
        raise TracerError(
            f"cannot replicate {traced} traced layers to {total}: the model's "
            "layer count must be a multiple of the traced one"
        )
    layer_of = {o.id: _index(o.layer, prefix) for o in trace.operators}
    seen_layers = {i for i in layer_of.values() if i is not None}
    if seen_layers != set(range(traced)):
        raise TracerError(
            f"the trace's layers under '{prefix}' are {sorted(seen_layers)}; "
            f"expected 0..{traced - 1}"
        )
    return layer_of


def _tensor_maps(
    tensors: dict[int, Tensor], block: Block, copies: int, prefix: str, traced: int
) -> tuple[dict[int, Tensor], list[dict[int, int]]]:
    """(new_tensors, maps): the trace's tensors plus, for each copy c >= 1, a new tensor
    per owned one (new ids after the largest, in copy then id order; names moved c * traced
    layers on); maps[c]: tensor id -> the id copy c uses in its place (maps[0] only the
    backward entries), so copy c reads copy c-1's forward output and copy c+1's gradient."""
    next_tensor = max(tensors) + 1
    new_tensors: dict[int, Tensor] = dict(tensors)
    maps: list[dict[int, int]] = [{} for _ in range(copies)]
    for c in range(1, copies):
        for t in sorted(block.owned):
            src = tensors[t]
            new_tensors[next_tensor] = Tensor(
                next_tensor,
                src.shape,
                src.dtype,
                src.nbytes,
                src.category,
                _rename(src.name, prefix, c * traced),
                src.storage,  # the traced label for now: tracer.layer_storage relabels
            )
            maps[c][t] = next_tensor
            next_tensor += 1
    for c in range(1, copies):
        for entry, exit_ in block.fwd_pairs.items():
            maps[c][entry] = maps[c - 1].get(exit_, exit_)
    for c in range(copies - 1):
        for entry, exit_ in block.bwd_pairs.items():
            maps[c][entry] = maps[c + 1].get(exit_, exit_)
    return new_tensors, maps


def _operator_maps(ops: list[Operator], block: Block, copies: int) -> list[dict[int, int]]:
    """op_maps[c] (c >= 1): operator id -> its copy's id, for the block's operators and the
    per-parameter optimizer ones (new ids after the largest, in copy then trace order)."""
    next_op = max(o.id for o in ops) + 1
    op_maps: list[dict[int, int]] = [{} for _ in range(copies)]
    for c in range(1, copies):
        for o in ops:
            if o.id in block.in_block or o.id in block.per_param:
                op_maps[c][o.id] = next_op
                next_op += 1
    return op_maps


def _remapped(o: Operator, m: dict, op_id: int, layer: str, fwd_id) -> Operator:
    """A new Operator like `o`, with id, layer and fwd_id given and its tensors through `m`
    (an id not in `m` stays)."""
    return Operator(
        op_id,
        o.name,
        layer,
        o.phase,
        o.time,
        tuple(m.get(t, t) for t in o.inputs),
        tuple(m.get(t, t) for t in o.outputs),
        o.flops,
        fwd_id,
        o.kernels,
        o.tp_split,
        o.math,
    )


def _per_param_runs(ops: list[Operator], per_param: set[int]) -> dict[int, list[int]]:
    """Runs of consecutive per-parameter operators (an optimizer may loop over the
    parameters more than once), by the index of each run's last operator -> the run's
    indices in `ops`: each run's copies go after it."""
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
    return runs


def _assemble(ops, tensors, new_tensors, block, maps, op_maps, prefix, traced) -> list[Operator]:
    """The replicated trace's operators: the trace's in order (the traced layers' through
    maps[0], the others reading the last copy's output where they read the block's, a
    foreach optimizer operator's lists extended), the backward copies (last first) before
    the first traced backward operator, the forward copies after the last traced forward
    one, each run of per-parameter operators' copies after it. Copy ids come from op_maps,
    tensor ids from maps (`_tensor_maps`, `_operator_maps`)."""
    copies = len(maps)

    def copy_op(o, c):
        fwd = op_maps[c].get(o.fwd_id, o.fwd_id) if o.fwd_id is not None else None
        return _remapped(o, maps[c], op_maps[c][o.id], _rename(o.layer, prefix, c * traced), fwd)

    in_block, per_param = block.in_block, block.per_param
    last_fwd = max(i for i, o in enumerate(ops) if o.id in in_block and o.phase == "forward")
    first_bwd = min(i for i, o in enumerate(ops) if o.id in in_block and o.phase == "backward")
    runs = _per_param_runs(ops, per_param)
    head = maps[copies - 1]  # what the head reads: the last copy's output
    fm = {t: head[t] for t in block.fwd_exit if t in head}
    out: list[Operator] = []
    for i, o in enumerate(ops):
        if i == first_bwd:
            for c in range(copies - 1, 0, -1):
                out += [copy_op(b, c) for b in block.block_bwd]
        if o.id in in_block or o.id in per_param:
            out.append(_remapped(o, maps[0], o.id, o.layer, o.fwd_id))
        elif o.phase == "optimizer":
            out.append(_extended(o, tensors, new_tensors, block.owned, maps))
        else:
            out.append(_remapped(o, fm, o.id, o.layer, o.fwd_id))
        if i == last_fwd:
            for c in range(1, copies):
                out += [copy_op(f, c) for f in block.block_fwd]
        if i in runs:
            for c in range(1, copies):
                out += [copy_op(ops[j], c) for j in runs[i]]
    return out


def _metadata(metadata: dict, new_tensors, prefix: str, traced: int, total: int) -> dict:
    """A copy of the trace's metadata saying how the layers were replicated, with the
    parameter count of all `total` layers (where the trace counts parameters)."""
    meta = dict(metadata)
    weights = [t for t in new_tensors.values() if t.category == "weight"]
    meta["layers"] = {
        "module": prefix,
        "traced": traced,
        "total": total,
        "how": f"layers {prefix}.0-{traced - 1} traced and replicated "
        f"{total // traced} times (tracer.layers.replicate)",
    }
    if weights and meta.get("parameters"):
        meta["parameters"] = int(sum(math.prod(t.shape) for t in weights))
    return meta


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
