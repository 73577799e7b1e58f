"""Tensor parallelism: splittable layers (convolution, linear, embedding, matmul) are sharded
over all GPUs; each shard's time comes from the performance model at the shard's size.
Other operators are replicated.

Megatron pairing: a split layer A whose output reaches the next split layer B only through
operators that nothing else reads (attention between QKV and the output projection, GELU
between two MLP linears, BN+ReLU between two convolutions) is column-parallel and B is
row-parallel: the operators between them run on 1/N of the data, B's partial outputs are
all-reduced in forward, and A's input gradients in backward (where the trace pairs
backward operators with forward ones). An unpaired split layer all-reduces its output in
forward and its input gradient in backward.

Each GPU holds 1/N of the split weights, so its optimizer step touches
(unsplit + split/N) / all of the weight bytes and its time scales by that fraction.
"""

from __future__ import annotations

from extrapolators.base import Extrapolator
from extrapolators.tasks import Collective
from perfmodel import Target
from perfmodel.base import batch_ratio
from triosim.errors import ConfigError


class TensorParallel(Extrapolator):
    name = "tp"
    hybrid_inner = True

    def check(self):
        n = len(self.gpus)
        if n == 1:
            return
        split = [op for op in self.ops("forward") if op.tp_split]
        if not split:
            raise ConfigError("parallelism.mode", "tp",
                              "a trace with splittable layers (conv, linear, embedding); none "
                              "is marked tp_split in this trace")  # fmt: skip
        tensors = self.trace.tensors
        # vocabularies are padded to a multiple of the degree (Megatron's
        # make-vocab-size-divisible-by), so an embedding table (tied or not) need not divide
        vocab = {t for op in split if "embedding" in op.name for t in op.inputs
                 if tensors[t].category == "weight"}  # fmt: skip
        for op in split:
            dims = {tensors[t].shape[0] for t in op.inputs if tensors[t].category == "weight"
                    and len(tensors[t].shape) >= 2 and t not in vocab}  # fmt: skip
            for d in sorted(dims):
                if d % n:
                    raise ConfigError("num_gpus", n, f"a tensor-parallel degree dividing layer "
                                      f"{op.layer or op.name}'s {d} output units (op {op.id}): "
                                      f"each GPU takes an equal shard")  # fmt: skip

    def activation_bytes(self, tensor_ids) -> float:
        r = batch_ratio(self.trace, Target(batch_size=self.batch))
        return sum(self.trace.tensors[t].nbytes * r for t in set(tensor_ids)
                   if self.trace.tensors[t].scales_with_batch)  # fmt: skip

    def optimizer_fraction(self) -> float:
        split_w = {t for op in self.ops("forward") if op.tp_split for t in op.inputs
                   if self.trace.tensors[t].category == "weight"}  # fmt: skip
        total = self.trace.weight_bytes()
        if total == 0:
            return 1.0
        split = sum(self.trace.tensors[t].nbytes for t in split_w)
        return ((total - split) + split / len(self.gpus)) / total

    def op_batch(self):
        return self.batch  # every GPU processes the whole batch, on its shard of the layers

    def activation_ratio(self, op) -> float:
        r = super().activation_ratio(op)
        roles = getattr(self, "roles", {})
        # column-parallel outputs and what runs between the pair are 1/N of the tensor
        return r / len(self.gpus) if roles.get(op.id) in ("column", "sharded") else r

    def held_weight_bytes(self, gpu) -> float:
        return self.optimizer_fraction() * self.trace.weight_bytes()

    def streams(self):
        self._plan_pairs()
        return {(g, "compute"): self._compute(g) for g in self.gpus}

    def _plan_pairs(self):
        """Mark forward ops: 'column' (A), 'row' (B), 'sharded' (between), and backward ops
        by their forward op's role. Unmarked split ops keep the all-reduce-output default."""
        ops = self.trace.operators
        fwd = [op for op in ops if op.phase == "forward"]
        readers: dict[int, list[int]] = {}
        for k, op in enumerate(fwd):
            for t in op.inputs:
                readers.setdefault(t, []).append(k)
        role: dict[int, str] = {}
        k = 0
        while k < len(fwd):
            a = fwd[k]
            if not a.tp_split or a.id in role:
                k += 1
                continue
            reached = {t for t in a.outputs if self.trace.tensors[t].scales_with_batch}
            between, b, j = [], None, k + 1
            while j < len(fwd) and reached:
                op = fwd[j]
                if set(op.inputs) & reached:
                    if op.tp_split:
                        b = j
                        break
                    between.append(j)
                    reached |= set(op.outputs)
                j += 1
            # the sharded tensors must not escape: read only by ops between A and B, or by B
            inside = set(between) | ({b} if b is not None else set())
            ok = b is not None and all(r in inside for t in reached for r in readers.get(t, ()))
            if ok:
                role[a.id] = "column"
                role[fwd[b].id] = "row"
                for i in between:
                    role[fwd[i].id] = "sharded"
                k = b + 1
            else:
                k += 1
        for op in ops:
            if op.phase == "backward" and op.fwd_id in role:
                role[op.id] = role[op.fwd_id]
        self.roles = role

    def _compute(self, gpu):
        n = len(self.gpus)
        target = self.target(self.batch_size, tp=n)
        opt_scale = self.optimizer_fraction()
        for op in self.trace.operators:
            if op.phase == "optimizer":
                yield self.compute(op, target, opt_scale)
                continue
            role = self.roles.get(op.id)
            yield self.compute(op, target, 1.0 / n if role == "sharded" else 1.0)
            if n == 1 or not (op.tp_split or role):
                continue
            if role is None or (op.phase, role) in (("forward", "row"), ("backward", "column")):
                size = self._reduced_bytes(op)
            else:
                size = 0.0  # column forward / row backward / sharded: stays local
            if size > 0:
                yield Collective("allreduce", self.ring, size, f"tp:{op.id}", layer=op.layer,
                                 phase=op.phase, algorithm=self.collective)  # fmt: skip

    def _reduced_bytes(self, op) -> float:
        """Forward: the layer's output. Backward: its input gradient, the size of the forward
        op's input activations where the pairing is known (a backward op's own outputs also
        hold weight-gradient temporaries)."""
        if op.phase == "backward" and op.fwd_id is not None:
            return self.activation_bytes(self.trace.op(op.fwd_id).inputs)
        return self.activation_bytes(op.outputs)
