"""What an operator asks of a GPU: FLOPs and bytes moved at a target setting, and its
compute and memory roofs on a GPU (perfmodel.units says which units' peak bounds it).

Bytes: the operator's distinct inputs plus its distinct outputs, an in-place operator's
tensor counted as read and written; a backward operator's bytes are its forward operator's,
so that what a tracer records as a backward operator's tensors, which differs between
tracers, does not matter; an embedding reads the rows it gathers, not its table.
"""

from __future__ import annotations

from perfmodel.base import Target, batch_ratio, scales_with_batch
from perfmodel.kinds import op_kind
from perfmodel.units import compute_peak
from triosim.hardware import catalogue as hardware
from triosim.trace import flops as fl
from triosim.trace.model import Operator, Trace


def _scale(trace: Trace, t, r: float, shard: int) -> float:
    return t.nbytes * (r if t.scales_with_batch else 1.0 / shard)


def op_bytes(trace: Trace, op: Operator, target: Target = Target()) -> float:
    """Bytes an operator moves at the target: its distinct inputs plus its distinct outputs
    (an in-place operator's tensor read and written); a backward operator's are its forward
    operator's; an embedding reads only the rows it gathers (its output's size)."""
    r = batch_ratio(trace, target)
    shard = target.tp if op.tp_split else 1
    src = op
    if op.phase == "backward" and op.fwd_id is not None:
        src = trace.op(op.fwd_id)
    family, _ = op_kind(src)
    ins = [trace.tensors[t] for t in dict.fromkeys(src.inputs)]
    outs = [trace.tensors[t] for t in dict.fromkeys(src.outputs)]
    if family == "embedding":  # a gather: indices in, rows out (read and written)
        ins = [t for t in ins if t.category not in ("weight", "buffer")]
        moved = sum(_scale(trace, t, r, shard) for t in ins) + 2 * sum(
            _scale(trace, t, r, shard) for t in outs
        )
        if op is not src:  # its backward also writes the whole gradient table
            moved += sum(
                _scale(trace, trace.tensors[t], r, shard)
                for t in dict.fromkeys(src.inputs)
                if trace.tensors[t].category == "weight"
            )
        return moved
    read = sum(_scale(trace, t, r, shard) for t in ins)
    written = sum(_scale(trace, t, r, shard) for t in outs)
    if not outs and _in_place(src.name):
        # an in-place operator whose trace lists no outputs (a foreach optimizer step)
        # writes its first tensor list back: read / the number of distinct lists it reads
        written = read / _LISTS.get(fl.kind(src.name).removeprefix("_foreach_"), 1)
    return (read + written) * PASSES.get(op_kind(op)[0], 1.0)


def op_signature(trace: Trace, op: Operator) -> tuple:
    """What the calibrated model reads of an operator: its name and phase (its kind,
    perfmodel.kinds), FLOPs, TP split, math, measured time (perfmodel.base.identity_time)
    and kernels, its tensors' shapes, dtypes, bytes and categories and which of them
    repeat (`roofs`), and a backward operator's forward operator's own. Operators of one
    trace with equal signatures take equal times there at any target: a shape-only
    trace's replicated layers repeat each of a layer's signatures once per layer."""
    own = _own_signature(trace, op)
    if op.phase == "backward" and op.fwd_id is not None:
        return own, _own_signature(trace, trace.op(op.fwd_id))
    return own, None


def _own_signature(trace: Trace, op: Operator) -> tuple:
    first: dict = {}  # tensor id -> its place among the operator's distinct tensors
    ins = tuple(first.setdefault(i, len(first)) for i in op.inputs)
    outs = tuple(first.setdefault(i, len(first)) for i in op.outputs)
    t = trace.tensors
    tensors = tuple(
        (tuple(x.shape), x.dtype, x.nbytes, x.category) for x in map(t.__getitem__, first)
    )
    return (
        op.name,
        op.phase,
        op.time,
        op.flops,
        op.kernels,
        op.tp_split,
        op.math,
        ins,
        outs,
        tensors,
    )


def fp8_cast_bytes(trace: Trace, op: Operator, target: Target = Target(), inputs=None) -> float:
    """Bytes TransformerEngine's FP8 casts of a linear's operand move at the target (a
    cast-transpose reads the bfloat16 tensor and writes it twice in FP8: 2 bytes in, 2 out
    per element, twice the tensor's bfloat16 bytes): the forward's activation input (those
    of `inputs`, where given: one not cast before), the backward's output gradient (the
    forward's output's size)."""
    r = batch_ratio(trace, target)
    shard = target.tp if op.tp_split else 1
    if op.phase == "backward" and op.fwd_id is not None:
        tensors = trace.op(op.fwd_id).outputs
    else:
        tensors = op.inputs if inputs is None else inputs
    scaled = [
        trace.tensors[t] for t in dict.fromkeys(tensors) if trace.tensors[t].scales_with_batch
    ]
    return 2 * sum(_scale(trace, t, r, shard) for t in scaled)


# lists of distinct tensors an in-place foreach operator reads (addcmul's two tensors are one
# list, the gradients, read twice)
_LISTS = {"lerp": 2, "addcmul": 2, "addcdiv": 3}
# passes over its tensors a kernel makes beyond reading its inputs and writing its outputs
# once (a backward operator's bytes are its forward operator's): normalisation reads its
# input twice (statistics, then normalising); its backward reads the output gradient and the
# input twice and writes the input gradient (5 passes against the forward's 2); a memory-bound
# backward reads the output gradient and a saved tensor and writes the input gradient (3
# against 2)
PASSES = {
    "norm": 1.5,
    "norm_bwd": 2.5,
    "elementwise_bwd": 1.5,
    "pool_bwd": 1.5,
    "loss_bwd": 1.5,
    "copy_bwd": 1.0,
}


def _in_place(name: str) -> bool:
    k = name.split("::")[-1].split(".")[0].strip()
    return k.endswith("_") and not k.endswith("__")


def op_flops(trace: Trace, op: Operator, target: Target = Target()) -> float:
    flops = op.flops or 0.0
    if flops and scales_with_batch(trace, op):
        flops *= batch_ratio(trace, target)
    return flops / (target.tp if op.tp_split else 1)


def roofs(
    trace: Trace, op: Operator, gpu: hardware.GPU, target: Target = Target(), dtype: str = "float32"
) -> tuple[float, float]:
    """(compute seconds, memory seconds) of an operator at the target on `gpu`: its FLOPs
    over the peak of the units that run it (perfmodel.units), its bytes over the bandwidth."""
    peak = compute_peak(gpu, op_kind(op)[0], op.math or trace.metadata.get("dtype") or dtype)
    return op_flops(trace, op, target) / peak, op_bytes(trace, op, target) / gpu.memory_bandwidth
