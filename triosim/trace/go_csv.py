"""Import the original TrioSim (Go) CSV pair: trace.csv + tensor.csv.

Format (the original TrioSim's sample traces): times in microseconds (we use
Operator_cudatimenooverlap, the sum of kernel time), tensor lists like "[4; 6; 8]",
sizes in elements. tensor.csv repeats a row per use; the category is decided over
all of a tensor's rows, since the last row of a weight may call it "input".

The CSV records no forward/backward pairing, FLOPs or math mode; the importer adds them:
backward ops are paired with their forward op by name and shared tensors
(`pair_backward`), FLOPs come from the recorded shapes (triosim.trace.flops), and the math mode
from PyTorch's defaults on CUDA unless told otherwise.

`import_triosim_csv` runs the steps in order, each a function of what the one before
gave: the tensor rows (`_tensor_rows`), the operator rows (`_operators`, which refuses a
tensor id tensor.csv does not define), each tensor's category (`_tensors`), the pairing,
FLOPs and math modes, and the metadata (`_metadata`). An error names the file, the row
and the field, the first one met in that order.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from triosim.common.errors import ConfigError, TraceError
from triosim.hardware import catalogue as hardware
from triosim.trace import flops as fl
from triosim.trace.model import Operator, Tensor, Trace

TRACE_COLUMNS = (
    "OperatorID",
    "OperatorName",
    "Operator_input",
    "Operator_output",
    "Operator_cudatimenooverlap",
    "stage",
)
TENSOR_COLUMNS = ("TensorID", "TensorShape", "TensorNumElement", "TensorEachByte", "TensorType")
_WEIGHT_TYPES = {"weight", "bias", "bias=None"}
_BUFFER_TYPES = {"running_mean", "running_var"}
_DTYPE_BY_SIZE = {8: "float64", 4: "float32", 2: "float16", 1: "int8"}
_STAGES = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}
_STORAGE_COLUMNS = ("TensorStorgeid", "TensorStorageid", "TensorStorageID")  # sic, the original
# The Go traces come from PyTorch 2.1 on an H100 with default settings:
# torch.backends.cudnn.allow_tf32 = True (convolutions in TF32) and
# torch.backends.cuda.matmul.allow_tf32 = False (matrix products in float32, PyTorch >= 1.12).
PYTORCH_DEFAULT_MATH = {"conv": "tf32", "matmul": "float32", "other": "float32"}

# autograd node (backward_kind) -> the forward kinds it can differentiate
BACKWARD_OF = {
    "Convolution": fl.CONV,
    "CudnnConvolution": fl.CONV,
    "MkldnnConvolution": fl.CONV,
    "Addmm": {"linear", "addmm", "matmul"},
    "Mm": {"linear", "mm", "matmul"},
    "Bmm": {"bmm", "matmul", "baddbmm"},
    "Baddbmm": {"baddbmm"},
    "Linear": {"linear"},
    "T": {"linear", "t"},
    "Relu": {"relu", "threshold"},
    "Threshold": {"relu", "threshold"},
    "Hardtanh": {"hardtanh", "relu6"},
    "NativeBatchNorm": {
        "batch_norm",
        "native_batch_norm",
        "_batch_norm_impl_index",
        "_native_batch_norm_legit",
    },
    "CudnnBatchNorm": {"batch_norm", "cudnn_batch_norm", "_batch_norm_impl_index"},
    "MiopenBatchNorm": {"batch_norm", "_batch_norm_impl_index"},
    "NativeLayerNorm": {"layer_norm", "native_layer_norm"},
    "NativeGroupNorm": {"group_norm", "native_group_norm"},
    "MaxPool2DWithIndices": {"max_pool2d", "max_pool2d_with_indices"},
    "MaxPool3DWithIndices": {"max_pool3d", "max_pool3d_with_indices"},
    "AdaptiveAvgPool2D": {"adaptive_avg_pool2d", "_adaptive_avg_pool2d"},
    "AvgPool2D": {"avg_pool2d"},
    "Mean": {"mean", "adaptive_avg_pool2d"},
    "NativeDropout": {"dropout", "native_dropout", "feature_dropout"},
    "LogSoftmax": {"log_softmax", "_log_softmax", "cross_entropy_loss"},
    "Softmax": {"softmax", "_softmax"},
    "NllLoss": {"nll_loss", "cross_entropy_loss"},
    "Embedding": {"embedding"},
}


def import_triosim_csv(
    folder_or_trace,
    tensor_csv=None,
    batch_size: int | None = None,
    *,
    gpu: str | None = None,
    math: dict | None = None,
) -> Trace:
    """Read trace.csv and tensor.csv (a folder holding both, or the two paths).

    gpu: the GPU the trace was taken on (a catalogue name), recorded as metadata["gpu"].
    math: the math mode of the float32 operators per class, {"conv": ..., "matmul": ...,
    "other": ...}; unset classes keep PyTorch's defaults on CUDA (PYTORCH_DEFAULT_MATH).
    """
    modes = _math_modes(math)
    meta_gpu = hardware.gpu(gpu).name if gpu is not None else None
    p = Path(folder_or_trace)
    trace_csv = p / "trace.csv" if p.is_dir() else p
    tensor_csv = Path(tensor_csv) if tensor_csv else trace_csv.with_name("tensor.csv")
    op_rows = _read(trace_csv, TRACE_COLUMNS)
    tensor_rows = _read(tensor_csv, TENSOR_COLUMNS)

    types, info, storage = _tensor_rows(tensor_rows, tensor_csv)
    ops, produced_in = _operators(op_rows, trace_csv, info, tensor_csv)
    tensors = _tensors(ops, types, info, produced_in)
    # the original trace has no layer names; number the forward ops so per-layer tables work
    for op in ops:
        op.layer = f"op{op.id}"
    by_id = {op.id: op for op in ops}
    for b, f in pair_backward(ops, tensors, storage).items():
        by_id[b].fwd_id = f
        by_id[b].layer = by_id[f].layer
    _add_flops(ops, by_id, tensors)
    for op in ops:
        op.math = _op_math(op, tensors, modes)
    meta = _metadata(trace_csv, modes, math, meta_gpu, batch_size, ops, tensors)
    if not ops:
        raise TraceError("the trace has no operators", file=trace_csv)
    return Trace(ops, tensors, meta).validate(file=trace_csv)


def _tensor_rows(tensor_rows, tensor_csv):
    """Per tensor id: the types its rows give it (a set), (shape, elements, bytes each)
    from its last row, and its storage id where the CSV has one."""
    types: dict[int, set[str]] = {}
    info: dict[int, tuple] = {}
    storage: dict[int, int] = {}
    for row, rec in enumerate(tensor_rows, start=2):
        tid = _int(rec["TensorID"], tensor_csv, row, "TensorID")
        shape = _id_list(rec["TensorShape"].replace(",", ";"), tensor_csv, row, "TensorShape")
        n = _int(rec["TensorNumElement"], tensor_csv, row, "TensorNumElement")
        each = _int(rec["TensorEachByte"], tensor_csv, row, "TensorEachByte")
        types.setdefault(tid, set()).add(rec["TensorType"].strip())
        info[tid] = (tuple(shape), n, each)  # keep the last row, as the original does
        col = next((c for c in _STORAGE_COLUMNS if rec.get(c) not in (None, "")), None)
        if col is not None:
            storage[tid] = _int(rec[col], tensor_csv, row, col)
    return types, info, storage


def _operators(op_rows, trace_csv, info, tensor_csv):
    """The operators in trace order (no layer yet), and per tensor the phase of the first
    operator that produced it; every tensor an operator names must be in `info`."""
    ops = []
    produced_in: dict[int, str] = {}
    for row, rec in enumerate(op_rows, start=2):
        stage = rec["stage"].strip()
        if stage not in _STAGES:
            raise TraceError(
                f"unknown stage {stage!r}; allowed: forward, backward, optimizer",
                file=trace_csv,
                row=row,
                field="stage",
            )
        t_us = _num(rec["Operator_cudatimenooverlap"], trace_csv, row, "Operator_cudatimenooverlap")
        name = rec["OperatorName"].strip()
        op = Operator(
            id=_int(rec["OperatorID"], trace_csv, row, "OperatorID"),
            name=name,
            layer="",
            phase=_STAGES[stage],
            time=t_us * 1e-6,
            inputs=tuple(_id_list(rec["Operator_input"], trace_csv, row, "Operator_input")),
            outputs=tuple(_id_list(rec["Operator_output"], trace_csv, row, "Operator_output")),
            tp_split=str(rec.get("tpflag", "0")).strip() == "1",
        )
        for tid in op.inputs + op.outputs:
            if tid not in info:
                field = "Operator_input" if tid in op.inputs else "Operator_output"
                raise TraceError(
                    f"tensor id {tid} is not defined in {tensor_csv.name}",
                    file=trace_csv,
                    row=row,
                    field=field,
                )
        for tid in op.outputs:
            produced_in.setdefault(tid, op.phase)
        ops.append(op)
    return ops, produced_in


def _tensors(ops, types, info, produced_in) -> dict:
    """{id: Tensor}, each given its category from all of its rows' types and from the
    operators that read and write it (the CSV names no gradient or optimizer state)."""
    first_inputs = set(ops[0].inputs) if ops else set()
    weight_sizes = {info[t][1] for t, k in types.items() if k & _WEIGHT_TYPES}
    # a backward output the size of some weight is that weight's gradient (the CSV has
    # no gradient type); without this, weight gradients would wrongly grow with the batch
    # (only ops of weighted layers; the first of several outputs is the input's gradient)
    grads = {
        t
        for o in ops
        if o.phase == "backward" and (o.tp_split or "Norm" in o.name)
        for t in (o.outputs[1:] if len(o.outputs) > 1 else o.outputs)
        if info[t][1] in weight_sizes and not types[t] & _WEIGHT_TYPES
    }
    optimizer_inputs = {t for o in ops if o.phase == "optimizer" for t in o.inputs}
    tensors = {}
    for tid, (shape, n, each) in info.items():
        kinds = types[tid]
        if kinds & _WEIGHT_TYPES:
            cat = "weight"
        elif kinds & _BUFFER_TYPES:
            cat = "buffer"
        elif tid in grads or (tid in optimizer_inputs and produced_in.get(tid) == "backward"):
            cat = "gradient"
        elif tid in optimizer_inputs and tid not in produced_in:
            cat = "optimizer_state"
        elif produced_in.get(tid) == "optimizer":
            cat = "optimizer_state"
        elif "target" in kinds or (tid in first_inputs and tid not in produced_in):
            cat = "input"
        else:
            cat = "activation"
        tensors[tid] = Tensor(
            tid, shape, _DTYPE_BY_SIZE.get(each, f"{each}B"), float(n * each), cat
        )
    return tensors


def _metadata(trace_csv, modes, math, meta_gpu, batch_size, ops, tensors) -> dict:
    """The trace's metadata: its source, the math modes and where they come from, the GPU
    (when given) and the batch size (given, else the first operator's first input's first
    dimension, when there is one)."""
    meta = {
        "source": f"TrioSim CSV import of {trace_csv}",
        "time_column": "Operator_cudatimenooverlap",
        "math": modes,
        "math_source": "given to the importer"
        if math
        else "assumed: PyTorch defaults on CUDA (cudnn.allow_tf32 = True: convolutions in TF32; "
        "cuda.matmul.allow_tf32 = False: matrix products in float32)",
    }
    if meta_gpu is not None:
        meta["gpu"] = meta_gpu
    if batch_size is None and ops and ops[0].inputs and tensors[ops[0].inputs[0]].shape:
        batch_size = tensors[ops[0].inputs[0]].shape[0]
    if batch_size is not None:
        meta["batch_size"] = int(batch_size)
    return meta


def pair_backward(ops, tensors, storage=None) -> dict[int, int]:
    """{backward op id: forward op id}. Autograd runs backward ops in reverse order of their
    forward ops; each backward op is paired with a forward op whose kind it differentiates
    (BACKWARD_OF, or the same name: GeluBackward0 <-> aten::gelu) and which no backward op
    of the same node kind has taken yet, preferring, in order: one reading a weight the
    backward op reads or writes (by tensor id, or by storage id: AddmmBackward0 reads the
    transposed view of the linear layer's weight); the one sharing most tensors with it
    (its saved inputs); the latest before it (walking the forward list in reverse)."""
    storage = storage or {}
    weights = {t for t, x in tensors.items() if x.category == "weight" and x.nbytes > 0}
    weight_of_storage = {storage[t]: t for t in weights if t in storage}
    pos, kinds, readers = {}, defaultdict(list), defaultdict(list)
    for i, op in enumerate(ops):
        if op.phase == "forward":
            pos[op.id] = i
            kinds[fl.kind(op.name)].append(op)
            for t in dict.fromkeys(op.inputs + op.outputs):
                if tensors[t].nbytes > 0:  # not an undefined tensor (0 elements)
                    readers[t].append(op)
    taken: dict[int, set[str]] = defaultdict(set)
    pairs: dict[int, int] = {}
    for i, b in enumerate(ops):
        node = fl.backward_kind(b.name) if b.phase == "backward" else None
        if node is None:
            continue
        allowed = BACKWARD_OF.get(node, {k for k in kinds if k.replace("_", "") == node.lower()})

        def ok(f, node=node, allowed=allowed, i=i):
            return pos[f.id] < i and node not in taken[f.id] and fl.kind(f.name) in allowed

        touched = [t for t in dict.fromkeys(b.inputs + b.outputs) if tensors[t].nbytes > 0]
        own = {t for t in touched if t in weights}
        own |= {
            weight_of_storage[storage[t]] for t in touched if storage.get(t) in weight_of_storage
        }
        shared: dict[int, int] = defaultdict(int)
        for t in touched:
            for f in readers.get(t, ()):
                if ok(f):
                    shared[f.id] += 1 + 1000 * (t in weights)
        for w in own - set(touched):  # weights reached through a view's storage
            for f in readers.get(w, ()):
                if ok(f):
                    shared[f.id] += 1000
        if shared:
            best = max(shared, key=lambda f: (shared[f], pos[f]))
        else:
            cands = [f for k in allowed for f in kinds.get(k, ()) if ok(f)]
            best = max(cands, key=lambda f: pos[f.id]).id if cands else None
        if best is not None:
            pairs[b.id] = best
            taken[best].add(node)
    return pairs


def _add_flops(ops, by_id, tensors) -> None:
    """FLOPs from the recorded shapes (triosim.trace.flops); a backward op's from its forward op."""
    for op in ops:
        if op.phase != "backward":
            op.flops = fl.forward_flops(
                op.name,
                [tensors[t].shape for t in op.inputs],
                [tensors[t].shape for t in op.outputs],
            )
    for op in ops:
        if op.phase != "backward":
            continue
        f = by_id.get(op.fwd_id)
        if f is not None and f.inputs:
            x = tensors[f.inputs[0]]
            # the batch itself needs no gradient: the first layer computes its weight's only
            op.flops = fl.backward_flops(
                op.name, f.flops, fl.numel(x.shape), input_grad=x.category != "input"
            )
        elif op.outputs:
            op.flops = fl.backward_flops(op.name, None, fl.numel(tensors[op.outputs[0]].shape))


def _op_math(op, tensors, modes) -> str | None:
    """The dtype of the op's largest tensor; for float32, the mode of its class."""
    ts = [tensors[t] for t in op.inputs + op.outputs if tensors[t].dtype in fl.MATH_MODES]
    if not ts:
        return None
    dtype = max(ts, key=lambda t: t.nbytes).dtype
    return modes[fl.op_class(op.name)] if dtype == "float32" else dtype


def _math_modes(math) -> dict:
    modes = dict(PYTORCH_DEFAULT_MATH)
    if math is None:
        return modes
    if not isinstance(math, dict):
        raise ConfigError("math", math, 'a dict such as {"conv": "tf32", "matmul": "float32"}')
    for k, v in math.items():
        if k not in modes:
            raise ConfigError(f"math.{k}", v, f"a key among {', '.join(modes)}")
        if v not in fl.MATH_MODES:
            raise ConfigError(f"math.{k}", v, f"one of {', '.join(fl.MATH_MODES)}")
        modes[k] = v
    return modes


def _read(path: Path, required) -> list[dict]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            cols = [c.strip() for c in (reader.fieldnames or [])]
            for c in required:
                if c not in cols:
                    raise TraceError(f"missing column '{c}'", file=path, row=1, field=c)
            reader.fieldnames = cols
            rows = list(reader)
    except FileNotFoundError:
        raise TraceError("no such file", file=path) from None
    for i, rec in enumerate(rows, start=2):
        if None in rec or any(rec.get(c) is None for c in required):
            raise TraceError("row has the wrong number of values", file=path, row=i)
    return rows


def _int(v: str, path, row, field) -> int:
    try:
        return int(v.strip())
    except (ValueError, AttributeError):
        raise TraceError(
            f"expected an integer, got {v!r}", file=path, row=row, field=field
        ) from None


def _num(v: str, path, row, field) -> float:
    try:
        x = float(v)
    except (ValueError, TypeError):
        raise TraceError(f"expected a number, got {v!r}", file=path, row=row, field=field) from None
    if not (x >= 0 and x != float("inf")):
        raise TraceError(
            f"expected a finite number >= 0, got {v!r}", file=path, row=row, field=field
        )
    return x


def _id_list(v: str, path, row, field) -> list[int]:
    s = (v or "").strip()
    if not (s.startswith("[") and s.endswith("]")):
        raise TraceError(
            f"expected a list like [1; 2; 3], got {v!r}", file=path, row=row, field=field
        )
    body = s[1:-1].strip()
    return [_int(x, path, row, field) for x in body.split(";")] if body else []
