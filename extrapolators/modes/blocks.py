"""Units of a model: consecutive forward operators whose layer names share a prefix (the
blocks FSDP shards and activation checkpointing recomputes), and recomputation plans."""

from __future__ import annotations

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
            and len({_prefix(op, depth) for op in fwd if any(t in weights for t in op.inputs)}) < 4
        ):
            depth += 1
    unit_of: dict[int, int] = {}
    names: list[str] = []
    held: list[set] = []
    key = None
    for op in fwd:
        k = _prefix(op, depth)
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
            named = units_named.get(_prefix(op, depth) or "(no layer)")
            u = min(named, key=lambda k: (abs(k - now), -k)) if named else now
        unit_of[op.id] = now = u
    return unit_of, names, held


def _prefix(op, depth: int) -> str:
    return ".".join(op.layer.split(".")[:depth])


def with_recompute(ops, policy: str, unit_of: dict) -> list[tuple[object, bool]]:
    """Forward + backward ops in order, with recomputed forward ops inserted before the
    first backward op of their unit: [(op, recomputed)]. `full` recomputes every forward op
    of the unit (activation checkpointing per block); `selective` only the attention core
    (Megatron-LM's selective recomputation: scores, softmax, dropout, attention over V)."""
    if policy == "none":
        return [(op, False) for op in ops]
    by_unit: dict[int, list] = {}
    for op in ops:
        if op.phase == "forward":
            if policy == "full" or _attention_core(op):
                by_unit.setdefault(unit_of.get(op.id, -1), []).append(op)
    out, done = [], set()
    for op in ops:
        if op.phase == "backward":
            u = unit_of.get(op.id, -1)
            if u not in done:
                done.add(u)
                out += [(f, True) for f in by_unit.get(u, ())]
        out.append((op, False))
    return out


def _attention_core(op) -> bool:
    layer = op.layer.lower()
    return ("attn" in layer or "attention" in layer) and any(
        k in op.name.lower() for k in ATTENTION_CORE
    )
