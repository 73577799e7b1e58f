"""Import the original TrioSim (Go) CSV pair: trace.csv + tensor.csv.

Format (see shared/README.md): times in microseconds (we use
Operator_cudatimenooverlap, the sum of kernel time), tensor lists like "[4; 6; 8]",
sizes in elements. tensor.csv repeats a row per use; the category is decided over
all of a tensor's rows, since the last row of a weight may call it "input".
"""

from __future__ import annotations

import csv
from pathlib import Path

from triosim.errors import TraceError
from triosim.trace import Operator, Tensor, Trace

TRACE_COLUMNS = (
    "OperatorID", "OperatorName", "Operator_input", "Operator_output",
    "Operator_cudatimenooverlap", "stage",
)  # fmt: skip
TENSOR_COLUMNS = ("TensorID", "TensorShape", "TensorNumElement", "TensorEachByte", "TensorType")
_WEIGHT_TYPES = {"weight", "bias", "bias=None"}
_BUFFER_TYPES = {"running_mean", "running_var"}
_DTYPE_BY_SIZE = {8: "float64", 4: "float32", 2: "float16", 1: "int8"}
_STAGES = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}


def import_triosim_csv(folder_or_trace, tensor_csv=None, batch_size: int | None = None) -> Trace:
    """Read trace.csv and tensor.csv (a folder holding both, or the two paths)."""
    p = Path(folder_or_trace)
    trace_csv = p / "trace.csv" if p.is_dir() else p
    tensor_csv = Path(tensor_csv) if tensor_csv else trace_csv.with_name("tensor.csv")
    op_rows = _read(trace_csv, TRACE_COLUMNS)
    tensor_rows = _read(tensor_csv, TENSOR_COLUMNS)

    types: dict[int, set[str]] = {}
    info: dict[int, tuple] = {}
    for row, rec in enumerate(tensor_rows, start=2):
        tid = _int(rec["TensorID"], tensor_csv, row, "TensorID")
        shape = _id_list(rec["TensorShape"].replace(",", ";"), tensor_csv, row, "TensorShape")
        n = _int(rec["TensorNumElement"], tensor_csv, row, "TensorNumElement")
        each = _int(rec["TensorEachByte"], tensor_csv, row, "TensorEachByte")
        types.setdefault(tid, set()).add(rec["TensorType"].strip())
        info[tid] = (tuple(shape), n, each)  # keep the last row, as the original does

    ops = []
    produced_in: dict[int, str] = {}
    for row, rec in enumerate(op_rows, start=2):
        stage = rec["stage"].strip()
        if stage not in _STAGES:
            raise TraceError(f"unknown stage {stage!r}; allowed: forward, backward, optimizer",
                             file=trace_csv, row=row, field="stage")  # fmt: skip
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
                raise TraceError(f"tensor id {tid} is not defined in {tensor_csv.name}",
                                 file=trace_csv, row=row, field=field)  # fmt: skip
        for tid in op.outputs:
            produced_in.setdefault(tid, op.phase)
        ops.append(op)

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
    # the original trace has no layer names; number the forward ops so per-layer tables work
    for op in ops:
        op.layer = f"op{op.id}"
    meta = {
        "source": f"TrioSim CSV import of {trace_csv}",
        "time_column": "Operator_cudatimenooverlap",
    }
    if batch_size is None and ops and ops[0].inputs and tensors[ops[0].inputs[0]].shape:
        batch_size = tensors[ops[0].inputs[0]].shape[0]
    if batch_size is not None:
        meta["batch_size"] = int(batch_size)
    if not ops:
        raise TraceError("the trace has no operators", file=trace_csv)
    return Trace(ops, tensors, meta).validate(file=trace_csv)


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
        raise TraceError(f"expected a finite number >= 0, got {v!r}", file=path, row=row,
                         field=field)  # fmt: skip
    return x


def _id_list(v: str, path, row, field) -> list[int]:
    s = (v or "").strip()
    if not (s.startswith("[") and s.endswith("]")):
        raise TraceError(f"expected a list like [1; 2; 3], got {v!r}", file=path, row=row,
                         field=field)  # fmt: skip
    body = s[1:-1].strip()
    return [_int(x, path, row, field) for x in body.split(";")] if body else []
