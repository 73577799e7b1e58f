"""Training precision as the frameworks set it (config section `precision`): the dtype the
data-parallel plans gather weights in and the one they reduce gradients in, over a trace
whose weights are stored in another (the tracer's LLMs: float32 master weights, cast to
bfloat16 where used).

- `params` is FSDP2's `MixedPrecisionPolicy(param_dtype)` (torchtitan's
  `mixed_precision_param`, default bfloat16) or Megatron's `--bf16` module weights: FSDP
  all-gathers move it, the gathered buffers hold it, Megatron's distributed optimizer
  all-gathers its updated parameters in it. The trace's casts of a stored weight to this
  dtype then cost no time (the weight is already in it); with FSDP each all-gather casts the
  GPU's shard first (FSDP2's copy-in), so a cast costs its shard's share.
- `reduce` is FSDP2's `reduce_dtype` (torchtitan's `mixed_precision_reduce`, default
  float32) or Megatron's `grad_reduce_in_fp32`: reduce-scatters, DDP and HSDP all-reduces
  and Megatron's gradient buffer move and hold it. The trace's backward of a weight cast
  (the gradient cast to the stored dtype) stays where the gradient is reduced in another
  dtype than `params`; where it is reduced in `params` it runs on the reduced shard (FSDP)
  or is fused away (Megatron's gradient accumulation into main_grad).

`trace` (the default for both) is the trace's own dtypes: nothing changes. Sizes are
elements x the dtype's bytes, elements from the stored bytes and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from triosim.common.schema import option
from triosim.trace.model import DTYPE_BYTES

Dtype = Literal["trace", "bfloat16", "float16", "float32"]
CASTS = ("aten::to", "aten::_to_copy")  # what a weight cast to the compute dtype is traced as


@dataclass(frozen=True)
class PrecisionOptions:
    params: Dtype = option(
        "trace",
        help="dtype the weights are gathered and computed in: FSDP2's param_dtype "
        "(torchtitan: bfloat16), Megatron's --bf16; trace: the trace's weights' own",
    )
    reduce: Dtype = option(
        "trace",
        help="dtype gradients are reduced in: FSDP2's reduce_dtype (torchtitan: float32), "
        "Megatron's grad_reduce_in_fp32 (float32); trace: the trace's weights' own",
    )

    @property
    def is_trace(self) -> bool:
        return self.params == "trace" and self.reduce == "trace"


class Precision:
    """`PrecisionOptions` over a trace: `gathered(t)` and `reduced(t)` (weight t's bytes in
    the dtype gathers and reductions move), and which operators are weight casts and their
    backward partners (module docstring)."""

    def __init__(self, trace, options: PrecisionOptions | None = None):
        self.options = options or PrecisionOptions()
        self.trace = trace
        o = self.options
        self.weight_casts: set[int] = set()  # forward casts of a stored weight to `params`
        self.grad_casts: set[int] = set()  # their backward partners
        if o.params == "trace":
            return
        tensors = trace.tensors
        for op in trace.operators:
            if op.name not in CASTS or len(op.outputs) != 1:
                continue
            ins = [tensors[i] for i in op.inputs]
            out = tensors[op.outputs[0]]
            if (
                len(ins) == 1
                and ins[0].category == "weight"
                and out.dtype == o.params
                and ins[0].dtype != o.params
            ):
                self.weight_casts.add(op.id)
        self.grad_casts = {op.id for op in trace.operators if op.fwd_id in self.weight_casts}

    def _as(self, t: int, dtype: str) -> float:
        x = self.trace.tensors[t]
        if dtype == "trace" or x.dtype not in DTYPE_BYTES:
            return x.nbytes
        return x.nbytes / DTYPE_BYTES[x.dtype] * DTYPE_BYTES[dtype]

    def gathered(self, t: int) -> float:
        """Weight t's bytes as gathered (in `params`)."""
        return self._as(t, self.options.params)

    def reduced(self, t: int) -> float:
        """Weight t's gradient bytes as reduced (in `reduce`)."""
        return self._as(t, self.options.reduce)

    def cast_scales(self, fsdp_parts: int) -> dict[int, float]:
        """op id -> the factor on its time: a weight cast to `params` runs on the GPU's
        shard where FSDP shards over `fsdp_parts` GPUs (its share), else not at all; its
        backward (the gradient cast back) stays where gradients are reduced in another
        dtype, else runs on the reduced shard (FSDP) or not at all."""
        fsdp = fsdp_parts > 1
        share = 1.0 / fsdp_parts if fsdp else 0.0
        out = dict.fromkeys(self.weight_casts, share)
        if self.options.reduce == self.options.params:
            out.update(dict.fromkeys(self.grad_casts, share))
        return out
