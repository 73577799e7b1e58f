"""Units of a model: consecutive forward operators whose layer names share a prefix (the
blocks FSDP shards and activation checkpointing recomputes), and recomputation plans."""

from __future__ import annotations

from perfmodel.kinds import op_kind
from triosim.common.errors import ConfigError
from triosim.trace.precision import in_numbered_block

ATTENTION_CORE = ("softmax", "dropout", "bmm", "baddbmm", "scaled_dot_product", "matmul")


def layer_units(trace, depth: int | None = None) -> tuple[dict, list[str], list[set]]:
    """(unit of each op id, unit names, weight ids first used by each unit). `depth` dotted
    parts of the layer name make a unit; None: the smallest depth giving >= 4 units that
    hold weights. A backward op joins its forward op's unit; one without (AccumulateGrad)
    the unit its layer name gives, or else the one the backward pass is in."""
    fwd = [op for op in trace.operators if op.phase == "forward"]
    weights = {t.id for t in trace.weights()}
    if depth is None:
        depth = 1
        while (
            depth < 8
            and len({layer_prefix(op, depth) for op in fwd if any(t in weights for t in op.inputs)})
            < 4
        ):
            depth += 1
    unit_of: dict[int, int] = {}
    names: list[str] = []
    held: list[set] = []
    key = None
    for op in fwd:
        k = layer_prefix(op, depth)
        if k != key or not names:
            key = k
            names.append(k or "(no layer)")
            held.append(set())
        unit_of[op.id] = len(names) - 1
        held[-1] |= {t for t in op.inputs if t in weights}
    seen: set = set()
    for s in held:
        s -= seen
        seen |= s
    # a backward operator without a forward partner (autograd's AccumulateGrad of a weight)
    # belongs to the unit its layer name says, the one of that name nearest to where the
    # backward pass is; without a name, to the unit the backward pass is in. (Putting them
    # all in the last unit held that unit's gradients, so FSDP's reduce-scatters, until
    # the embedding's gradient ended the backward pass.)
    units_named: dict[str, list[int]] = {}
    for u, name in enumerate(names):
        units_named.setdefault(name, []).append(u)
    now = max(len(names) - 1, 0)
    for op in trace.operators:
        if op.phase != "backward":
            continue
        u = unit_of.get(op.fwd_id) if op.fwd_id is not None else None
        if u is None:
            named = units_named.get(layer_prefix(op, depth) or "(no layer)")
            u = min(named, key=lambda k: (abs(k - now), -k)) if named else now
        unit_of[op.id] = now = u
    return unit_of, names, held


def layer_prefix(op, depth: int) -> str:
    """The unit `op` is in: the first `depth` dotted parts of its layer name."""
    return ".".join(op.layer.split(".")[:depth])


def block_depth(trace) -> int | None:
    """The layer-name depth of a model's repeated blocks: the smallest at which units that
    hold weights end in a number (Llama's `layers.N`, GPT-2's `transformer.h.N`, ResNet's
    `layer1.N`), or None where no depth up to 8 does."""
    weights = {t.id for t in trace.weights()}
    fwd = [op for op in trace.operators if op.phase == "forward"]
    for depth in range(1, 9):
        names = {layer_prefix(op, depth) for op in fwd if any(t in weights for t in op.inputs)}
        if any(n.split(".")[-1].isdigit() for n in names if n):
            return depth
    return None


# Megatron-Core's recompute_modules (--recompute-modules, with --recompute-granularity
# selective): the parts of a transformer layer it checkpoints, each a test on an operator
# (`_in_module`)
RECOMPUTE_MODULES = (
    "core_attn",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "moe_act",
    "shared_experts",
)


