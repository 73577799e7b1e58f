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
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Literal

from extrapolators.communication import collectives
from extrapolators.execution.symmetry import Symmetry
from extrapolators.execution.tasks import Collective, Compute, ComputeRun
from extrapolators.modes.base import Extrapolator
from perfmodel import Target
from perfmodel.base import batch_ratio
from triosim.common.errors import ConfigError
from triosim.common.schema import option

LOSS_NAMES = ("cross_entropy", "nll_loss")
SPLIT = frozenset({"column", "row", "vocab", "head", "gather", "channel"})  # sharded weights
SHARDED = frozenset({"sharded", "loss", "sequence"})  # unsplit operators on 1/N of the data


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


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


class TensorParallel(Extrapolator):
    name = "tp"
    Options = TPOptions
    hybrid_inner = True
    degree_field = "num_gpus"  # the config field that sets the degree (3D: parallelism.tp)

    def check(self):
        o = self.options
        if o.sequence_parallel and o.tp_style != "megatron":
            raise ConfigError(
                "parallelism.sequence_parallel",
                True,
                "false with tp_style 'channel' (sequence parallelism is Megatron's)",
            )
        if len(self.gpus) > 1 and not any(self._is_layer(op) for op in self.ops("forward")):
            raise ConfigError(
                "parallelism.mode",
                "tp",
                "a trace with splittable layers (conv, linear, embedding): none "
                "is marked tp_split and reads a weight in this trace",
            )
        self._plan()
        if len(self.gpus) > 1:
            self._check_divisible()
            if o.tp_style == "megatron":
                self._check_heads()

    # -- the plan ------------------------------------------------------------------------------
    @property
    def roots(self) -> dict[int, int]:
        """Weight-like tensors -> the parameter each comes from: every weight, and what a
        forward operator makes from one weight-like tensor and nothing that grows with the
        batch, at its size: the bfloat16 cast of a float32 parameter where it is used
        (torchtitan's mixed precision), a view, a transpose, a copy. A layer that reads
        one reads its parameter, so it is split as the parameter's layer would be."""
        got = self.__dict__.get("_roots")
        if got is None:
            T = self.trace.tensors
            got = {t: t for t, x in T.items() if x.category == "weight"}
            for op in self.ops("forward"):
                src = {t for t in op.inputs if t in got}
                if len(src) != 1 or any(T[t].scales_with_batch for t in op.inputs if t not in got):
                    continue
                (w,) = src
                for t in op.outputs:
                    if t not in got and math.prod(T[t].shape) == math.prod(T[w].shape):
                        got[t] = got[w]
            self._roots = got
        return got

    def _is_layer(self, op) -> bool:
        return op.tp_split and any(t in self.roots for t in op.inputs)

    def _weights(self, op) -> list[int]:
        """The weight-like tensors a layer reads (a parameter, or its cast where used)."""
        return [t for t in op.inputs if t in self.roots]

    def _copies(self, fwd) -> None:
        """Forward operators that only copy a split parameter (its cast where used) copy
        each GPU's shard: they run on 1/N, and so does their backward."""
        roots, split = self.roots, {self.roots[t] for t in self._split_weight_like()}
        for op in fwd:
            if (
                op.id not in self.roles
                and op.outputs
                and all(roots.get(t, -1) in split for t in op.outputs)
            ):
                self.roles[op.id] = "sharded"

    def _plan(self):
        """Roles (op id -> role), the backward operators of every layer, and the collectives
        to run before / after each operator."""
        T = self.trace.tensors
        fwd = self.ops("forward")
        self.roles: dict[int, str] = {}
        self.before: dict[int, list[Collective]] = {}
        self.after: dict[int, list[Collective]] = {}
        # tensors that have a gradient: weights, floating tensors computed from them, and
        # floating activations that no operator of the trace makes (an operator missing from
        # the trace, e.g. a flatten the profiler did not record, made them); model inputs,
        # token ids and positions have none
        made = {t for op in fwd for t in op.outputs}
        self._has_grad = {
            t
            for t, x in T.items()
            if x.category == "weight"
            or (x.category == "activation" and t not in made and _floating(x.dtype))
        }
        for op in fwd:
            if any(t in self._has_grad for t in op.inputs):
                self._has_grad.update(t for t in op.outputs if _floating(T[t].dtype))
        if self.options.tp_style == "channel":
            for op in fwd:
                if self._is_layer(op):
                    self.roles[op.id] = "channel"
        else:
            self._megatron_roles(fwd)
        self._copies(fwd)
        self._backward_pairs(fwd)
        if self.options.tp_style == "channel":
            self._channel_collectives()
        else:
            self._megatron_collectives(fwd)

    def _megatron_roles(self, fwd):
        T, roles = self.trace.tensors, self.roles
        readers: dict[int, list[int]] = {}
        for k, op in enumerate(fwd):
            for t in set(op.inputs):
                readers.setdefault(t, []).append(k)
        layer = [self._is_layer(op) for op in fwd]
        users: dict[int, int] = {}  # parameter -> layers that read it (or its cast)
        for k, op in enumerate(fwd):
            if layer[k]:
                for w in {self.roots[t] for t in self._weights(op)}:
                    users[w] = users.get(w, 0) + 1
        embeddings = set()
        for k, op in enumerate(fwd):
            if layer[k] and "embedding" in op.name:
                embeddings.add(k)
                indexed_by_input = any(T[t].category == "input" for t in op.inputs)
                tied = any(users[self.roots[w]] > 1 for w in self._weights(op))
                roles[op.id] = "vocab" if indexed_by_input or tied else "replicated"
        self.loss_op = self.head_op = None
        for k, op in enumerate(fwd):
            if not layer[k] or k in embeddings or op.id in roles:
                continue
            between, end, kind, reached = self._reach(fwd, k, readers, layer)
            inside = set(between) | ({end} if end is not None else set())
            closed = end is not None and all(
                r in inside for t in reached for r in readers.get(t, ())
            )
            if closed and kind == "layer" and end not in embeddings:
                roles[op.id], roles[fwd[end].id] = "column", "row"
                for i in between:
                    roles[fwd[i].id] = "sharded"
            elif closed and kind == "loss":
                roles[op.id] = "head"
                for i in [*between, end]:
                    roles[fwd[i].id] = "loss"
                self.loss_op, self.head_op = fwd[end], op
            else:
                roles[op.id] = "gather"
        if self.options.sequence_parallel:
            ks = [k for k, op in enumerate(fwd) if roles.get(op.id) in ("vocab", "row")]
            last = next((k for k, op in enumerate(fwd) if roles.get(op.id) == "head"), len(fwd))
            for k in range(min(ks, default=len(fwd)) + 1, last):
                op = fwd[k]
                if op.id not in roles and not layer[k] and "embedding" not in op.name:
                    roles[op.id] = "sequence"

    def _reach(self, fwd, k, readers, layer):
        """Follow layer fwd[k]'s outputs forward through operators that are not layers, in
        trace order, up to the first layer or loss operator that reads them. Returns (the
        operators passed, that operator's position or None, 'layer' | 'loss' | None, the
        tensors reached)."""
        T = self.trace.tensors
        keep = ("weight", "gradient", "optimizer_state")
        reached = {t for t in fwd[k].outputs if T[t].category not in keep}
        heap = sorted({r for t in reached for r in readers.get(t, ()) if r > k})
        seen, between = set(heap), []
        while heap:
            j = heapq.heappop(heap)
            op = fwd[j]
            if layer[j]:
                return between, j, "layer", reached
            if any(s in op.name for s in LOSS_NAMES):
                return between, j, "loss", reached
            between.append(j)
            for t in op.outputs:
                reached.add(t)
                for r in readers.get(t, ()):
                    if r > j and r not in seen:
                        seen.add(r)
                        heapq.heappush(heap, r)
        return between, None, None, reached

    def _backward_pairs(self, fwd):
        """Group backward operators by the layer they differentiate and give every backward
        operator its forward operator's role."""
        trace, roles = self.trace, self.roles
        layer_ids = {op.id for op in fwd if self._is_layer(op)}
        owners: dict[int, set] = {}  # a weight-like tensor (and its parameter) -> layers
        for op in fwd:
            if op.id in layer_ids:
                for w in self._weights(op):
                    owners.setdefault(w, set()).add(op.id)
                    owners.setdefault(self.roots[w], set()).add(op.id)
        self.bwd_of: dict[int, list] = {}
        self.orphans = []  # split backward operators no layer claims
        self._orphan_ids = set()
        first_layer_bwd = None
        for op in trace.operators:
            if op.phase != "backward":
                continue
            f = op.fwd_id
            if f is None and op.tp_split:
                mine = set().union(*(owners.get(t, set()) for t in op.inputs))
                f = mine.pop() if len(mine) == 1 else None
            if f is not None and f in roles:
                roles[op.id] = roles[f]
            if f in layer_ids:
                self.bwd_of.setdefault(f, []).append(op)
                if first_layer_bwd is None:
                    first_layer_bwd = op
            elif op.tp_split:
                self.orphans.append(op)
                self._orphan_ids.add(op.id)
            if self.options.tp_style == "channel" and first_layer_bwd is not None:
                # after the first layer's backward every gradient is a channel shard
                if roles.get(op.id) != "channel":
                    roles[op.id] = "sharded"

    # -- bytes ---------------------------------------------------------------------------------
    def activation_bytes(self, tensor_ids) -> float:
        r = batch_ratio(self.trace, Target(batch_size=self.batch))
        return sum(
            self.trace.tensors[t].nbytes * r
            for t in set(tensor_ids)
            if self.trace.tensors[t].scales_with_batch
        )

    def loss_bytes(self) -> float:
        """One fp32 value per token (a row of the head's logits): each of the vocabulary-
        parallel cross-entropy's all-reduces."""
        T = self.trace.tensors
        logits = T[max(self.head_op.outputs, key=lambda t: T[t].nbytes)]
        tokens = math.prod(logits.shape[:-1]) if len(logits.shape) >= 2 else 1
        if logits.scales_with_batch:
            tokens *= batch_ratio(self.trace, Target(batch_size=self.batch))
        return 4.0 * tokens

    def _in(self, op):
        """(bytes of the layer's input activations, whether they have a gradient)."""
        ins = [t for t in op.inputs if self.trace.tensors[t].category != "weight"]
        return self.activation_bytes(ins), any(t in self._has_grad for t in ins)

    def _out(self, op) -> float:
        return self.activation_bytes(op.outputs)

    def _add(self, where, op, kind, nbytes, tag, phase):
        algo = self.collective if f"{kind}:{self.collective}" in collectives.ALGORITHMS else "ring"
        c = Collective(
            kind,
            self.ring,
            nbytes,
            f"tp:{op.id}:{tag}",
            layer=op.layer,
            phase=phase,
            algorithm=algo,
        )
        where.setdefault(op.id, []).append(c)

    # -- collectives ---------------------------------------------------------------------------
    def _column_groups(self, fwd) -> dict:
        """Column-parallel layers by the activation they read: several that read one input
        (Llama's separate Q, K and V projections; its gate and up projections) take it in
        once and give its gradient back once, as Megatron's fused QKV and gate/up layers do
        and as torchtitan's module-level input does (the partial gradients are summed on
        each GPU before one all-reduce). first layer -> (the layers, their backward ops)."""
        pos = {op.id: k for k, op in enumerate(self.trace.operators)}
        groups: dict = {}
        for op in fwd:
            if self.roles.get(op.id) in ("column", "head", "gather"):
                data = [t for t in op.inputs if t not in self.roots]
                groups.setdefault(data[0] if data else ("op", op.id), []).append(op)
        out = {}
        for ops in groups.values():
            bwd = sorted(
                (b for op in ops for b in self.bwd_of.get(op.id, [])), key=lambda b: pos[b.id]
            )
            out[ops[0].id] = (ops, bwd)
        return out

    def _megatron_collectives(self, fwd):
        sp = self.options.sequence_parallel
        B, A = self.before, self.after
        pos_embedding = any(r == "replicated" for r in self.roles.values())
        columns = self._column_groups(fwd)
        for op in fwd:
            role = self.roles.get(op.id)
            if role not in SPLIT:
                continue
            bwd = self.bwd_of.get(op.id, [])
            first, last = (bwd[0], bwd[-1]) if bwd else (None, None)
            nin, grad = self._in(op)
            nout = self._out(op)
            if role in ("column", "head", "gather"):
                if op.id in columns:  # the first of the layers that read this input
                    _, both = columns[op.id]
                    first, last = (both[0], both[-1]) if both else (None, None)
                    if sp:
                        self._add(B, op, "all_gather", nin, "gather-input", "forward")
                        if first is not None:
                            self._add(B, first, "all_gather", nin, "regather-input", "backward")
                        if last is not None and grad:
                            self._add(A, last, "reduce_scatter", nin, "input-grad", "backward")
                    elif last is not None and grad:
                        self._add(A, last, "allreduce", nin, "input-grad", "backward")
                if role == "gather":
                    self._add(A, op, "all_gather", nout, "gather-output", "forward")
            elif role == "row":
                if sp:
                    self._add(A, op, "reduce_scatter", nout, "output", "forward")
                    if first is not None:
                        self._add(B, first, "all_gather", nout, "output-grad", "backward")
                else:
                    self._add(A, op, "allreduce", nout, "output", "forward")
            elif role == "vocab":
                if sp and not pos_embedding:
                    self._add(A, op, "reduce_scatter", nout, "output", "forward")
                else:
                    self._add(A, op, "allreduce", nout, "output", "forward")
                if sp and first is not None:
                    self._add(B, first, "all_gather", nout, "output-grad", "backward")
        if self.loss_op is not None:
            for name in ("max-logit", "target-logit", "sum-exp"):
                self._add(A, self.loss_op, "allreduce", self.loss_bytes(), name, "forward")
        if sp:
            self._sequence_grads(fwd)
        self._orphan_collectives("allreduce")

    def _sequence_grads(self, fwd):
        """Sequence parallelism: all-reduce the gradients of weights that each GPU saw only a
        part of the sequence with, before the optimizer (Megatron's layernorm-grads reduce)."""
        T = self.trace.tensors
        partial = set()
        for op in fwd:
            role = self.roles.get(op.id)
            if role == "sequence":
                partial.update(self._weights(op))
            elif role == "row":
                partial.update(w for w in self._weights(op) if len(T[w].shape) < 2)
        nbytes = sum(T[w].nbytes for w in partial)
        if nbytes:
            ops = self.trace.operators
            at = next((op for op in ops if op.phase == "optimizer"), None)
            if at is not None:
                self._add(self.before, at, "allreduce", nbytes, "sequence-grads", "backward")
            else:
                self._add(self.after, ops[-1], "allreduce", nbytes, "sequence-grads", "backward")

    def _channel_collectives(self):
        for op in self.ops("forward"):
            if self.roles.get(op.id) != "channel":
                continue
            self._add(self.after, op, "all_gather", self._out(op), "output", "forward")
            bwd = self.bwd_of.get(op.id, [])
            nin, grad = self._in(op)
            if bwd and grad:
                self._add(self.after, bwd[-1], "reduce_scatter", nin, "input-grad", "backward")
        self._orphan_collectives("reduce_scatter")

    def _orphan_collectives(self, kind):
        """A split backward operator that no layer claims (a trace without fwd_id pairing):
        reduce what it outputs at the batch's scale (its input gradient), as a layer would."""
        for op in self.orphans:
            nbytes = self._out(op)
            if nbytes > 0:
                self._add(self.after, op, kind, nbytes, "input-grad", "backward")

    # -- weights -------------------------------------------------------------------------------
    def _check_divisible(self):
        n, T = len(self.gpus), self.trace.tensors
        for op in self.ops("forward"):
            role = self.roles.get(op.id)
            if role not in SPLIT or role in ("vocab", "head"):
                continue  # vocabularies are padded to a multiple of N (Megatron's
                # make-vocab-size-divisible-by), tied or not
            axis, what = (1, "input") if role == "row" else (0, "output")
            dims = {T[w].shape[axis] for w in self._weights(op) if len(T[w].shape) >= 2}
            for d in sorted(dims):
                if d % n:
                    raise ConfigError(
                        self.degree_field,
                        n,
                        f"a tensor-parallel degree dividing layer "
                        f"{op.layer or op.name}'s {d} {what} units (op {op.id}): "
                        f"each GPU takes an equal shard",
                    )

    def _split_weight_like(self) -> set[int]:
        """The weight-like tensors split layers read and shard (a row layer's bias whole)."""
        T, out = self.trace.tensors, set()
        for op in self.ops("forward"):
            role = self.roles.get(op.id)
            if role == "row":
                out.update(w for w in self._weights(op) if len(T[w].shape) >= 2)
            elif role in SPLIT:
                out.update(self._weights(op))
        return out

    def _check_heads(self):
        """Megatron splits attention by heads: the degree must divide the query heads and
        the key/value heads (grouped-query attention's groups; Megatron-LM's
        num_attention_heads % tp and num_query_groups % tp). Heads come from the attention
        operator's query, (batch, heads, sequence, head size); key/value heads from the
        projection the key comes from (its outputs / head size), or the query's where one
        projection makes both (GPT-2's fused QKV)."""
        n, T = len(self.gpus), self.trace.tensors
        fwd = self.ops("forward")
        made = {t: op for op in fwd for t in op.outputs}
        for op in fwd:
            if "attention" not in op.name or len(op.inputs) < 3:
                continue
            q, k = T[op.inputs[0]], T[op.inputs[1]]
            if len(q.shape) != 4 or len(k.shape) != 4 or not q.shape[-1]:
                continue
            heads, size = q.shape[1], q.shape[-1]
            from_q = self._projection(op.inputs[0], made)
            from_k = self._projection(op.inputs[1], made)
            kv = k.shape[1]
            if from_k is not None and from_k is not from_q:
                out = T[from_k.outputs[0]].shape[-1] if from_k.outputs else 0
                kv = out // size if out and out % size == 0 else kv
            for what, count in (("attention heads", heads), ("key/value heads", kv)):
                if count % n:
                    raise ConfigError(
                        self.degree_field,
                        n,
                        f"a tensor-parallel degree "
                        f"dividing the {count} {what} of {op.layer or op.name} "
                        f"({heads} query heads, {kv} key/value heads; Megatron "
                        f"splits attention by heads)",
                    )

    def _projection(self, t, made, steps: int = 32):
        """The layer a tensor comes from, following each operator's first batch-sized input
        (views, transposes, the rotary embedding, `type_as`, the repeat of key/value
        heads), or None."""
        T = self.trace.tensors
        for _ in range(steps):
            op = made.get(t)
            if op is None:
                return None
            if self._is_layer(op):
                return op
            t = next((x for x in op.inputs if T[x].scales_with_batch), None)
            if t is None:
                return None
        return None

    def sharded_weights(self) -> set[int]:
        """Weight tensors (parameters) each GPU holds 1/N of."""
        return {self.roots[t] for t in self._split_weight_like()}

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
        roles = getattr(self, "roles", {})
        # outputs of column-parallel layers (and the vocabulary-parallel head, the channel
        # split) and of what runs on 1/N of the data are 1/N of the tensor
        sharded = SHARDED | {"column", "head", "channel"}
        return r / len(self.gpus) if roles.get(op.id) in sharded else r

    def held_weight_bytes(self, gpu) -> float:
        return self.optimizer_fraction() * self.trace.weight_bytes()

    def symmetry(self) -> Symmetry:
        """Every GPU runs the same stream and every collective spans the group: one class."""
        return Symmetry.one_class(self.gpus)

    # -- streams -------------------------------------------------------------------------------
    def streams(self):
        return {(g, "compute"): self._compute(g) for g in self.gpus}

    def _compute(self, gpu):
        if self.compute_runs:
            yield from self._template()  # a generator: nothing is built before it runs
        else:
            yield from self._compute_per_op(gpu)

    def _template(self) -> list:
        """`_compute_per_op`'s tasks, the same for every GPU, built once: the forward and
        backward computes between two collectives as one ComputeRun (the same Compute
        tasks, in the same order), the collectives as they are. The optimizer's computes
        stay Compute tasks (a `hybrid` replica hooks its gradient reduction on the first
        one's phase); the runtime times them with the run before them as before."""
        items = self.__dict__.get("_tasks")
        if items is not None:
            return items
        items, run = [], []
        for task in self._compute_per_op(None):
            if type(task) is Compute and task.phase != "optimizer":
                run.append(task)
                continue
            if run:
                items.append(ComputeRun(run))
                run = []
            items.append(task)
        if run:
            items.append(ComputeRun(run))
        self._tasks = items
        return items

    def _compute_per_op(self, gpu):
        """One task per operator (the straightforward path: `compute_runs = False`)."""
        n = len(self.gpus)
        split = self.target(self.batch_size, tp=n)
        whole = self.target(self.batch_size)
        opt_scale = self.optimizer_fraction()
        comm = n > 1
        for op in self.trace.operators:
            if comm and op.id in self.before:
                yield from self.before[op.id]
            role = self.roles.get(op.id)
            if op.phase == "optimizer":
                yield self.compute(op, split, opt_scale)
            elif role in SHARDED:
                yield self.compute(op, split, 1.0 if op.tp_split else 1.0 / n)
            elif op.tp_split and (role in SPLIT or op.id in self._orphan_ids):
                yield self.compute(op, split)
            else:
                yield self.compute(op, whole)
            if comm and op.id in self.after:
                yield from self.after[op.id]
