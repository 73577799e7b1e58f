"""The traced layers of a trace as one block: what it owns and how copies of it chain.

`find_block` reads a trace whose layers prefix.0 .. prefix.(k-1) were traced (the first k of a
model's identical layers) and returns a `Block`: the operators that belong to the traced
layers (theirs, and a for-loop optimizer's operators on their parameters), the tensors those
operators own (so a copy needs new ones), and the tensors that cross the block's edge, paired
so that a copy's input is the previous copy's output. `tracer.layers.replicate` builds the
copies from it. The caller provides a trace whose operator ids and tensor ids are unique and
`layer_of`, each operator's layer number under the prefix (None outside it); a block that
cannot be chained raises TracerError. Nothing here changes the trace.

Pure Python on the trace: no PyTorch needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from triosim.common.errors import TracerError
from triosim.trace.model import Operator, Tensor


def layer_index(name: str, prefix: str) -> int | None:
    """The layer number of a module path or parameter name under `prefix` ("layers.3.x" ->
    3), or None."""
    m = re.match(rf"^{re.escape(prefix)}\.(\d+)(?:\.|$)", name or "")
    return int(m.group(1)) if m else None


@dataclass
class Block:
    """The traced layers' share of a trace (ids; lists in trace order, tensor ids sorted).

    in_block: the operators of the traced layers; per_param: a for-loop optimizer's
    operators on their parameters; owned: the tensors a copy gets anew; block_fwd, block_bwd:
    the traced layers' forward and backward operators; fwd_exit: the owned forward tensors
    that operators after the block read (the head reads the last copy's); fwd_pairs,
    bwd_pairs: a tensor the block reads from outside -> the block's output a copy reads in
    its place (forward: the previous copy's; backward: the next copy's gradient)."""

    in_block: set[int]
    per_param: set[int]
    owned: set[int]
    block_fwd: list[Operator]
    block_bwd: list[Operator]
    fwd_exit: list[int]
    fwd_pairs: dict[int, int]
    bwd_pairs: dict[int, int]


def find_block(
    ops: list[Operator], tensors: dict[int, Tensor], layer_of: dict, prefix: str
) -> Block:
    """The Block of the traced layers under `prefix` in `ops` (layer_of: operator id ->
    layer number or None). Raises TracerError where the copies cannot be chained."""
    producer = _producers(ops)
    in_block = {o.id for o in ops if layer_of[o.id] is not None}
    named_block = {t.id for t in tensors.values() if layer_index(t.name, prefix) is not None}
    per_param, temps = _optimizer_share(ops, tensors, named_block)
    owned = _owned(ops, tensors, in_block | per_param, named_block | temps)
    block_fwd = [o for o in ops if o.id in in_block and o.phase == "forward"]
    block_bwd = [o for o in ops if o.id in in_block and o.phase == "backward"]
    outside = [o for o in ops if o.id not in in_block and o.phase != "optimizer"]
    fwd_entry, bwd_entry = _entries(block_fwd, block_bwd, tensors, owned, producer)
    fwd_exit = _exits(outside, "forward", owned, producer)
    bwd_exit = _exits(outside, "backward", owned, producer)
    return Block(
        in_block,
        per_param,
        owned,
        block_fwd,
        block_bwd,
        fwd_exit,
        _pair(fwd_entry, fwd_exit, "forward", tensors, prefix),
        _pair(bwd_entry, bwd_exit, "gradient", tensors, prefix),
    )


def _producers(ops) -> dict[int, Operator]:
    """Tensor id -> the first operator that writes it without reading it (an in-place
    operator's output is not its making)."""
    producer: dict[int, Operator] = {}
    for o in ops:
        for t in o.outputs:
            if t not in o.inputs:
                producer.setdefault(t, o)
    return producer


def _optimizer_share(ops, tensors, named_block) -> tuple[set[int], set[int]]:
    """(per_param, temps): a for-loop optimizer's operators on one traced layer's parameters
    (all their named tensors are the traced layers', by `named_block`), and the unnamed
    temporaries they and foreach operators make from them (sqrt, div of one parameter's
    state). Assumes ops in trace order: a temporary is known before it is read."""
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
    return per_param, temps


def _owned(ops, tensors, members, owned_named) -> set[int]:
    """The tensors a copy gets anew: `owned_named` (the traced layers' parameters, gradients,
    states and the optimizer's temporaries of them) and every unnamed, non-input tensor an
    operator in `members` is the first to touch (activations, views of weights, a backward
    operator's temporaries)."""
    first: dict[int, Operator] = {}
    for o in ops:
        for t in o.inputs + o.outputs:
            first.setdefault(t, o)
    owned = set(owned_named)
    for t, o in first.items():
        if o.id in members and not tensors[t].name and (tensors[t].category != "input"):
            owned.add(t)
    return owned


def _entries(block_fwd, block_bwd, tensors, owned, producer) -> tuple[list[int], list[int]]:
    """(forward entry, backward entry), sorted: the batch-sized tensors the block reads from
    outside it, made by a forward operator (or by none: the batch) for the forward entry,
    and made by a backward operator, read in backward only, for the backward entry."""

    def batch_scaled(t):
        return tensors[t].category in ("activation", "input")

    read_fwd = {t for o in block_fwd for t in o.inputs}
    read_bwd = {t for o in block_bwd for t in o.inputs}
    # a gradient the block accumulates into in place (the autograd engine adds a residual's
    # two gradients into the incoming buffer when it can; which operators do so depends on
    # the device and its kernels) passes through every copy: it needs no pairing
    read_bwd -= {t for o in block_bwd for t in o.outputs if t in o.inputs}
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
    return fwd_entry, bwd_entry


def _exits(outside, phase, owned, producer) -> list[int]:
    """The owned tensors made in `phase` that the operators of that phase outside the block
    read (what the block passes on), sorted."""
    return sorted(
        {
            t
            for o in outside
            if o.phase == phase
            for t in o.inputs
            if t in owned and producer.get(t) and producer[t].phase == phase
        }
    )


def _pair(entry, exit_, what, tensors, prefix) -> dict[int, int]:
    """Entry tensor -> the exit tensor of its shape and dtype; TracerError unless the two
    match one to one."""
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
