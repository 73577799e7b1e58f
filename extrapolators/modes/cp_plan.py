"""The attention operators a context-parallel plan splits, checked against its degrees, and
the bytes one GPU moves for each: shared by mode cp (context_parallel.py) and 3D with a CP
degree (threed.py).

`plan_attention(trace, cp, tp, comm, sequence_parallel, mode)`: {op id: Heads} for every
fused attention operator (attention.attention_heads) and the backward operators paired
with it, or a ConfigError naming the field: the sequence must split into 2 x cp chunks
(ring: two per GPU for causal balance) or cp (Ulysses); Ulysses splits each TP rank's
heads / tp over cp, so tp x cp must divide the query and the key/value heads; sequence
parallelism splits each CP rank's s / cp tokens over tp.
`kv_block_bytes(trace, a, ratio, tp)`: one GPU's key/value block of the ring (k and v at
the GPU's token share `ratio` of the trace's, at the key/value heads, 1/tp of them).
`ulysses_bytes(trace, a, ratio, tp)`: the per-GPU bytes of Ulysses' all-to-alls (q, k, v
before; the output after), each at the GPU's token share and heads / tp.

Per GPU of a tp x cp group, for one attention of a sequence of s tokens, b sequences per
data-parallel replica, h query heads, g key/value heads, head size e, element size z (the
hand calculation tests/test_cp_tp.py checks):
  - tokens: b x s / cp; attention FLOPs: 1 / (tp x cp) of the sequence's (heads / tp, the
    query tokens / cp against all keys), in cp ring steps of 1 / (tp x cp^2) each;
  - ring key/value block: 2 (k, v) x b x (s / cp) x (g / tp) x e x z bytes; forward cp - 1
    sends, backward cp messages of 2 (cp - 1) blocks' bytes;
  - Ulysses: each all-to-all carries the GPU's q (or k, v at g heads, or the output) at
    b x (s / cp) x (h / tp) x e x z bytes; the heads per TP rank must split over cp (h and
    g divisible by tp x cp);
  - TP collectives (without sequence parallelism): per block 2 all-reduces forward and 2
    backward of b x (s / cp) x hidden x z bytes, over the tp GPUs of the CP rank;
  - weights, gradients: the TP shard (split layers 1 / tp, the rest whole), reduced over
    the dp x cp GPUs holding it (Megatron's data-parallel group with context parallelism:
    the weights are replicated over CP as over DP).
"""

from __future__ import annotations

from extrapolators.modes.attention import attention_heads
from extrapolators.modes.tp_roles import reads_weight, weight_roots
from triosim.common.errors import ConfigError


def plan_attention(trace, cp, tp, comm, sequence_parallel, mode="cp") -> dict:
    """{forward or backward op id: its forward attention's Heads} (module docstring)."""
    fwd = [op for op in trace.operators if op.phase == "forward"]
    roots = weight_roots(trace, fwd)
    found = attention_heads(trace, fwd, lambda op: reads_weight(op, roots))
    if not found:
        raise ConfigError(
            "parallelism.mode",
            mode,
            "a trace whose attention is one operator reading 4-D query, key and value "
            "(scaled_dot_product_attention): context parallelism splits it over the "
            "sequence, and this trace has none",
        )
    c, out = cp, {}
    for a in found:
        where = a.op.layer or a.op.name
        chunks = 2 * c if comm == "p2p" else c
        if a.seq % chunks:
            why = "two chunks per GPU (causal load balancing)" if comm == "p2p" else ""
            raise ConfigError(
                "parallelism.cp",
                c,
                f"a degree whose {chunks} sequence chunks divide the {a.seq} tokens of "
                f"{where}" + (f": {why}" if why else ""),
            )
        if comm == "a2a":
            t = tp  # Ulysses splits each TP rank's heads / tp over the CP group
            for what, count in (("attention heads", a.heads), ("key/value heads", a.kv_heads)):
                if count % (c * t):
                    shard = f"the {count // t} per TP rank of " if t > 1 else ""
                    raise ConfigError(
                        "parallelism.cp",
                        c,
                        f"a degree dividing {shard}the {count} {what} of {where} "
                        f"({a.heads} query heads, {a.kv_heads} key/value heads, tp "
                        f"{t}; cp_comm 'a2a' gives each GPU 1/(tp x cp) of the heads)",
                    )
        if sequence_parallel and (a.seq // c) % tp:
            raise ConfigError(
                "parallelism.tp",
                tp,
                f"a degree dividing each CP rank's {a.seq // c} tokens of {where} "
                f"(sequence parallelism splits them over the TP group)",
            )
        out[a.op.id] = a
    for op in trace.operators:
        if op.phase == "backward" and op.fwd_id in out:
            out[op.id] = out[op.fwd_id]
    return out


def kv_block_bytes(trace, a, ratio, tp) -> float:
    """One GPU's key and value block of attention `a` (module docstring)."""
    T, (k, v) = trace.tensors, a.op.inputs[1:3]
    kv = (T[k].nbytes + T[v].nbytes) * ratio * a.kv_heads / T[k].shape[1]
    return kv if tp == 1 else kv / tp


def ulysses_bytes(trace, a, ratio, tp) -> tuple[list, list]:
    """Per-GPU bytes of q, k, v and of the output (Ulysses' all-to-alls)."""
    T, r = trace.tensors, ratio
    q, k, v = (T[t] for t in a.op.inputs[:3])
    kv = a.kv_heads / k.shape[1]
    qkv = [q.nbytes * r, k.nbytes * r * kv, v.nbytes * r * kv]
    out = T[a.op.outputs[0]].nbytes * r if a.op.outputs else qkv[0]
    if tp > 1:  # each TP rank's heads
        return [x / tp for x in qkv], [out / tp]
    return qkv, [out]
