"""What the backward pass reads when element-wise chains run fused (`memory.activations:
fused`): the activations a TransformerEngine / Megatron-Core layer keeps, from an eager trace.

An eager PyTorch trace saves what autograd saves for each small operator: RMSNorm's float32
copy of its input and its intermediates, RoPE's casts, halves and products, SwiGLU's
activation output, the key/value heads repeated for grouped-query attention. Fused kernels
(TransformerEngine's LayerNormLinear and fused RoPE, Megatron's SwiGLU and GQA-native
attention) keep less. The rule, per backward operator B and each batch-scaled tensor T it
reads (`fused_reads`):

- T made by data movement (`role` "move": views, expand, and reshape, contiguous, clone,
  repeat: MOVE_COPIES) is read as what it was made from: a fused kernel reads its input in
  place, strided, with the key/value heads it has (a gather, an index_select, a cat or a
  new tensor is a real copy, kept);
- if B is the backward of an element-wise, normalisation or cast operator (`role`
  "chain") or of a move, T made by a chain operator of the same module (the trace's
  layer: RMSNorm's, the attention's RoPE, the MLP's SwiGLU) is read as that chain's
  inputs, recursively: a fused element-wise backward recomputes what lies inside the
  chain. The chain stops at the module's edge (the residual add that made a norm's input
  is the layer's, not the norm's) and at what a matrix product or attention made. What a
  matrix product or attention reads (its input; q, k, v, the output and statistics) is
  kept, as those kernels keep it, and so is B's forward operator's own output (ReLU's,
  softmax's backward read it);
- a tensor B reads that no forward operator returned was saved inside B's forward operator
  (fwd_id): inside a chain operator it is read as that operator's inputs (RMSNorm keeps its
  input and recomputes the rest).

For a Llama layer (hidden h, grouped-query key/value width h/4, SwiGLU width 3.5h, all in
bfloat16) this keeps, per token: the layer's input and the attention's residual output (2h
each, for the two norms), the two norms' outputs (2h each, the projections' inputs), q
after RoPE (2h), k after RoPE and v (h/2 each), the attention output (2h, also the output
projection's input), the gate and up projections' outputs (7h each) and SwiGLU's output
(7h, the down projection's input): 34h bytes, as TransformerEngine's modules keep, and
2.5h more here: RoPE's backward reads the projections' q and k (its inputs), where TE's
fused RoPE keeps only its frequencies: 36.5h (tests/test_fused_saves.py). Korthikanti et
al. (2022) count 34 s b h too for GPT's layer with FlashAttention's kernels (their
34 s b h + 5 a s^2 b without the score matrix).
"""

from __future__ import annotations

from perfmodel.kinds import op_kind
from triosim.trace.model import Trace

CASTS = frozenset({"to", "_to_copy"})  # a new dtype: inside a chain, not a move
# the copies that only move data a fused kernel can read in place (strided, or with the
# key/value heads it has); a gather, an index_select (MoE's token permutation), a cat or a
# new tensor (zeros_like, full) is a real copy, kept as the trace has it
MOVE_COPIES = frozenset({"reshape", "contiguous", "clone", "repeat", "repeat_interleave"})


def role(o) -> str | None:
    """ "move" (views, expand, and the copies of MOVE_COPIES: a fused kernel reads the
    source), "chain" (element-wise, normalisation, casts: recomputed from the chain's
    inputs), or None (a matrix product, attention, a real copy, ...: what it reads is
    kept)."""
    family, kind = op_kind(o)
    if family == "none" or (family == "copy" and kind in MOVE_COPIES):
        return "move"
    if family in ("elementwise", "norm") or (family == "copy" and kind in CASTS):
        return "chain"
    return None


def fused_reads(trace: Trace) -> dict[int, tuple]:
    """Backward operator id -> the tensors it reads under the rule above (only operators
    whose reads change)."""
    scaled = {t.id for t in trace.tensors.values() if t.scales_with_batch}
    made: dict[int, object] = {}  # tensor -> the forward operator that returned it first
    by_id = {}
    for o in trace.operators:
        by_id[o.id] = o
        if o.phase == "forward":
            for t in o.outputs:
                made.setdefault(t, o)
    roles: dict = {}

    def role_of(o):
        if o.id not in roles:
            roles[o.id] = role(o)
        return roles[o.id]

    def sources(t, module, seen: set, own=()) -> list:
        """What t is read as: itself; or, made by a move, what the move read; or, with
        `module` (a chain's backward), made by a chain operator of that module, the
        chain's inputs; recursively. `own`: the backward's own forward operator's outputs,
        kept (ReLU's, sigmoid's and softmax's backward read their output: reading the
        input instead would keep both)."""
        o = made.get(t)
        if o is None or t in seen or t in own:
            return [t]
        r = role_of(o)
        if not (r == "move" or (r == "chain" and module is not None and o.layer == module)):
            return [t]
        seen.add(t)
        out = []
        for i in o.inputs:
            if i in scaled and i != t:
                out.extend(sources(i, module, seen))
        return out or [t]

    tensors = trace.tensors

    def storage(t):  # (a storage in one dtype: a cast the tracer joins to its input is new)
        x = tensors[t]
        return ("s", x.storage, x.dtype) if x.storage is not None else ("t", t)

    made_storage = {storage(t) for t in made}
    out: dict[int, tuple] = {}
    returned: set = set()  # storages an earlier backward operator returned: gradients
    for b in trace.operators:
        if b.phase != "backward":
            continue
        fwd = by_id.get(b.fwd_id) if b.fwd_id is not None else None
        module = fwd.layer if fwd is not None and role_of(fwd) is not None else None
        own = set(fwd.outputs) if fwd is not None else set()
        reads: list = []
        for t in b.inputs:
            if t not in scaled or (t not in made and storage(t) in returned):  # a gradient
                reads.append(t)
            elif t in made or module is None or storage(t) in made_storage:
                reads.extend(sources(t, module, set(), own))  # (an alias of a forward one)
            else:  # saved inside an element-wise forward operator: its inputs
                ins = [i for i in fwd.inputs if i in scaled]
                reads.extend(x for i in ins for x in sources(i, module, set(), own))
        returned.update(storage(t) for t in b.outputs)
        reads = tuple(dict.fromkeys(reads))
        if reads != tuple(b.inputs):
            out[b.id] = reads
    return out


def moved_from(trace: Trace) -> dict[int, int]:
    """Batch-scaled tensor made by data movement (`role` "move") -> the tensor it moves
    (followed back to one a move did not make): under fused kernels no copy is made (the
    kernel reads the source strided), so it is that tensor's memory, not its own (an
    eager trace's repeated key/value heads are four times the heads there are)."""
    scaled = {t.id for t in trace.tensors.values() if t.scales_with_batch}
    out: dict[int, int] = {}
    for o in trace.operators:
        if o.phase != "forward" or role(o) != "move":
            continue
        src = next((i for i in o.inputs if i in scaled), None)
        if src is None:
            continue
        src = out.get(src, src)
        for t in o.outputs:
            if t in scaled and t != src:
                out.setdefault(t, src)
    return out
