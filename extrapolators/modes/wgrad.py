"""A backward pass split into its input-gradient part (B) and its weight-gradient part (W),
as zero-bubble schedules run them (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024; DeepSeek's DualPipe; torch.distributed.pipelining's BACKWARD_INPUT and
BACKWARD_WEIGHT): B passes the gradient on to the stage before at once, W computes the
weights' gradients later, where the schedule has room.

`weight_grad_shares(trace)`: backward op id -> the share of its time that is W work, for the
ops that have some (absent: all B); `weight_grad_outputs(trace)`: the tensors a split op's W
part makes (the weights' gradients it passes to the all-W ops), which the memory model
counts from the W part's start. Read from the trace's autograd structure:
- a matrix product or a convolution of a weight (or of a tensor made from weights only, as
  a cast) and an activation: its backward runs two products of equal FLOPs, the input's
  gradient and the weight's (dX = dY W, dW = dY^T X; a convolution's with its filter):
  half is W;
- the ops on the weight's side only: the backward of an op whose inputs are all weights or
  made from them (a cast, a transpose of the weight), autograd's `AccumulateGrad` (no
  forward partner), an embedding's backward (its only gradient is the table's), and the
  transpose of the weight's gradient that follows the product (a backward op of that
  product, not its product, whose output goes to one of these): all W;
- everything else (attention, norms, element-wise ops, the products of two activations):
  all B. (A norm's weight gradient, a reduction inside its backward, stays in B: small.)
"""

from __future__ import annotations

from triosim.trace.precision import MATMULS

# products of a weight and an activation (a MoE layer's experts run one batched product;
# a convolution's backward computes its input's and its filter's gradients, equal FLOPs)
PRODUCTS = (*MATMULS, "aten::bmm", "aten::baddbmm", "aten::conv1d", "aten::conv2d")
PRODUCTS += ("aten::conv3d", "aten::convolution", "aten::_convolution")
SPLIT = ("mm", "convolution")  # in the name of the backward op that runs both products


def weight_grad_shares(trace) -> dict[int, float]:
    """Backward op id -> the share of its time that is weight-gradient work (module
    docstring); ops with none are absent."""
    return _split(trace)[0]


def weight_grad_outputs(trace) -> set[int]:
    """The outputs of split ops (part B, part W) that an all-W op reads: the weights'
    gradients, made by the W part."""
    return _split(trace)[1]


def _split(trace) -> tuple[dict[int, float], set[int]]:
    tensors = trace.tensors
    derived = {t for t, x in tensors.items() if x.category == "weight"}
    weight_side: set[int] = set()  # forward ops on weights (or tensors made from them) only
    products: set[int] = set()  # forward products of a weight and an activation
    embeddings: set[int] = set()
    for op in trace.operators:
        if op.phase != "forward" or not op.inputs:
            continue
        mine = [t for t in op.inputs if t in derived]
        if len(mine) == len(op.inputs):
            weight_side.add(op.id)
            derived.update(op.outputs)
        elif mine and op.name in PRODUCTS:
            products.add(op.id)
        elif mine and "embedding" in op.name.lower():
            embeddings.add(op.id)
    shares: dict[int, float] = {}
    backward = [op for op in trace.operators if op.phase == "backward"]
    feeds_w: set[int] = set()  # tensors read by an all-W op
    for op in reversed(backward):  # (a tensor's readers come after its maker)
        f = op.fwd_id
        if f is None or f in weight_side or f in embeddings:
            shares[op.id] = 1.0
        elif f in products and any(k in op.name.lower() for k in SPLIT):
            shares[op.id] = 0.5
        elif f in products and any(t in feeds_w for t in op.outputs):
            shares[op.id] = 1.0  # (the weight gradient's transpose)
        if shares.get(op.id) == 1.0:
            feeds_w.update(op.inputs)
    made_in_w = {
        t for op in backward if shares.get(op.id) == 0.5 for t in op.outputs if t in feeds_w
    }
    return shares, made_in_w