def with_recompute(ops, policy: str, unit_of: dict, names=None, every: int = 1, modules=()) -> list:
    """Forward + backward ops in order, with recomputed forward ops inserted before the
    first backward op of their unit: [(op, recomputed)]. `full` recomputes every forward op
    of a block (activation checkpointing per block); `selective` only the attention core
    (Megatron-LM's selective recomputation: scores, softmax, dropout, attention over V);
    `op` torchtitan's selective op policy (torchtitan/distributed/activation_checkpoint.py,
    `_save_list`): every forward op of a block again except the attention kernels and the
    odd-numbered matrix products of the block in forward order (the 1st, 3rd, ...; for
    Llama wq, wv, w1, w2), whose outputs are saved.

    `modules` Megatron-Core's recompute_modules (`RECOMPUTE_MODULES`, `check_modules`
    first; the trace's module
    names as the tracer's transformers have them): core_attn the attention core;
    layernorm the norms (a module named ...norm); mla_up_proj MLA's up-projections
    (wq_b, wkv_b) and what its attention module runs before the attention kernel (RoPE,
    splits, concatenations: Megatron's checkpointed up-projection region); mlp a block's
    feed-forward module where it has no experts, moe the whole one where it has; moe_act
    the experts' element-wise operators (their activation); shared_experts the shared
    experts' module.

    Blocks: `names` (unit names) given, the units whose name holds a number (a model's
    repeated layers, `layers.N`: torchtitan wraps `model.layers`' children and Megatron its
    transformer layers, never the embedding, the output projection or the loss) where
    there are any, else every unit; with `every` N only every N-th of those (torchtitan's
    `selective_ac_option: N`: the N-th, 2N-th, ... block)."""
    if policy == "none":
        return [(op, False) for op in ops]
    blocks = None
    if names is not None and policy != "selective":
        numbered = [u for u, n in enumerate(names) if in_numbered_block(n)]
        blocks = set(numbered or range(len(names)))
        if every > 1:
            blocks = {u for k, u in enumerate(sorted(blocks), start=1) if k % every == 0}
    by_unit: dict[int, list] = {}
    products: dict[int, int] = {}  # unit -> matrix products seen in its forward
    experts = {unit_of.get(op.id, -1) for op in ops if _in_experts(op.layer)}
    attended: set = set()  # units whose attention kernel has run (mla_up_proj's end)
    for op in ops:
        if op.phase != "forward":
            continue
        u = unit_of.get(op.id, -1)
        if blocks is not None and u not in blocks:
            continue
        if policy == "modules":
            hit = _in_module(op, modules, u in experts, u in attended)
            if _attention_kernel(op):
                attended.add(u)
            if not hit:
                continue
        elif policy == "op":
            if _matrix_product(op):
                products[u] = products.get(u, 0) + 1
                if products[u] % 2 == 1:  # saved
                    continue
            elif _attention_kernel(op):
                continue
        elif policy == "selective" and not _attention_core(op):
            continue
        by_unit.setdefault(u, []).append(op)
    out, done = [], set()
    for op in ops:
        if op.phase == "backward":
            u = unit_of.get(op.id, -1)
            if u not in done:
                done.add(u)
                out += [(f, True) for f in by_unit.get(u, ())]
        out.append((op, False))
    return out


def check_modules(ops, modules) -> None:
    """Megatron refuses a module the model does not have: mla_up_proj without multi-latent
    attention, the MoE ones without experts. `ops`: the whole model's (a pipeline stage
    may hold no experts, DeepSeek-V3's first its dense layers: checked once, not per
    chunk)."""
    layers = {op.layer for op in ops}
    mla = any(x.endswith((".wq_b", ".wkv_b")) for x in layers)
    moe = any(_in_experts(x) for x in layers)
    for m in modules:
        if (m == "mla_up_proj" and not mla) or (m in ("moe", "moe_act") and not moe):
            what = "multi-latent attention (wq_b, wkv_b)" if m == "mla_up_proj" else "experts"
            raise ConfigError(
                "parallelism.recompute_modules", m, f"a module the trace has: it has no {what}"
            )
        if m == "shared_experts" and not any("shared_experts" in x for x in layers):
            raise ConfigError(
                "parallelism.recompute_modules", m, "a module the trace has: no shared experts"
            )


def _in_experts(layer: str) -> bool:
    """A layer inside a routed-experts module (`...experts`, not `shared_experts`)."""
    return ".experts" in f".{layer}"


def _in_module(op, modules, has_experts: bool, attended: bool) -> bool:
    """Whether `op` lies in one of Megatron's recompute `modules` (with_recompute)."""
    parts = op.layer.split(".")
    ffn = "feed_forward" in parts or "mlp" in parts
    for m in modules:
        if m == "core_attn" and _attention_core(op):
            return True
        # the block's two norms (Megatron's input_layernorm and pre_mlp_layernorm), not
        # MLA's q_norm and kv_norm inside the attention
        if m == "layernorm" and parts[-1].endswith("norm") and len(parts) == 3:
            return True
        if m == "mla_up_proj" and (
            parts[-1] in ("wq_b", "wkv_b")
            or (parts[-1] == "attention" and not attended and not _attention_kernel(op))
        ):
            return True
        if m == "mlp" and ffn and not has_experts:
            return True
        if m == "moe" and ffn and has_experts:
            return True
        if m == "moe_act" and "experts" in parts and op_kind(op)[0] == "elementwise":
            return True  # the activation (silu, its product), not the weights' casts
        if m == "shared_experts" and "shared_experts" in parts:
            return True
    return False


def _matrix_product(op) -> bool:
    """aten::mm as torchtitan's policy counts it: a bias-free linear (one mm) or a mm."""
    return op.name in ("aten::mm", "aten::matmul") or (
        op.name == "aten::linear" and len(op.inputs) == 2
    )


def _attention_kernel(op) -> bool:
    return any(k in op.name for k in ("scaled_dot_product", "flash_attention"))


def _attention_core(op) -> bool:
    layer = op.layer.lower()
    return ("attn" in layer or "attention" in layer) and any(
        k in op.name.lower() for k in ATTENTION_CORE
    )
