"""Storages of a replicated trace (tracer.layers.replicate): a copy of the traced layers
shares storage where the traced layers do.

A trace's storage id says which tensors are one allocation (a view and its base; a saved
tensor that autograd unpacks in backward under a new tensor id and the forward tensor it
is, tracer.et_storage and tracer.meta_trace). The memory model counts an allocation once
and gives a tensor that backward reads first its forward operator's birth
(triosim.results.memory.activation_plan), so a copy whose tensors had no storage counted
each view and each unpacked saved tensor as one more allocation, alive from forward to
backward: rms_norm's saved float32 input once per reader, the linear's input views.

The rule: in each context (copy c of the traced layers, c = 0 the traced layers
themselves; the rest of the trace, the "outside"), the tensors a context touches whose
traced tensors share a storage share one. A copy's tensor is the traced one through the
copy's map (tracer.layers._tensor_maps: a copy's own tensors, its entries the previous
copy's outputs or the next copy's gradients), the outside's through the head's map (it
reads the last copy's output). Contexts meet where they use the same tensor (a copy's
entry is the previous copy's exit), so storages join across them exactly there.

Pure Python on the trace: no PyTorch needed.
"""

from __future__ import annotations

import dataclasses

from tracer.layer_block import Block
from triosim.trace.model import Tensor


def copy_storages(
    ops, tensors: dict[int, Tensor], new_tensors: dict[int, Tensor], block: Block, maps, head
) -> dict[int, Tensor]:
    """`new_tensors` with storages by the rule above (ops: the traced trace's operators;
    maps[c]: copy c's tensor map; head: the outside's map). A tensor whose traced original
    has no storage has none; a storage label is the traced one where that storage keeps
    one allocation, else a new label above every traced one. A tensor no context touches
    keeps its traced storage (a copy's: a label of its own)."""
    parent: dict[int, int] = {}

    def find(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    first: dict = {}  # (context, traced storage) -> a tensor of the new trace

    def touch(ctx, t: int, n: int) -> None:
        s = tensors[t].storage
        if s is None:
            return
        parent.setdefault(n, n)
        k = first.setdefault((ctx, s), n)
        a, b = find(k), find(n)
        if a != b:
            parent[max(a, b)] = min(a, b)  # the smaller id leads: deterministic labels

    copies = len(maps)
    members = block.in_block | block.per_param
    for o in ops:
        ids = o.inputs + o.outputs
        if o.id in members:
            for c in range(copies):
                for t in ids:
                    touch(c, t, maps[c].get(t, t))
        elif o.phase == "optimizer":  # a foreach list: each copy's tensors in their copy
            for t in ids:
                touch(0, t, t)
                if t in block.owned:
                    for c in range(1, copies):
                        touch(c, t, maps[c][t])
        else:
            for t in ids:
                touch("outside", t, head.get(t, t))
    return _labelled(tensors, new_tensors, parent, find)


def _labelled(tensors, new_tensors, parent, find) -> dict[int, Tensor]:
    """Each joined set one storage label: the traced storage of its first traced tensor
    (in id order) when no other set took it, else a new one."""
    top = max((t.storage for t in tensors.values() if t.storage is not None), default=-1)
    label: dict[int, int] = {}  # root -> label
    taken: set[int] = set()
    for n in sorted(parent):
        r = find(n)
        if r in label:
            continue
        own = tensors[n].storage if n in tensors else None
        if own is not None and own not in taken:
            label[r] = own
        else:
            top += 1
            label[r] = top
        taken.add(label[r])
    out = dict(new_tensors)
    for n, t in new_tensors.items():
        if n in parent:
            s = label[find(n)]
        elif n in tensors or t.storage is None:
            continue
        else:
            top += 1
            s = top
        if s != t.storage:
            out[n] = dataclasses.replace(t, storage=s)
    return out
