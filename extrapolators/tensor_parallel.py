"""Tensor parallelism: splittable layers (convolution, linear, embedding, matmul) are sharded
over all GPUs; each shard's time comes from the performance model at the shard's size, and
the partial outputs are all-reduced at the layer's end (forward) and the input gradients at
the matching point of the backward pass. Other operators are replicated.

Each GPU holds 1/N of the split weights, so its optimizer step touches
(unsplit + split/N) / all of the weight bytes and its time scales by that fraction.
"""

from __future__ import annotations

from extrapolators.base import Extrapolator
from extrapolators.tasks import Collective
from triosim.errors import ConfigError


class TensorParallel(Extrapolator):
    name = "tp"

    def check(self):
        n = len(self.gpus)
        if n == 1:
            return
        split = [op for op in self.ops("forward") if op.tp_split]
        if not split:
            raise ConfigError("parallelism.mode", "tp",
                              "a trace with splittable layers (conv, linear, embedding); none "
                              "is marked tp_split in this trace")  # fmt: skip
        for op in split:
            dims = [self.trace.tensors[t].shape[0] for t in op.inputs
                    if self.trace.tensors[t].category == "weight" and self.trace.tensors[t].shape]  # fmt: skip
            if dims and max(dims) < n:
                raise ConfigError("num_gpus", n, f"at most {max(dims)}: layer {op.layer or op.name}"
                                  f" (op {op.id}) has only {max(dims)} output units to split")  # fmt: skip

    def _ratio(self) -> float:
        return (
            1.0
            if self.batch is None or not self.trace.batch_size
            else self.batch / self.trace.batch_size
        )

    def activation_bytes(self, tensor_ids) -> float:
        r = self._ratio()
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

    def streams(self):
        return {(g, "compute"): self._compute(g) for g in self.gpus}

    def _compute(self, gpu):
        n = len(self.gpus)
        target = self.target(self.batch if self.plan.batch_size is not None else None, tp=n)
        opt_scale = self.optimizer_fraction()
        for op in self.trace.operators:
            if op.phase == "optimizer":
                yield self.compute(op, target, opt_scale)
                continue
            yield self.compute(op, target)
            if op.tp_split and n > 1:
                size = self.activation_bytes(op.outputs)
                if size > 0:
                    yield Collective("allreduce", self.ring, size, f"tp:{op.id}", layer=op.layer,
                                     phase=op.phase, algorithm=self.plan.collective)  # fmt: skip
