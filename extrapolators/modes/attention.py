"""The attention operators of a trace and their shapes: what splitting attention by heads
(tensor parallelism, Ulysses) or by the sequence (ring attention) needs to know.

`attention_heads(trace, fwd, is_layer)` lists, for every forward attention operator that
reads a 4-D query, key and value (batch, heads, sequence, head size) - PyTorch's
`scaled_dot_product_attention` and the fused kernels under it - its query heads, its
key/value heads (grouped-query attention's groups), its head size and its sequence length.
Key/value heads come from the projection the key is made by (its outputs / head size), or
the key's own head count where one projection makes query and key (GPT-2's fused QKV) or
none is found: torchtitan repeats Llama's 8 key/value heads to 32 before the attention, so
the key read by the attention has 32 and only its projection (1,024 outputs / 128) says 8.
`is_layer(op)` says which operators are projections (a splittable operator reading a
weight, or a cast of one: tp_roles.reads_weight).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Heads:
    op: object  # the forward attention operator
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention's groups)
    head_dim: int
    seq: int  # the query's sequence length


def attention_heads(trace, fwd, is_layer) -> list[Heads]:
    """Every forward attention operator of `fwd` with 4-D query and key, in trace order."""
    T = trace.tensors
    made = {t: op for op in fwd for t in op.outputs}
    out = []
    for op in fwd:
        if "attention" not in op.name or len(op.inputs) < 3:
            continue
        q, k = T[op.inputs[0]], T[op.inputs[1]]
        if len(q.shape) != 4 or len(k.shape) != 4 or not q.shape[-1]:
            continue
        heads, size = q.shape[1], q.shape[-1]
        from_q = projection(trace, op.inputs[0], made, is_layer)
        from_k = projection(trace, op.inputs[1], made, is_layer)
        kv = k.shape[1]
        if from_k is not None and from_k is not from_q:
            width = T[from_k.outputs[0]].shape[-1] if from_k.outputs else 0
            kv = width // size if width and width % size == 0 else kv
        out.append(Heads(op, heads, kv, size, q.shape[2]))
    return out


def projection(trace, t, made, is_layer, steps: int = 32):
    """The layer a tensor comes from, following each operator's first batch-sized input
    (views, transposes, the rotary embedding, `type_as`, the repeat of key/value heads),
    or None."""
    T = trace.tensors
    for _ in range(steps):
        op = made.get(t)
        if op is None:
            return None
        if is_layer(op):
            return op
        t = next((x for x in op.inputs if T[x].scales_with_batch), None)
        if t is None:
            return None
    return None
