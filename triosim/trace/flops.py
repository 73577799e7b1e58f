"""FLOP counts and math modes of training operators, from tensor shapes alone.

One place for the formulas, so the TrioSim CSV importer and the tracer's shape-only path
give the same numbers. A multiply-add is 2 FLOPs. Shapes are tuples of ints; an
operator's tensors come in its schema order (aten::conv2d: input, weight, bias;
aten::linear: input, weight, bias; aten::addmm: bias, mat1, mat2; aten::batch_norm: input,
weight, bias, running_mean, running_var). Standard library only: this module sits on the
lowest floor and runs where the tracer runs.

Convolution and matrix products follow torch.utils.flop_counter (bias additions are not
counted; a convolution's backward is its input gradient plus its weight gradient, each as
many FLOPs as the forward). Everything else is memory-bound, and its FLOPs are an
estimate: a fixed number of FLOPs per element, the constants below (assumptions, chosen by
counting the arithmetic of a straightforward kernel).
"""

from __future__ import annotations

import math
import re

CONV = frozenset(
    {
        "conv1d",
        "conv2d",
        "conv3d",
        "convolution",
        "_convolution",
        "cudnn_convolution",
        "mkldnn_convolution",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
    }
)
MATMUL = frozenset({"linear", "addmm", "mm", "bmm", "matmul", "baddbmm"})
CONV_BACKWARD = frozenset({"Convolution", "CudnnConvolution", "MkldnnConvolution"})
MATMUL_BACKWARD = frozenset({"Addmm", "Mm", "Bmm", "Baddbmm", "Linear"})

# operators that launch no GPU kernel (views, shape changes, host-side scalars), and the
# autograd nodes that pass or reshape their gradient without one
NO_KERNEL = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape_alias",
        "_reshape_alias",
        "t",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "as_strided",
        "flatten",
        "unflatten",
        "alias",
        "detach",
        "view_as",
        "empty",
        "empty_like",
        "empty_strided",
        "lift_fresh",
        "item",
        "_local_scalar_dense",
        "numpy_T",
        "narrow",
    }
)
NO_KERNEL_BACKWARD = frozenset(
    {
        "T",
        "View",
        "UnsafeView",
        "Permute",
        "Transpose",
        "Unsqueeze",
        "Squeeze",
        "Alias",
        "Detach",
        "AccumulateGrad",
        "ReshapeAlias",
        "Clone",
        "Unflatten",
        "Flatten",
    }
)

