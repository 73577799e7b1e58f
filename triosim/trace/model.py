"""The trace data model: one training iteration on one GPU.

A `Trace` holds operators (in issue order) and the tensors they read and write.
Times are seconds, sizes bytes. The on-disk format is described in
docs/trace-format.md; `load`/`save` read and write it, `import_triosim_csv`
reads the original TrioSim CSV pair.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from triosim.common.errors import TraceError
from triosim.trace.flops import MATH_MODES, op_class

FORMAT_NAME = "triosim-trace"
FORMAT_VERSION = 2
# versions load() reads: 1 has no host columns (their values are then unknown, None)
READABLE_VERSIONS = (1, 2)

PHASES = ("forward", "backward", "optimizer")
CATEGORIES = ("input", "activation", "weight", "gradient", "optimizer_state", "buffer")
# Categories whose size grows with the batch; the others (weights, their gradients,
# optimizer states, buffers: running statistics and views of weights) keep their size.
BATCH_SCALED = frozenset({"input", "activation"})

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8": 1,
    "complex64": 8,
}

MAX_OP_TIME = 1e6  # seconds (11 days): a larger operator time is a unit mistake, not a trace
OPERATOR_COLUMNS = ("id", "name", "layer", "phase", "time", "inputs", "outputs", "flops")
OPERATOR_OPTIONAL = ("fwd_id", "kernels", "tp_split", "math") + (
    "host_time",
    "host_start",
    "sync",
    "gpu_idle",
    "host_wait",
)
# the optional operator columns in seconds (None: unknown)
HOST_COLUMNS = ("host_time", "host_start", "gpu_idle", "host_wait")
TENSOR_COLUMNS = ("id", "shape", "dtype", "nbytes", "category")
TENSOR_OPTIONAL = ("name", "storage")


@dataclass(slots=True)
class Tensor:
    id: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: float
    category: str
    # what the tensor is in the model, where the tracer knows: a parameter's name for a weight
    # and its gradient ("layers.0.attention.wq.weight"), "<parameter>.<state>" for an
    # optimizer state ("layers.0.attention.wq.weight.exp_avg"), a buffer's name; else None
    name: str | None = None
    # the memory it lives in: tensors that are views of one another (a reshape, a transpose,
    # an in-place op's result) share it and are one allocation; None: its own
    storage: int | None = None

    @property
    def scales_with_batch(self) -> bool:
        # a 0-d tensor (a loss, a step count, a learning rate) has no batch dimension: the
        # optimizer's element-wise operators read such scalars and must not grow with it
        return self.category in BATCH_SCALED and len(self.shape) > 0


@dataclass(slots=True)
class Operator:
    id: int
    name: str
    layer: str
    phase: str
    time: float  # measured GPU time, seconds
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: float | None = None  # None when unknown
    fwd_id: int | None = None  # for a backward op: the forward op it differentiates
    kernels: int = 1  # GPU kernels launched (for per-kernel overhead models)
    tp_split: bool = False  # splittable by tensor parallelism (conv, linear, embedding, matmul)
    math: str | None = None  # math mode ("tf32", "float32", ...); None: the trace's dtype
    # the host side of the profiled iteration (docs/trace-format.md; None: unknown):
    host_time: float | None = None  # seconds the issuing thread spent in the operator
    host_start: float | None = None  # its host start, seconds after the first operator's
    sync: bool = False  # the host waits for the GPU in it (item, a copy to the host, ...)
    gpu_idle: float | None = None  # GPU idle time just before each of its kernels, seconds
    host_wait: float | None = None  # the part of gpu_idle before the kernel was launched


@dataclass
class Trace:
    operators: list[Operator]
    tensors: dict[int, Tensor]
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        # worked out once, on first use: a trace's operators and tensors are not changed
        # after it is made (a changed trace is a new Trace, as the modes' views are)
        self._by_id = None
        self._weight_bytes = None

    # -- convenience -------------------------------------------------------------
    @property
    def batch_size(self) -> int | None:
        return self.metadata.get("batch_size")

    @property
    def total_time(self) -> float:
        return math.fsum(op.time for op in self.operators)

    def op(self, op_id: int) -> Operator:
        if self._by_id is None:
            self._by_id = {o.id: o for o in self.operators}
        return self._by_id[op_id]

    def weights(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.category == "weight"]

    def weight_bytes(self) -> float:
        """Bytes of the weights (asked per GPU: 131,072 sums of every tensor were 10 s)."""
        if self._weight_bytes is None:
            self._weight_bytes = math.fsum(t.nbytes for t in self.weights())
        return self._weight_bytes

    def validate(self, file=None) -> Trace:
        validate(self, file)
        return self


# -- validation ------------------------------------------------------------------


def validate(trace: Trace, file=None) -> None:
    """Raise TraceError naming the file, row and field of the first problem."""
    _validate_metadata(trace.metadata, file)
    for row, t in enumerate(trace.tensors.values()):
        if t.category not in CATEGORIES:
            raise TraceError(
                f"unknown category {t.category!r}; allowed: {', '.join(CATEGORIES)}",
                file=file,
                row=row,
                field="category",
            )
        if not _finite_nonneg(t.nbytes):
            raise TraceError(
                f"bytes must be a finite number >= 0, got {t.nbytes!r}",
                file=file,
                row=row,
                field="nbytes",
            )
    seen: set[int] = set()
    for row, op in enumerate(trace.operators):
        if op.id in seen:
            raise TraceError(f"duplicated operator id {op.id}", file=file, row=row, field="id")
        seen.add(op.id)
        if op.phase not in PHASES:
            raise TraceError(
                f"unknown phase {op.phase!r}; allowed: {', '.join(PHASES)}",
                file=file,
                row=row,
                field="phase",
            )
        if not _finite_nonneg(op.time) or op.time > MAX_OP_TIME:
            raise TraceError(
                f"time must be a number of seconds in [0, {MAX_OP_TIME:g}], got {op.time!r}",
                file=file,
                row=row,
                field="time",
            )
        if op.flops is not None and not _finite_nonneg(op.flops):
            raise TraceError(
                f"flops must be a finite number >= 0, got {op.flops!r}",
                file=file,
                row=row,
                field="flops",
            )
        if op.math is not None and op.math not in MATH_MODES:
            raise TraceError(
                f"unknown math mode {op.math!r}; allowed: {', '.join(MATH_MODES)}",
                file=file,
                row=row,
                field="math",
            )
        _validate_host(op, file, row)
        for fname in ("inputs", "outputs"):
            for tid in getattr(op, fname):
                if tid not in trace.tensors:
                    raise TraceError(
                        f"tensor id {tid} is not defined in the tensor table",
                        file=file,
                        row=row,
                        field=fname,
                    )
    phase_before: dict[int, str] = {}
    for row, op in enumerate(trace.operators):
        if op.fwd_id is not None:
            if op.fwd_id not in seen:
                raise TraceError(
                    f"fwd_id {op.fwd_id} names no operator", file=file, row=row, field="fwd_id"
                )
            # backward -> an earlier forward op only: this rules out cycles
            if op.phase != "backward" or phase_before.get(op.fwd_id) != "forward":
                raise TraceError(
                    f"fwd_id {op.fwd_id} must pair a backward operator with an "
                    "earlier forward operator (a cycle or a wrong pairing)",
                    file=file,
                    row=row,
                    field="fwd_id",
                )
        phase_before[op.id] = op.phase


def _validate_host(op: Operator, file, row: int) -> None:
    """The host columns: None (unknown) or a finite number of seconds >= 0; host_wait
    within gpu_idle; sync a boolean."""
    for f in HOST_COLUMNS:
        v = getattr(op, f)
        if v is not None and (not _finite_nonneg(v) or v > MAX_OP_TIME):
            raise TraceError(
                f"{f} must be null or a number of seconds in [0, {MAX_OP_TIME:g}], got {v!r}",
                file=file,
                row=row,
                field=f,
            )
    if op.host_wait is not None and op.gpu_idle is not None and op.host_wait > op.gpu_idle:
        raise TraceError(
            f"host_wait {op.host_wait!r} exceeds gpu_idle {op.gpu_idle!r}",
            file=file,
            row=row,
            field="host_wait",
        )
    if not isinstance(op.sync, bool):
        raise TraceError(
            f"sync must be true or false, got {op.sync!r}", file=file, row=row, field="sync"
        )


def _validate_metadata(md: dict, file) -> None:
    """The metadata fields a run computes with: counts whole numbers >= 1, names text."""
    for f in ("batch_size", "seq_len"):
        v = md.get(f)
        if v is not None and not (_finite_nonneg(v) and v >= 1 and float(v).is_integer()):
            raise TraceError(
                f"{f} must be a whole number >= 1, got {v!r}", file=file, field=f"metadata.{f}"
            )
    for f in ("gpu", "dtype"):
        v = md.get(f)
        if v is not None and not isinstance(v, str):
            raise TraceError(f"{f} must be text, got {v!r}", file=file, field=f"metadata.{f}")


ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"  # the end of an autograd node's name


def no_trace() -> Trace:
    """The trace of a run that has none: a workload that carries its own times (parallelism
    mode chakra) runs no traced operator, so there is nothing to time or to hold."""
    return Trace(operators=[], tensors={}, metadata={"no_trace": True})


def trace_stats(trace: Trace) -> dict:
    """How much of what the extrapolators and models use the trace carries: backward ops
    paired with their forward op (fwd_id; AccumulateGrad nodes, which have none, are not
    counted), ops with a FLOP count, ops with a math mode."""
    ops = trace.operators
    # AccumulateGrad nodes add a leaf's gradient into its .grad: no forward op made them, so
    # there is nothing to pair (their gradient is ready when they end, which DDP reads)
    bwd = [o for o in ops if o.phase == "backward" and not o.name.endswith(ACCUMULATE_GRAD)]
    paired = sum(o.fwd_id is not None for o in bwd)
    counted = [o for o in ops if o.flops is not None]
    # conv and matmul ops (forward and backward) with FLOPs: those whose math mode matters
    compute = [o for o in counted if op_class(o.name) != "other"]
    return {
        "operators": len(ops),
        "backward_operators": len(bwd),
        "backward_paired": paired,
        "pairing": paired / len(bwd) if bwd else None,
        "operators_with_flops": len(counted),
        "flops_coverage": len(counted) / len(ops) if ops else None,
        "total_flops": math.fsum(o.flops for o in counted),
        "operators_with_math": sum(o.math is not None for o in ops),
        "conv_matmul_operators": len(compute),
        "conv_matmul_with_math": sum(o.math is not None for o in compute),
    }


def fidelity_warnings(trace: Trace) -> list[str]:
    """One line per result that a trace lacking pairing, FLOPs or math modes makes less
    faithful, naming the result and how many operators are concerned; [] when none."""
    s = trace_stats(trace)
    out = []
    unpaired = s["backward_operators"] - s["backward_paired"]
    if unpaired:
        out.append(
            f"{unpaired} of {s['backward_operators']} backward operators have no forward "
            "pairing (fwd_id): DDP overlap treats the gradients of their weights as ready "
            "only after the last backward operator that reads them, or at the end of the "
            "backward pass; tensor parallelism cannot give them their forward layer's "
            "sharding role; pipeline stages place them by the tensors they read"
        )
    missing = s["operators"] - s["operators_with_flops"]
    if missing:
        split = sum(o.flops is None and o.tp_split for o in trace.operators)
        out.append(
            f"{missing} of {s['operators']} operators have no FLOP count ({split} of them "
            "splittable by tensor parallelism): roofline scaling to another GPU falls back "
            "to the memory-bandwidth ratio for them, and TP sharding cannot shrink their "
            "compute"
        )
    no_math = s["conv_matmul_operators"] - s["conv_matmul_with_math"]
    if no_math:
        dtype = trace.metadata.get("dtype", "float32")
        out.append(
            f"{no_math} of {s['conv_matmul_operators']} convolution and matrix-product "
            f"operators have no math mode: roofline scaling assumes {dtype} peaks for "
            "them (if they ran in TF32 on the traced GPU, their per-kind efficiency "
            "comes out above 1 and other GPUs are mispredicted)"
        )
    return out


def host_stats(trace: Trace) -> dict:
    """The host side of a trace's iteration, from its host columns (docs/trace-format.md),
    as Holistic Trace Analysis' idle-time breakdown: the GPU's span (first kernel's start to
    last kernel's end) = the operators' GPU time + the GPU's idle time, and the idle time =
    host wait (no kernel launched yet: the host is behind) + kernel gap (launched, not yet
    running: launch latency, queueing). Shares are of the span. Seconds; None where the
    trace lacks the columns (a trace made before them, or a CPU trace)."""
    ops = trace.operators
    fsum = math.fsum
    gpu = fsum(o.time for o in ops)
    with_host = [o for o in ops if o.host_time is not None]
    with_idle = [o for o in ops if o.gpu_idle is not None and o.host_wait is not None]
    out = {
        "operators": len(ops),
        "operators_with_host_time": len(with_host),
        "sync_operators": sum(o.sync for o in ops),
        "gpu_time": gpu,
        "host_time": fsum(o.host_time for o in with_host) if with_host else None,
        "gpu_idle": None,
        "host_wait": None,
        "kernel_gap": None,
        "gpu_span": None,
        "idle_share": None,
        "host_wait_share": None,
        "kernel_gap_share": None,
    }
    if not with_idle:
        return out
    idle = fsum(o.gpu_idle for o in with_idle)
    wait = fsum(o.host_wait for o in with_idle)
    span = gpu + idle
    share = (lambda x: x / span) if span > 0 else (lambda x: 0.0)
    out.update(
        gpu_idle=idle,
        host_wait=wait,
        kernel_gap=idle - wait,
        gpu_span=span,
        idle_share=share(idle),
        host_wait_share=share(wait),
        kernel_gap_share=share(idle - wait),
    )
    return out


def _finite_nonneg(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


# -- the project's own format --------------------------------------------------------


def _open(path: Path, mode: str):
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def save(trace: Trace, path) -> Path:
    """Write a trace as JSON (gzip-compressed when the name ends in .gz), whole: written
    beside `path`, then renamed over it."""
    path = Path(path)
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "metadata": trace.metadata,
        "tensors": {
            "columns": list(TENSOR_COLUMNS + TENSOR_OPTIONAL),
            "rows": [
                [t.id, list(t.shape), t.dtype, t.nbytes, t.category, t.name, t.storage]
                for t in trace.tensors.values()
            ],
        },
        "operators": {
            "columns": list(OPERATOR_COLUMNS + OPERATOR_OPTIONAL),
            "rows": [
                [
                    o.id,
                    o.name,
                    o.layer,
                    o.phase,
                    o.time,
                    list(o.inputs),
                    list(o.outputs),
                    o.flops,
                    o.fwd_id,
                    o.kernels,
                    o.tp_split,
                    o.math,
                    o.host_time,
                    o.host_start,
                    o.sync,
                    o.gpu_idle,
                    o.host_wait,
                ]
                for o in trace.operators
            ],
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    from triosim.common.outputs import replacing

    with replacing(path) as tmp, _open(tmp, "w") as f:  # whole, or the old file stays
        json.dump(doc, f, separators=(",", ":"))
    return path


def load(path, progress: bool = False) -> Trace:
    """Read and validate a trace written by `save` (or the tracer)."""
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("*.trace.json*"))
        if not candidates:
            raise TraceError("folder holds no *.trace.json or *.trace.json.gz file", file=path)
        path = candidates[0]
    try:
        with _open(path, "r") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise TraceError("no such file", file=path) from None
    except (json.JSONDecodeError, EOFError, OSError, UnicodeDecodeError) as e:
        raise TraceError(f"not a readable trace (truncated or not JSON): {e}", file=path) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise TraceError(
            f'not a triosim trace (expected "format": "{FORMAT_NAME}")', file=path, field="format"
        )
    version = doc.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise TraceError(
            f"format_version {version!r} is not supported; this triosim reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}",
            file=path,
            field="format_version",
        )
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise TraceError("metadata must be an object", file=path, field="metadata")
    tensors = {}
    for row, rec in _rows(doc, "tensors", TENSOR_COLUMNS, TENSOR_OPTIONAL, path, False):
        t = Tensor(
            id=_int(rec, "id", path, row),
            shape=tuple(_int_list(rec, "shape", path, row)),
            dtype=_str(rec, "dtype", path, row),
            nbytes=_num(rec, "nbytes", path, row),
            category=_str(rec, "category", path, row),
            name=_optional_str(rec, "name", path, row),
            storage=_optional_int(rec, "storage", path, row),
        )
        if t.id in tensors:
            raise TraceError(f"duplicated tensor id {t.id}", file=path, row=row, field="id")
        tensors[t.id] = t
    ops = []
    for row, rec in _rows(doc, "operators", OPERATOR_COLUMNS, OPERATOR_OPTIONAL, path, progress):
        flops = rec.get("flops")
        fwd = rec.get("fwd_id")
        ops.append(
            Operator(
                id=_int(rec, "id", path, row),
                name=_str(rec, "name", path, row),
                layer=_str(rec, "layer", path, row),
                phase=_str(rec, "phase", path, row),
                time=_num(rec, "time", path, row),
                inputs=tuple(_int_list(rec, "inputs", path, row)),
                outputs=tuple(_int_list(rec, "outputs", path, row)),
                flops=None if flops is None else _num(rec, "flops", path, row),
                fwd_id=None if fwd is None else _int(rec, "fwd_id", path, row),
                kernels=_optional_kernels(rec, path, row),
                tp_split=_optional_bool(rec, "tp_split", path, row),
                math=_optional_str(rec, "math", path, row),
                sync=_optional_bool(rec, "sync", path, row),
                **{f: _optional_num(rec, f, path, row) for f in HOST_COLUMNS},
            )
        )
    if not ops:
        raise TraceError("the trace has no operators", file=path, field="operators")
    _kernels_launched(ops, metadata)
    return Trace(ops, tensors, metadata).validate(file=path)


def _rows(doc, table, required, optional, path, progress) -> Iterable[tuple[int, dict]]:
    tab = doc.get(table)
    if not isinstance(tab, dict) or "columns" not in tab or "rows" not in tab:
        raise TraceError(
            f"missing table '{table}' with 'columns' and 'rows'", file=path, field=table
        )
    cols = tab["columns"]
    for c in required:
        if c not in cols:
            raise TraceError(f"missing column '{c}' in table '{table}'", file=path, field=c)
    rows = tab["rows"]
    if progress:
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (CI logs, pipes)
        rows = tqdm(
            rows, desc=f"loading {table}", unit="row", leave=False, disable=None, mininterval=0.5
        )
    for row, values in enumerate(rows):
        if not isinstance(values, list) or len(values) != len(cols):
            raise TraceError(
                f"{table} row has {len(values) if isinstance(values, list) else 0}"
                f" values, expected {len(cols)}",
                file=path,
                row=row,
            )
        yield row, dict(zip(cols, values, strict=True))


def _num(rec, f, path, row) -> float:
    v = rec.get(f)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"expected a number, got {v!r}", file=path, row=row, field=f)
    if not math.isfinite(v) or v < 0:
        raise TraceError(f"expected a finite number >= 0, got {v!r}", file=path, row=row, field=f)
    return float(v)


def _int(rec, f, path, row) -> int:
    v = rec.get(f)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"expected an integer, got {v!r}", file=path, row=row, field=f)
    return v


def _str(rec, f, path, row) -> str:
    v = rec.get(f)
    if not isinstance(v, str):
        raise TraceError(f"expected a string, got {v!r}", file=path, row=row, field=f)
    return v


def _optional_kernels(rec, path, row) -> int:
    v = rec.get("kernels", 1)
    if v is None:
        return 1
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(
            f"expected an integer >= 0, got {v!r}", file=path, row=row, field="kernels"
        )
    return v


def _kernels_launched(ops: list, metadata: dict) -> None:
    """A GPU trace timed by its kernels (the tracer's and imported profiles') gives an
    operator that launched none (a CPU scalar's item(), an AccumulateGrad that takes the
    gradient as it is, a view) time 0; tracers before kernels could be 0 wrote 1 for it.
    Read it as 0, so the host model charges no launch for it."""
    timed_by_kernels = "kernel" in str(metadata.get("time_source") or "")
    if not (timed_by_kernels and str(metadata.get("device") or "").startswith("cuda")):
        return
    for op in ops:
        if op.time == 0 and op.kernels == 1:
            op.kernels = 0


def _optional_bool(rec, f, path, row) -> bool:
    v = rec.get(f, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise TraceError(f"expected true or false, got {v!r}", file=path, row=row, field=f)
    return v


def _optional_num(rec, f, path, row) -> float | None:
    return None if rec.get(f) is None else _num(rec, f, path, row)


def _optional_int(rec, f, path, row) -> int | None:
    return None if rec.get(f) is None else _int(rec, f, path, row)


def _optional_str(rec, f, path, row) -> str | None:
    v = rec.get(f)
    if v is not None and not isinstance(v, str):
        raise TraceError(f"expected a string or null, got {v!r}", file=path, row=row, field=f)
    return v


def _int_list(rec, f, path, row) -> list[int]:
    v = rec.get(f)
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise TraceError(f"expected a list of integers, got {v!r}", file=path, row=row, field=f)
    return v
