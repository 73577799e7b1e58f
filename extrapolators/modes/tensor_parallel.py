"""Tensor parallelism over all GPUs of the plan, on layers (not on autograd operators).

A *layer* is a splittable forward operator that reads a weight (convolution, linear,
embedding); its backward is every backward operator paired with it (fwd_id, or failing
that the one forward layer whose weight it reads), however many autograd operators that
is. Weightless matmuls (attention scores) are not layers: they follow the operators around
them. A split layer's time comes from the performance model at the shard's size; the
collectives below run on the compute stream (blocking), once per layer.

`tp_style: megatron` (Shoeybi et al. 2019, Megatron-LM's tensor_parallel layers). A layer A
whose outputs reach the next layer B only through operators nothing else reads (attention
between QKV and the output projection, GELU between two MLP linears) is column-parallel and
B row-parallel; the operators between them run on 1/N of the data. Per GPU, with b x s x h
the bytes of the layer's activation (tokens x hidden width x element size):
  - row-parallel B, forward: all-reduce of its output (b x s x h);
  - column-parallel A, backward: all-reduce of its input gradient (b x s x h), once, after
    A's last backward operator, and only if that input has a gradient (not the model's
    input, not integer token ids or positions); column layers that read one input (Llama's
    separate Q, K, V; gate and up) do it once for all of them, after the last one's;
  so a transformer block (QKV -> proj, fc1 -> fc2) does 2 all-reduces in forward and 2 in
  backward;
  - the word embedding is vocabulary-parallel (VocabParallelEmbedding): forward all-reduce
    of its output (b x s x h), no backward collective. It is the embedding indexed by a model
    input or whose table is shared (tied) with another layer; other embeddings (positions)
    are replicated, with no collective;
  - the output layer feeding a cross-entropy (the LM head, or a classifier) is column-
    parallel with a vocabulary-parallel loss: no logits gather; the loss does Megatron's three
    all-reduces of one fp32 value per token (max logit, target logit, sum of exponentials:
    3 x b x s x 4 bytes) after the loss operator; backward: all-reduce of the head's input
    gradient (b x s x h). The operators between the head and the loss run on 1/N;
  - any other unpaired layer is column-parallel with a gathered output: forward all-gather
    of its output, backward all-reduce of its input gradient.
  With `sequence_parallel` (Korthikanti et al. 2022) the operators outside the column/row
  regions between the first parallel layer and the head (LayerNorm, residual adds, dropout)
  run on 1/N of the sequence, and each all-reduce becomes a reduce-scatter + all-gather
  pair of the same size: a column layer all-gathers its input before its forward, and in
  backward all-gathers it again (Megatron keeps only the local shard for the weight
  gradient) and reduce-scatters its input gradient; a row layer reduce-scatters its output
  and all-gathers its output gradient before its backward; the word embedding all-reduces
  its output when position embeddings are added to it (then scatters it, which costs
  nothing) or reduce-scatters it otherwise, and all-gathers its gradient in backward. At the
  end of the backward pass the gradients of the weights that saw only part of the sequence
  (LayerNorm weights, row-parallel biases) are all-reduced. Forward bytes equal those without
  sequence parallelism; backward adds the all-gathers for the weight gradients.

`tp_style: channel` (the TrioSim paper's TP, as Black-Samorez/tensor_parallel): every layer
is split by output channel; forward all-gathers each layer's output (operators between
layers are replicated); backward reduce-scatters each layer's input gradient (where it has
one), so the backward operators after the first layer's backward run on 1/N (their
channel shard).

Each GPU holds 1/N of the split weights (a row-parallel bias and replicated layers whole),
so its optimizer step touches (held weight bytes) / (all weight bytes) and its time scales
by that fraction.

The plan is three objects, a module each: tp_roles.TPRoles finds each operator's role (how
it is split), tp_collectives.TPCollectives the collectives around the operators, and
TensorParallel here holds both, checks the plan against the degree and says at which size
each operator runs; the mesh (mesh/, whose preset is mode tp) and mode ep put them on the
GPUs' streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extrapolators.modes.attention import attention_heads
from extrapolators.modes.base import Extrapolator
from extrapolators.modes.tp_collectives import TPCollectives
from extrapolators.modes.tp_roles import SHARDED, SPLIT, TPRoles
from triosim.common.errors import ConfigError
from triosim.common.schema import option

__all__ = ["SHARDED", "SPLIT", "TPOptions", "TensorParallel"]


@dataclass(frozen=True)
class TPOptions:
    tp_style: Literal["megatron", "channel"] = option(
        "megatron",
        help="megatron: column/row-parallel pairs, vocabulary-parallel embedding and loss; "
        "channel: every conv/linear split by output channel, outputs all-gathered (the paper's)",
    )
    sequence_parallel: bool = option(
        False,
        help="megatron only: reduce-scatter/all-gather instead of all-reduce, LayerNorm, "
        "dropout and residual adds sharded over the sequence",
    )


class TensorParallel(Extrapolator):
    """The plan (mode tp is the mesh's preset; the mesh and mode ep hold one of these).

    Made as any Extrapolator (its GPUs are the TP group, `batch_size` the batch each
    GPU's operators process), and: `degree_field`, the config field that sets the degree,
    named in messages (mode tp's num_gpus; the mesh's parallelism.tp); `moe_ops`, operators
    left out of the plan (not layers, no orphan collective), and `expert_ops`, operators
    given no role (`routed_ops`; an MoE model's, moe_tp.py).
    It holds two parts, each in its own module with its contract: `tp_roles`
    (tp_roles.TPRoles: how each operator is split) and `tp_collectives`
    (tp_collectives.TPCollectives: the collectives around the operators), and hands on
    what they give: `roles`, `before`, `after`, `roots`.
    It gives: the checks of the plan against the degree (at construction); `shard` (at
    which target and scale each operator is timed on a GPU of the group);
    `sharded_weights()` and `optimizer_fraction()` (the weights each GPU holds 1/N of,
    and its optimizer step's share); `op_batch()` and `activation_ratio(op)` for the
    memory model.
    """

    name = "tp"
    Options = TPOptions

    def __init__(
        self,
        *args,
        degree_field: str = "num_gpus",
        moe_ops=frozenset(),
        expert_ops=frozenset(),
        **kw,
    ):
        self.degree_field = degree_field
        self.moe_ops, self.routed_ops = frozenset(moe_ops), frozenset(expert_ops)
        super().__init__(*args, **kw)

    def check(self):
        o = self.options
        if o.sequence_parallel and o.tp_style != "megatron":
            raise ConfigError(
                "parallelism.sequence_parallel",
                True,
                "false with tp_style 'channel' (sequence parallelism is Megatron's)",
            )
        fwd = self.ops("forward")
        self.tp_roles = TPRoles(self.trace, o, fwd, self.moe_ops, self.routed_ops)
        if len(self.gpus) > 1 and not any(self.tp_roles.is_layer(op) for op in fwd):
            raise ConfigError(
                "parallelism.mode",
                "tp",
                "a trace with splittable layers (conv, linear, embedding): none "
                "is marked tp_split and reads a weight in this trace",
            )
        self.tp_roles.plan()
        self.tp_collectives = TPCollectives(self.tp_roles, self.batch, self.ring, self.collective)
        if len(self.gpus) > 1:
            self._check_divisible()
            if o.tp_style == "megatron":
                self._check_heads()

    @property
    def roles(self) -> dict[int, str]:
        """op id -> role (tp_roles.TPRoles)."""
        return self.tp_roles.roles

    @property
    def roots(self) -> dict[int, int]:
        """Weight-like tensors -> the parameter each comes from (tp_roles.TPRoles)."""
        return self.tp_roles.roots

    @property
    def before(self) -> dict:
        """op id -> the collectives before it (tp_collectives.TPCollectives)."""
        return self.tp_collectives.before

    @property
    def after(self) -> dict:
        """op id -> the collectives after it (tp_collectives.TPCollectives)."""
        return self.tp_collectives.after

    # -- weights -------------------------------------------------------------------------------
    def _check_divisible(self):
        n, T = len(self.gpus), self.trace.tensors
        for op in self.ops("forward"):
            role = self.roles.get(op.id)
            if role not in SPLIT or role in ("vocab", "head"):
                continue  # vocabularies are padded to a multiple of N (Megatron's
                # make-vocab-size-divisible-by), tied or not
            axis, what = (1, "input") if role == "row" else (0, "output")
            dims = {T[w].shape[axis] for w in self.tp_roles.weights(op) if len(T[w].shape) >= 2}
            for d in sorted(dims):
                if d % n:
                    raise ConfigError(
                        self.degree_field,
                        n,
                        f"a tensor-parallel degree dividing layer "
                        f"{op.layer or op.name}'s {d} {what} units (op {op.id}): "
                        f"each GPU takes an equal shard",
                    )

    def _check_heads(self):
        """Megatron splits attention by heads: the degree must divide the query heads and
        the key/value heads (grouped-query attention's groups; Megatron-LM's
        num_attention_heads % tp and num_query_groups % tp), as attention.attention_heads
        reads them from the trace."""
        n = len(self.gpus)
        for a in attention_heads(self.trace, self.ops("forward"), self.tp_roles.is_layer):
            for what, count in (("attention heads", a.heads), ("key/value heads", a.kv_heads)):
                if count % n:
                    raise ConfigError(
                        self.degree_field,
                        n,
                        f"a tensor-parallel degree "
                        f"dividing the {count} {what} of {a.op.layer or a.op.name} "
                        f"({a.heads} query heads, {a.kv_heads} key/value heads; Megatron "
                        f"splits attention by heads)",
                    )

    def sharded_weights(self) -> set[int]:
        """Weight tensors (parameters) each GPU holds 1/N of."""
        return {self.roots[t] for t in self.tp_roles.split_weight_like()}

    def optimizer_fraction(self) -> float:
        total = self.trace.weight_bytes()
        if total == 0:
            return 1.0
        split = sum(self.trace.tensors[t].nbytes for t in self.sharded_weights())
        return ((total - split) + split / len(self.gpus)) / total

    def op_batch(self):
        return self.batch  # every GPU processes the whole batch, on its shard of the layers

    def activation_ratio(self, op) -> float:
        r = super().activation_ratio(op)
        roles = self.roles
        # outputs of column-parallel layers (and the vocabulary-parallel head, the channel
        # split) and of what runs on 1/N of the data are 1/N of the tensor
        sharded = SHARDED | {"column", "head", "channel"}
        return r / len(self.gpus) if roles.get(op.id) in sharded else r

    def shard(self, op, split, whole, scale: float = 1.0) -> tuple:
        """(target, scale) to time `op` at on a GPU of the group: what its role splits (a
        layer on its weight shard at `split`, an unsplit operator on 1/N of the data), or
        the whole operator at `whole`; `scale` multiplies its time (a ring step's share)."""
        role = self.tp_roles.roles.get(op.id)
        if role in SHARDED:
            return split, scale if op.tp_split else scale / len(self.gpus)
        if op.tp_split and (role in SPLIT or op.id in self.tp_roles.orphan_ids):
            return split, scale
        return whole, scale
