"""Tensor parallelism's collectives: what runs before and after each operator, and its bytes
(tensor_parallel.py says which collectives each style and role gets, and why).
`TPCollectives` (its contract in its docstring) is the part of the plan `TensorParallel`
holds that makes them.
"""

from __future__ import annotations

import math

from extrapolators.communication import collectives
from extrapolators.execution.tasks import Collective
from extrapolators.modes.tp_roles import SPLIT
from perfmodel import Target
from perfmodel.base import batch_ratio


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


class TPCollectives:
    """The collectives of a tensor-parallel plan, made at once from:
      - `planned`, the plan's roles (a tp_roles.TPRoles after its `plan()`): it reads their
        `trace`, `options` (`tp_style`, `sequence_parallel`), forward operators, `roles`,
        `bwd_of`, `orphans`, `loss_op`, `head_op`, `roots` and `weights(op)`, and changes
        none of them;
      - `batch`, the batch each GPU's operators process (the bytes are at its size);
      - `ring`, the TP group in ring order, and `collective`, the algorithm the collectives
        ask for where there is one of that name for their kind (None: ring).
    What it gives: `before` and `after`, op id -> the Collective tasks to run on the
    compute stream before / after that operator (keyed `tp:<op id>:<what>`, over `ring`; a
    3D grid re-keys and re-groups them), and the byte counts they are made of
    (`activation_bytes(tensor ids)`, `loss_bytes()`).
    """

    def __init__(self, planned, batch, ring, collective=None):
        self.trace, self.options = planned.trace, planned.options
        self.roles, self.bwd_of, self.orphans = planned.roles, planned.bwd_of, planned.orphans
        self.loss_op, self.head_op = planned.loss_op, planned.head_op
        self.roots, self._weights = planned.roots, planned.weights
        self.batch, self.ring, self.collective = batch, ring, collective
        self.fwd = planned.fwd
        self._plan(self.fwd)

    def _plan(self, fwd) -> None:
        """`before` and `after` for the planned roles."""
        T = self.trace.tensors
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
            self._channel_collectives()
        else:
            self._megatron_collectives(fwd)

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
        T, roots = self.trace.tensors, self.roots
        partial = set()  # the parameters (a cast's gradient is its parameter's, in its dtype)
        for op in fwd:
            role = self.roles.get(op.id)
            if role == "sequence":
                partial.update(roots[w] for w in self._weights(op))
            elif role == "row":
                partial.update(roots[w] for w in self._weights(op) if len(T[w].shape) < 2)
        nbytes = sum(T[w].nbytes for w in partial)
        if nbytes:
            ops = self.trace.operators
            at = next((op for op in ops if op.phase == "optimizer"), None)
            if at is not None:
                self._add(self.before, at, "allreduce", nbytes, "sequence-grads", "backward")
            else:
                self._add(self.after, ops[-1], "allreduce", nbytes, "sequence-grads", "backward")

    def _channel_collectives(self):
        for op in self.fwd:
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