# forward: FLOPs per element of the larger of the first input and the first output
PER_ELEMENT = {
    "relu": 1,
    "threshold": 1,  # max(x, 0)
    "add": 1,
    "sub": 1,
    "mul": 1,
    "div": 1,
    "neg": 1,
    "abs": 1,
    "exp": 1,
    "log": 1,
    "sqrt": 1,
    "rsqrt": 1,
    "pow": 1,
    "reciprocal": 1,
    "hardtanh": 2,
    "relu6": 2,
    "leaky_relu": 2,
    "clamp": 2,
    "sigmoid": 3,
    "tanh": 3,  # exp, add, divide
    "silu": 4,  # sigmoid + multiply
    "gelu": 8,  # tanh approximation: cube, 2 multiply-adds, tanh, add, 2 multiplies
    "dropout": 2,
    "native_dropout": 2,
    "feature_dropout": 2,  # compare + scale (RNG not counted)
    # training-mode normalisation: sum and sum of squares (3), then x * a + b (2)
    "batch_norm": 5,
    "native_batch_norm": 5,
    "_batch_norm_impl_index": 5,
    "cudnn_batch_norm": 5,
    "_native_batch_norm_legit": 5,
    "layer_norm": 5,
    "native_layer_norm": 5,
    "group_norm": 5,
    "native_group_norm": 5,
    # max, subtract, exp, sum, log/divide: per logit
    "softmax": 5,
    "_softmax": 5,
    "log_softmax": 5,
    "_log_softmax": 5,
    "cross_entropy_loss": 5,
    "nll_loss": 1,
    "mse_loss": 3,  # subtract, square, sum
    "mean": 1,
    "sum": 1,
    "adaptive_avg_pool2d": 1,
    "_adaptive_avg_pool2d": 1,
    "avg_pool2d": 1,
}
# operators that move or create data and compute nothing
ZERO = frozenset(
    {
        "ones_like",
        "zeros_like",
        "empty_like",
        "empty",
        "zeros",
        "ones",
        "fill",
        "zero",
        "copy",
        "to",
        "clone",
        "contiguous",
        "view",
        "reshape",
        "flatten",
        "t",
        "transpose",
        "permute",
        "cat",
        "stack",
        "slice",
        "select",
        "expand",
        "detach",
        "alias",
        "embedding",
        "index_select",
        "unsqueeze",
        "squeeze",
        "split",
        "chunk",
        "_to_copy",
        "set",
    }
)
# backward (autograd node name without "Backward<N>"): FLOPs per element of the input gradient
BACKWARD_PER_ELEMENT = {
    "Relu": 1,
    "Threshold": 1,
    "Hardtanh": 1,
    "LeakyRelu": 2,
    "Sigmoid": 2,
    "Tanh": 2,
    "Silu": 5,
    "Gelu": 10,
    "NativeDropout": 1,
    "Mul": 1,
    "Div": 2,
    "Sub": 1,
    "Add": 0,
    "Neg": 1,
    # dy sums (1), dy * x_hat sums (2), x_hat again (2), dx = a * (dy - c1 - x_hat * c2) (4)
    "CudnnBatchNorm": 9,
    "NativeBatchNorm": 9,
    "BatchNorm": 9,
    "MiopenBatchNorm": 9,
    "NativeLayerNorm": 9,
    "NativeGroupNorm": 9,
    "MaxPool2DWithIndices": 1,
    "MaxPool3DWithIndices": 1,  # scatter into the input gradient
    "AdaptiveAvgPool2D": 1,
    "AvgPool2D": 1,
    "Mean": 1,
    "Sum": 0,  # spread the gradient
    "LogSoftmax": 4,
    "Softmax": 4,
    "NllLoss": 1,
    "MseLoss": 3,
    # views and copies
    "T": 0,
    "View": 0,
    "Reshape": 0,
    "ReshapeAlias": 0,
    "UnsafeView": 0,
    "Permute": 0,
    "Transpose": 0,
    "Expand": 0,
    "Clone": 0,
    "Squeeze": 0,
    "Unsqueeze": 0,
    "ToCopy": 0,
    "AccumulateGrad": 0,
}
# optimizer: foreach ops, FLOPs per element of one tensor list (lerp: sub, mul, add;
# addcmul/addcdiv: mul or div, scale by value, add); tensor lists per call
FOREACH = {
    "add": 1,
    "sub": 1,
    "mul": 1,
    "div": 1,
    "sqrt": 1,
    "neg": 1,
    "lerp": 3,
    "addcmul": 3,
    "addcdiv": 3,
    "copy": 0,
    "zero": 0,
    "maximum": 1,
}
FOREACH_LISTS = {"lerp": 2, "addcmul": 3, "addcdiv": 3}

MATH_MODES = ("float64", "float32", "tf32", "float16", "bfloat16", "float8")

_EVALUATE = "autograd::engine::evaluate_function:"
_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")


def kind(name: str) -> str:
    """A forward op's kind: "aten::relu_" -> "relu", "aten::add_.Tensor" -> "add"."""
    k = name.split("::")[-1].split(".")[0].strip()
    return k[:-1] if k.endswith("_") and not k.endswith("__") else k


def backward_kind(name: str) -> str | None:
    """A backward op's autograd node without its suffix: "...: ConvolutionBackward0" ->
    "Convolution"; None when the name is no autograd node."""
    s = name.split(_EVALUATE)[-1].strip()
    if s == "torch::autograd::AccumulateGrad" or s.endswith("AccumulateGrad"):
        return "AccumulateGrad"
    s = s.split("::")[-1]
    return _BACKWARD_SUFFIX.sub("", s) if _BACKWARD_SUFFIX.search(s) else None


def op_class(name: str) -> str:
    """The class TF32 settings apply to: "conv", "matmul" or "other"."""
    b = backward_kind(name) if "Backward" in name else None
    if b is not None:
        return "conv" if b in CONV_BACKWARD else "matmul" if b in MATMUL_BACKWARD else "other"
    k = kind(name)
    return "conv" if k in CONV else "matmul" if k in MATMUL else "other"


def math_mode(
    cls: str, dtype: str | None, *, cuda: bool, cudnn_tf32: bool = True, matmul_tf32: bool = False
) -> str | None:
    """The math an op ran in: its dtype, except float32 convolutions (when
    torch.backends.cudnn.allow_tf32, PyTorch's default) and float32 matrix products (when
    torch.backends.cuda.matmul.allow_tf32, off by default since PyTorch 1.12) on CUDA,
    which run in TF32. None for a dtype that is no math mode (integers)."""
    if dtype == "float32" and cuda:
        if (cls == "conv" and cudnn_tf32) or (cls == "matmul" and matmul_tf32):
            return "tf32"
    return dtype if dtype in MATH_MODES else None


def numel(shape) -> int:
    return math.prod(shape)


