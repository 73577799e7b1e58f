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
  (the gradient cast to the stored dtype, per micro-batch) costs nothing once `params` is
  set: the gradient is accumulated in `params` (FSDP2's unsharded .grad) or into float32
  inside the product (Megatron's gradient_accumulation_fusion); FSDP2's cast to the reduce
  dtype at each reduce-scatter (once per unit and step) is not charged.

- `matmul: float8` is TransformerEngine's FP8 recipe (Megatron-Core's `--fp8-format`,
  torchtitan's Float8Linear): the transformer blocks' linear layers (ops in a numbered layer,
  `layers.N`, with a weight operand; with a mixture of experts their grouped GEMMs, traced
  as `aten::bmm` over the experts' stacked weights, as TransformerEngine's GroupedLinear
  runs them; not the output projection, not the attention) run their forward product and
  both backward products (input and weight gradients) in FP8, each with a cast of its
  operand to FP8 (cast-transpose: 2 bytes read and 2 written per element, at the GPU's
  memory bandwidth): the forward's activation input, the backward's output gradient. The
  GPU's float8 peak over its bfloat16 one scales the products (the same share of the peak
  as in bfloat16: an assumption; no FP8 kernel was measured here).

`trace` (the default for all) is the trace's own dtypes: nothing changes. Sizes are
elements x the dtype's bytes, elements from the stored bytes and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from triosim.common.schema import option
from triosim.trace.flops import NO_KERNEL_BACKWARD, backward_kind
from triosim.trace.model import DTYPE_BYTES

Dtype = Literal["trace", "bfloat16", "float16", "float32"]
CASTS = ("aten::to", "aten::_to_copy")  # what a weight cast to the compute dtype is traced as
MATMULS = ("aten::linear", "aten::mm", "aten::matmul", "aten::addmm")  # TE's Linear's products
# with a weight operand, the routed experts' grouped GEMMs (TE's GroupedLinear): FP8 too
GROUPED = ("aten::bmm",)


def in_numbered_block(layer: str) -> bool:
    """A layer of a numbered block (`layers.3.attention.wq`), not the model's head."""
    return any(p.isdigit() for p in layer.split("."))


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

    matmul: Literal["trace", "float8"] = option(
        "trace",
        help="float8: the blocks' linear layers in FP8 as TransformerEngine runs them "
        "(forward and both backward products, with their casts); trace: as traced",
    )

    @property
    def is_trace(self) -> bool:
        return self.params == "trace" and self.reduce == "trace" and self.matmul == "trace"


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
        self.fp8: set[int] = set()  # the FP8 products: blocks' linears and their backward
        self.fp8_inputs: dict[int, tuple] = {}  # forward FP8 op -> the inputs it casts
        if o.matmul == "float8":
            linear = {  # a product with a weight operand (an attention's has none)
                op.id
                for op in trace.operators
                if op.phase == "forward"
                and (op.name in MATMULS or op.name in GROUPED)
                and in_numbered_block(op.layer)
                and any(not trace.tensors[i].scales_with_batch for i in op.inputs)
            }
            # their backward products; the linear's view and transpose nodes (attributed to
            # it by the tracer) launch no kernel and cast nothing
            back = {
                op.id
                for op in trace.operators
                if op.fwd_id in linear and backward_kind(op.name) not in NO_KERNEL_BACKWARD
            }
            self.fp8 = linear | back
            # each activation is cast once: wq, wk and wv (TE's fused QKV), w1 and w3 read
            # one input, cast by the first of them
            cast: set = set()
            for op in trace.operators:
                if op.id in linear:
                    mine = tuple(
                        t
                        for t in dict.fromkeys(op.inputs)
                        if trace.tensors[t].scales_with_batch and t not in cast
                    )
                    cast.update(mine)
                    self.fp8_inputs[op.id] = mine
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
        backward (the gradient cast back) not at all."""
        fsdp = fsdp_parts > 1
        share = 1.0 / fsdp_parts if fsdp else 0.0
        out = dict.fromkeys(self.weight_casts, share)
        # the gradient comes out of the backward product in `params` and is accumulated
        # there (FSDP2: the unsharded .grad) or into float32 inside the product (Megatron's
        # gradient_accumulation_fusion): no cast per micro-batch (FSDP2's copy-in to the
        # reduce dtype, once per unit and reduce-scatter, is not charged)
        out.update(dict.fromkeys(self.grad_casts, 0.0))
        return out
