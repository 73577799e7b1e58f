"""Operator kinds: which family an operator belongs to (convolution, matrix product,
attention, normalisation, element-wise, optimizer, ...; "none" for an operator that launches
no GPU kernel) and the chain of kinds from the most to the least specific (name, family,
class, all) that the fitted operator models look parameters up along."""

from __future__ import annotations

from triosim.trace import flops as fl
from triosim.trace.model import Operator, Trace

NORM = ("norm",)
POOL = ("pool",)
LOSS = frozenset(
    {
        "cross_entropy_loss",
        "log_softmax",
        "_log_softmax",
        "softmax",
        "_softmax",
        "nll_loss",
        "nll_loss_forward",
        "mse_loss",
    }
)
LOSS_BACKWARD = frozenset({"LogSoftmax", "Softmax", "NllLoss", "MseLoss", "SafeSoftmax"})
COPY = frozenset(
    {
        "to",
        "_to_copy",
        "clone",
        "contiguous",
        "copy",
        "cat",
        "stack",
        "reshape",
        "index_select",
        "gather",
        "repeat",
        "repeat_interleave",
        "ones_like",
        "zeros_like",
        "zero",
        "fill",
        "arange",
        "ones",
        "zeros",
        "full",
    }
)
ATTENTION = ("attention",)
EMBEDDING = frozenset({"embedding"})
COMPUTE_FAMILIES = frozenset(
    {"conv", "conv_bwd", "matmul", "matmul_bwd", "attention", "attention_bwd"}
)


# -- kinds -------------------------------------------------------------------------------------


def op_kind(op: Operator) -> tuple[str, str]:
    """(family, name) of an operator: ("conv", "conv2d"), ("conv_bwd", "Convolution"),
    ("optimizer", "_foreach_addcdiv"), ...; family "none" for an operator with no kernel."""
    if op.phase == "backward":
        b = fl.backward_kind(op.name) or op.name.split(":")[-1].strip()
        if b in fl.NO_KERNEL_BACKWARD:
            return "none", b
        low = b.lower()
        if b in fl.CONV_BACKWARD:
            fam = "conv_bwd"
        elif b in fl.MATMUL_BACKWARD:
            fam = "matmul_bwd"
        elif "attention" in low:
            fam = "attention_bwd"
        elif "norm" in low:
            fam = "norm_bwd"
        elif "pool" in low or b == "Mean":
            fam = "pool_bwd"
        elif b in LOSS_BACKWARD:
            fam = "loss_bwd"
        elif b == "Embedding":
            fam = "embedding_bwd"
        elif b in ("ToCopy", "Cat", "Split", "Slice", "Select", "Expand", "Repeat", "Index"):
            fam = "copy_bwd"
        else:
            fam = "elementwise_bwd"
        return fam, b
    k = fl.kind(op.name)
    if k in fl.NO_KERNEL:
        return "none", k
    if op.phase == "optimizer":
        return "optimizer", k
    if k in fl.CONV:
        return "conv", k
    if k in fl.MATMUL:
        return "matmul", k
    if any(s in k for s in ATTENTION):
        return "attention", k
    if any(s in k for s in NORM):
        return "norm", k
    if any(s in k for s in POOL):
        return "pool", k
    if k in LOSS:
        return "loss", k
    if k in EMBEDDING:
        return "embedding", k
    if k in COPY:
        return "copy", k
    return "elementwise", k


def kind_chain(family: str, name: str) -> list[str]:
    """The keys of a kind from the most to the least specific: name, family, class, all."""
    cls = "compute" if family in COMPUTE_FAMILIES else "memory"
    return [f"{family}/{name}", family, cls, "all"]


def launches_no_kernel(trace: Trace, op: Operator, family: str) -> bool:
    if family == "none":
        return True
    if op.phase == "backward" and not op.outputs:  # passes its gradient on (AddBackward)
        return True
    # the optimizer's step counters: host-side scalars unless the optimizer is capturable
    if op.phase == "optimizer":
        ts = [trace.tensors[t] for t in op.inputs + op.outputs]
        if ts and all(len(t.shape) == 0 for t in ts):
            return True
    return False


def conv_variant(trace: Trace, op: Operator, family: str) -> str:
    """A convolution's family refined by its geometry, which its FLOPs and bytes do not
    tell: "conv/3x3", "conv_bwd/7x7/stem" (the kernel; "stem" where the input has 3
    channels, an image's). Equal FLOPs and bytes reach different shares of the roof by
    kernel size and input channels (benchmarks/kind_misses.py: over the real H100 traces,
    1x1 convolutions ran +19 % faster than one efficiency per family predicts, 3x3 -11 %,
    the stems -38 to -63 %). Other families, and a convolution without a 4-D weight among
    its inputs, keep `family`."""
    if family not in ("conv", "conv_bwd"):
        return family
    t = trace.tensors
    w = next((t[i] for i in op.inputs if t[i].category == "weight" and len(t[i].shape) == 4), None)
    if w is None:
        return family
    kernel = "x".join(map(str, w.shape[2:]))
    return f"{family}/{kernel}" + ("/stem" if w.shape[1] == 3 else "")


def base_family(family: str) -> str:
    """The family of a refined one ("conv/3x3" -> "conv")."""
    return family.split("/", 1)[0]
