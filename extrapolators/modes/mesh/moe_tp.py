"""Tensor parallelism of the dense layers of a mixture-of-experts model on the mesh (experts
on the mesh with `tp` > 1), as Megatron-Core runs an MoE model: attention, shared experts, embedding and
head split by Megatron's rules (tensor_parallel.py: column/row pairs, vocabulary-parallel
embedding and loss, head-count checks), sequence parallel (Megatron-Core refuses MoE with
TP > 1 without it: "When using MoE and tensor parallelism, sequence parallelism must be
used"), and the MoE layers left out of the plan:

- the router is not split (Megatron's TopKRouter holds its whole weight on every rank) and
  runs, as everything between the attention's row layer and the next column layer, on
  the GPU's 1/tp of the sequence; its weight's gradient, like a LayerNorm's, is all-reduced
  over the TP group at the end of the backward pass (Megatron sets `sequence_parallel` on
  the router weight);
- the routed experts are the expert plan's (experts.py: their tokens, all-to-alls and
  expert-TP group):
  no TP role, no TP collective, their weights not among the TP-split ones.

`moe_block_ops(trace, moe)` names the MoE layers' operators (every operator whose layer is
an MoE layer's module or under it, except the shared experts'); `DenseTensorParallel` is
the TP plan with them left out.
"""

from __future__ import annotations

from extrapolators.modes.tensor_parallel import TensorParallel


def moe_block_of(moe: dict):
    """(layer name -> its MoE layer's module as a dotted prefix, `.layers.3.feed_forward.`,
    or None outside the routed experts; the shared experts' module name). An MoE layer's
    module is what an expert operator's layer has before `moe.expert_module`."""
    mod = moe["expert_module"]
    parent = mod.rsplit(".", 1)[0] + "." if "." in mod else ""  # `feed_forward.`

    def of(layer) -> str | None:
        name = "." + (layer or "") + "."
        k = name.find("." + mod + ".")
        return name[: k + 1] + parent if k >= 0 else None

    return of, moe.get("shared_module", "shared_experts")


def moe_block_ops(trace, moe: dict) -> set:
    """Ids of the operators (all phases) of the MoE layers outside the shared experts: the
    router, the dispatch and combine, the routed experts (`moe_block_of`)."""
    block_of, shared = moe_block_of(moe)
    blocks = {block_of(op.layer) for op in trace.operators} - {None}
    out = set()
    for op in trace.operators:
        name = "." + (op.layer or "") + "."
        for b in blocks:
            if name.startswith(b) and not name.startswith(b + shared + "."):
                out.add(op.id)
                break
    return out


class DenseTensorParallel(TensorParallel):
    """Mode tp's Megatron plan on the dense layers of the mesh (its degree parallelism.tp),
    the MoE layers' operators (`moe_ops`) left out: not layers, no role for the routed
    experts' (`expert_ops`: so their weights are neither split nor reduced over the TP
    group), no orphan collective (TensorParallel's arguments of those names)."""

    def __init__(self, *args, moe_ops=frozenset(), expert_ops=frozenset(), **kw):
        kw.setdefault("degree_field", "parallelism.tp")
        super().__init__(*args, moe_ops=moe_ops, expert_ops=expert_ops, **kw)