def conv(x, w, out, transposed: bool = False) -> float:
    """2 * N * Cout * (Cin / groups) * kh * kw * Hout * Wout (the weight's shape holds
    Cout, Cin / groups and the kernel; a transposed convolution counts input positions)."""
    spatial = (x if transposed else out)[2:]
    return 2.0 * x[0] * numel(w) * numel(spatial)


def matmul(a, b) -> float:
    """2 * M * N * K for [..., M, K] x [..., K, N] (batch dimensions broadcast)."""
    if len(a) == 1:
        a = (1, *a)
    if len(b) == 1:
        b = (*b, 1)
    batch = max(numel(a[:-2]), numel(b[:-2]))
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def linear(x, w) -> float:
    """2 * M * N * K for input [..., K] and weight [N, K] (M: the leading dimensions)."""
    return 2.0 * numel(x[:-1]) * w[0] * x[-1]


def max_pool(x, out, kernel=None) -> float:
    """One comparison per window element per output; without the kernel size (a trace with
    shapes only) the window is input / output elements per channel, exact for
    non-overlapping pooling (VGG's 2x2 stride 2) and an under-count for overlapping pooling."""
    window = numel(kernel) if kernel else max(1, round(numel(x[2:]) / max(1, numel(out[2:]))))
    return float(numel(out) * window)


def _checked(x: float | None) -> float | None:
    """None for a count that is no finite number >= 0 (shapes that fit no real tensor)."""
    return x if x is None or (math.isfinite(x) and x >= 0) else None


def forward_flops(name: str, inputs, outputs, kernel=None) -> float | None:
    """FLOPs of a forward (or optimizer) op from its input and output shapes in schema
    order; None for an op these formulas do not know."""
    try:
        return _checked(_forward(kind(name), inputs, outputs, kernel))
    except (IndexError, TypeError, ValueError, OverflowError):
        return None  # shapes that do not fit the formula


def _forward(k: str, inputs, outputs, kernel) -> float | None:
    if k in CONV:
        return conv(inputs[0], inputs[1], outputs[0], transposed="transpose" in k)
    if k == "linear":
        return linear(inputs[0], inputs[1])
    if k in ("addmm", "baddbmm"):
        return matmul(inputs[1], inputs[2])
    if k in ("mm", "bmm", "matmul"):
        return matmul(inputs[0], inputs[1])
    if k in ("max_pool2d", "max_pool2d_with_indices", "max_pool3d", "max_pool1d"):
        return max_pool(inputs[0], outputs[0], kernel)
    if k.startswith("_foreach_"):
        return foreach(k[len("_foreach_") :], inputs)
    if k in ZERO:
        return 0.0
    if k in ("adaptive_avg_pool2d", "_adaptive_avg_pool2d", "avg_pool2d", "mean", "sum"):
        return float(numel(inputs[0]) + (numel(outputs[0]) if outputs else 0))
    if k in PER_ELEMENT:
        n = max([numel(s) for s in (*inputs[:1], *outputs[:1])] or [0])
        return float(PER_ELEMENT[k] * n)
    return None


def foreach(op: str, inputs) -> float | None:
    """An optimizer's foreach op over tensor lists flattened into `inputs`: per-element
    FLOPs x the elements of one list. Lists are counted from the name (lerp: 2, addcmul and
    addcdiv: 3), else 2 when the second half of the shapes repeats the first, else 1."""
    if op not in FOREACH:
        return None
    lists = FOREACH_LISTS.get(op)
    if lists is None:
        half = len(inputs) // 2
        lists = 2 if half and len(inputs) % 2 == 0 and inputs[:half] == inputs[half:] else 1
    one = inputs[: len(inputs) // lists] if lists <= len(inputs) else inputs
    return float(FOREACH[op] * sum(numel(s) for s in one))


def backward_flops(
    name: str,
    fwd_flops: float | None = None,
    grad_numel: int | None = None,
    input_grad: bool = True,
) -> float | None:
    """FLOPs of a backward op. Convolution and matrix products: the input gradient (when the
    forward input needs one: not for the batch itself) plus the weight gradient, each the
    forward's FLOPs. Others: BACKWARD_PER_ELEMENT x the elements of the input gradient."""
    b = backward_kind(name)
    if b is None:
        return None
    if b in CONV_BACKWARD or b in MATMUL_BACKWARD:
        return None if fwd_flops is None else _checked(fwd_flops * (2.0 if input_grad else 1.0))
    if b in BACKWARD_PER_ELEMENT and grad_numel is not None:
        try:
            return _checked(float(BACKWARD_PER_ELEMENT[b] * grad_numel))
        except OverflowError:
            return None
    return None
