"""Import a user's own PyTorch profile: an Execution Trace (ExecutionTraceObserver) and the
Kineto JSON that torch.profiler wrote for the same iteration, recorded with no triosim code
in the loop, into a triosim Trace.

The tracer's linker (tracer.linking) reads ranges the collector puts around the model
("## forward ##", "## mark weight ... ##", "## module ... ##"); a user's profile has none,
so this module finds the same facts from what plain PyTorch records, then reuses the
linker's steps (kernel times by External id, backward-to-forward pairing by autograd
sequence number, tensor numbering, FLOPs from shapes, math modes):

- **Iteration**: the ET node "ProfilerStep#N" (torch.profiler's schedule) and the Kineto
  range of the same name; with several, the last one both files hold (or `step=N`). Node
  ids grow in execution order across threads, so the iteration's nodes are those from its
  ProfilerStep node's id to the next one's.
- **Operators and phases**: the outermost operators of the iteration. Backward: the
  autograd engine's "autograd::engine::evaluate_function: ..." nodes (on the autograd
  thread on a GPU). Optimizer: those under an "Optimizer.step#..." or
  "Optimizer.zero_grad#..." range (PyTorch's optimizers record them), and those the main
  thread issues after the backward pass (gradient clipping). Forward: the rest.
- **Tensor categories**, from how the iteration uses a tensor (ET tensor id and storage):
  a tensor that exists before the iteration (read before anything made it) and that the
  optimizer reads is a `weight` when the forward or backward pass reads it too, else an
  `optimizer_state` (Adam's moments and step counts); a tensor the optimizer reads that the
  backward pass wrote is a `gradient`; a pre-existing tensor the forward pass reads whose
  first dimension is the batch size is an `input`, any other a `buffer` (running
  statistics, rotary tables); made in the optimizer: `optimizer_state`; the rest:
  `activation`. Views of weights, gradients and states are buffers, as the tracer's.
- **Layers**: from the user's own `record_function` ranges around forward operators where
  the profile has them (the innermost); otherwise inferred: each forward operator that
  reads a weight starts a layer named `<k>.<operator>` (`3.conv2d`), and the operators
  after it that read none belong to it; backward operators take their forward operator's
  layer (AccumulateGrad the layer of the backward operator that made its gradient, or the
  one before it); optimizer operators `optimizer`.
- **Batch size**: given, or the first dimension of the first pre-existing tensor of two or
  more dimensions that the forward pass reads and the optimizer does not, an integer one
  (token ids) first: a language model reads float buffers (a rotary cache) before its
  input ids.
- **Math mode**: dtypes plus PyTorch's CUDA defaults (cuDNN TF32 on, matmul TF32 off),
  stated in `metadata["math_source"]` as an assumption; `cudnn_tf32` / `matmul_tf32`
  override them.

Host time: each operator's CPU span, host start, synchronisation and the GPU's idle time
before its kernels (host wait vs kernel gap) in the trace's host columns
(tracer.host_times, through the linker's _KinetoTimes); totals in metadata["host"].
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

from tracer.et_nodes import EtTree, is_op
from tracer.et_storage import alias_storage
from tracer.linking import (
    _fixed_size_outputs,
    _forward_of_seq,
    _KinetoTimes,
    _op_tensor_values,
    _operators,
    _shape_flops,
    _Tensors,
    set_math,
)
from triosim.common.errors import TraceError
from triosim.trace.model import Trace

SUPPORTED_SCHEMA_MAJOR = "1."
_BACKWARD = "autograd::engine::evaluate_function"
_STEP = "ProfilerStep#"
_OPT_RANGES = ("Optimizer.step#", "Optimizer.zero_grad#")
_ACCUMULATE = "AccumulateGrad"
# at least this share of the iteration's operators must find their Kineto event
MIN_MATCHED = 0.9
_FLOAT_DTYPES = ("float", "double", "c10::Half", "c10::BFloat16")


def read_json(path, what: str) -> dict:
    """A JSON object from `path`, gzip-compressed or not (by its first bytes); TraceError
    naming the file for a missing, truncated or non-JSON file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read the {what} ({e.strerror or e})", file=path) from None
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        doc = json.loads(raw.decode("utf-8"))
    except (EOFError, OSError, zlib.error) as e:
        raise TraceError(f"the {what} is not a complete gzip file ({e})", file=path) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"the {what} is not JSON, or it is cut short ({e})", file=path) from None
    if not isinstance(doc, dict):
        raise TraceError(f"the {what} is not a JSON object", file=path)
    return doc


def import_profile(
    et_path,
    kineto_path,
    *,
    batch_size: int | None = None,
    gpu: str | None = None,
    model: str | None = None,
    step: int | None = None,
    cudnn_tf32: bool | None = None,
    matmul_tf32: bool | None = None,
    metadata: dict | None = None,
    torch_flops: bool = True,
) -> Trace:
    """The triosim Trace of one iteration of a plain PyTorch profile: an Execution Trace
    and a Kineto JSON (either order; gzipped or not). See the module's docstring for what
    is inferred. TraceError for files that cannot be used."""
    a, b = Path(et_path), Path(kineto_path)
    da, db = read_json(a, "Execution Trace"), read_json(b, "Kineto trace")
    if "traceEvents" in da and "nodes" in db:  # given the other way round
        (a, da), (b, db) = (b, db), (a, da)
    if "nodes" not in da:
        raise TraceError("not an Execution Trace (it has no 'nodes')", file=a)
    if "traceEvents" not in db:
        raise TraceError("not a Kineto trace (it has no 'traceEvents')", file=b)
    meta = {
        "model": model or _stem(a),
        "source": {"execution_trace": a.name, "kineto": b.name},
    }
    meta.update(metadata or {})
    return import_pair(
        da,
        db,
        batch_size=batch_size,
        gpu=gpu,
        step=step,
        cudnn_tf32=cudnn_tf32,
        matmul_tf32=matmul_tf32,
        metadata=meta,
        torch_flops=torch_flops,
        files=(a, b),
    )


def _stem(p: Path) -> str:
    name = p.name
    for suffix in (".gz", ".json", ".et", ".pt", "_et", "-et"):
        name = name.removesuffix(suffix)
    return name


def import_pair(
    et: dict,
    kineto: dict,
    *,
    batch_size: int | None = None,
    gpu: str | None = None,
    step: int | None = None,
    cudnn_tf32: bool | None = None,
    matmul_tf32: bool | None = None,
    metadata: dict | None = None,
    torch_flops: bool = True,
    files=(None, None),
) -> Trace:
    """import_profile on the two documents already read (files: their paths, for errors).

    Steps: `_checked_inputs` (schema, kernels, one run), the ET's tree and the profiled
    iteration, operators with their kernels' times and inferred tensors, layers, FLOPs and
    math modes, then `_metadata` (what was inferred and what was assumed)."""
    et_file, k_file = files
    nodes, events = _checked_inputs(et, kineto, et_file, k_file)
    try:
        alias_storage(nodes)  # views share a storage id (rewrites the nodes in place)
        tree = EtTree(nodes)
    except (KeyError, TypeError, AttributeError) as e:
        raise TraceError(f"an Execution Trace node lacks a field ({e})", file=et_file) from None
    step_name, region = _iteration(tree, events, step, et_file, k_file)
    top = _top_level(tree, region)
    if not top:
        raise TraceError(f"no operators in {step_name or 'the profile'}", file=et_file)
    times = _KinetoTimes(kineto, tree, top)
    _check_same_run(tree, top, times, k_file)
    marked, batch, how_batch = _categories(tree, top, batch_size)
    tensors = _Tensors(marked, {})
    flops_of = _torch_flops() if torch_flops else None
    ops = _operators(tree, top, tensors, times, _forward_of_seq(tree, top), True, flops_of)
    if not any(o.time > 0 for o in ops):
        raise TraceError(
            "no kernel of the Kineto trace belongs to an operator of the Execution Trace: "
            "the two files are from different runs, or the profile is CPU-only",
            file=k_file,
        )
    table = tensors.table()
    how_layers = _layers(tree, ops, table)
    _fixed_size_outputs(ops, table)
    _shape_flops(ops, table)
    cudnn = True if cudnn_tf32 is None else cudnn_tf32
    matmul = False if matmul_tf32 is None else matmul_tf32
    set_math(ops, table, cuda=True, cudnn_tf32=cudnn, matmul_tf32=matmul)
    meta = dict(metadata or {})
    meta.update(
        {
            "batch_size": batch,
            "batch_size_source": how_batch,
            "gpu": gpu or _kineto_gpu(kineto),
            "et_schema": str(et.get("schema", "")),
            "profiled_step": step_name,
            "layers_source": how_layers,
            "host": _host_totals(tree, top, times, events, step_name),
            **_math_metadata(cudnn, matmul, assumed=cudnn_tf32 is None and matmul_tf32 is None),
        }
    )
    meta.setdefault("measured_iteration_time", None)
    try:
        return Trace(ops, table, meta).validate()
    except TraceError as e:
        raise TraceError(f"the imported trace is not valid: {e}", file=et_file) from None


def _checked_inputs(et: dict, kineto: dict, et_file, k_file) -> tuple[list, list]:
    """The ET's nodes and the Kineto events, once the two are known to be of a schema this
    reads, to hold GPU kernels, and to come from one process; else a TraceError naming the
    file."""
    schema = str(et.get("schema", ""))
    if not schema.startswith(SUPPORTED_SCHEMA_MAJOR):
        raise TraceError(
            f"Execution Trace schema {schema!r} is not supported (this importer reads "
            f"schema {SUPPORTED_SCHEMA_MAJOR}x, PyTorch 2.x's ExecutionTraceObserver)",
            file=et_file,
            field="schema",
        )
    nodes = et.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise TraceError("the Execution Trace has no nodes", file=et_file, field="nodes")
    events = kineto.get("traceEvents")
    if not isinstance(events, list):
        raise TraceError("the Kineto trace's traceEvents is not a list", file=k_file)
    if not any(e.get("cat") == "kernel" for e in events if isinstance(e, dict)):
        raise TraceError(
            "the Kineto trace holds no GPU kernels: a CPU-only profile; record with "
            "activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] on a GPU",
            file=k_file,
        )
    et_pid = et.get("pid")
    k_pids = {e.get("pid") for e in events if isinstance(e, dict) and e.get("cat") == "cpu_op"}
    if et_pid is not None and k_pids and et_pid not in k_pids:
        raise TraceError(
            f"the Execution Trace (process {et_pid}) and the Kineto trace (process "
            f"{sorted(k_pids, key=str)}) come from different runs",
            file=k_file,
        )
    return nodes, events


def _math_metadata(cudnn: bool, matmul: bool, assumed: bool) -> dict:
    """What an imported trace says of where it came from and which math it assumed."""
    return {
        "device": "cuda",
        "imported": "PyTorch Execution Trace + Kineto",
        "time_source": "Kineto: union of each operator's GPU kernels (by External id)",
        "categories_source": "inferred from use (tracer/profile_import.py)",
        "cudnn_allow_tf32": cudnn,
        "matmul_allow_tf32": matmul,
        "float32_matmul_precision": "high" if matmul else "highest",
        "math_source": (
            "assumed: PyTorch's CUDA defaults (cuDNN TF32 on, matmul TF32 off)"
            if assumed
            else "given"
        ),
    }


def _iteration(tree: EtTree, events, step, et_file, k_file):
    """(ProfilerStep name or None, the set of node ids of the iteration)."""
    steps = sorted(
        (i for i, n in tree.nodes.items() if n["name"].startswith(_STEP)), key=lambda i: i
    )
    k_steps = {
        e["name"]
        for e in events
        if isinstance(e, dict)
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith(_STEP)
    }
    if not steps:
        n_opt = sum(1 for n in tree.nodes.values() if n["name"].startswith(_OPT_RANGES[0]))
        if n_opt > 1:
            raise TraceError(
                f"the Execution Trace holds {n_opt} optimizer steps and no ProfilerStep "
                "ranges to tell the iterations apart: record one iteration, or use "
                "torch.profiler.schedule and prof.step() so that each is a ProfilerStep#N",
                file=et_file,
            )
        return None, set(tree.nodes)
    names = [tree.nodes[i]["name"] for i in steps]
    if step is not None:
        want = f"{_STEP}{step}"
        if want not in names:
            raise TraceError(
                f"step {step} is not in the Execution Trace (it holds {', '.join(names)})",
                file=et_file,
            )
    else:
        common = [n for n in names if n in k_steps] or names
        want = common[-1]
    if k_steps and want not in k_steps:
        raise TraceError(
            f"the Execution Trace's {want} is not in the Kineto trace (it holds "
            f"{', '.join(sorted(k_steps))}): the two files are from different runs",
            file=k_file,
        )
    k = names.index(want)
    lo = steps[k]
    hi = steps[k + 1] if k + 1 < len(steps) else float("inf")
    return want, {i for i in tree.nodes if lo <= i < hi}


def _top_level(tree: EtTree, region: set) -> list[tuple[int, str]]:
    """(node id, phase) of each outermost operator of the iteration, in id order."""
    top = []
    for i in sorted(region):
        name = tree.nodes[i]["name"]
        if not is_op(name):
            continue
        ph = "backward" if name.startswith(_BACKWARD) else "forward"
        nested = False
        for a in tree.ancestors(i):
            an = tree.nodes[a]["name"]
            if is_op(an):
                nested = True
                break
            if an.startswith(_OPT_RANGES) and ph == "forward":
                ph = "optimizer"
        if not nested:
            top.append((i, ph))
    # the main thread's operators after the backward pass (gradient clipping) are the
    # optimizer's
    last_bwd = max((i for i, ph in top if ph == "backward"), default=None)
    if last_bwd is not None:
        top = [(i, "optimizer" if ph == "forward" and i > last_bwd else ph) for i, ph in top]
    return top


def _check_same_run(tree: EtTree, top, times: _KinetoTimes, k_file) -> None:
    """TraceError unless most top-level operators find a Kineto cpu_op of the same name
    by Record function id (= the ET's rf_id)."""
    matched = 0
    for i, _ in top:
        ev = times.by_rf.get(tree.attrs[i].get("rf_id"))
        if ev is not None and ev.get("name") == tree.nodes[i]["name"]:
            matched += 1
    if matched < MIN_MATCHED * len(top):
        raise TraceError(
            f"only {matched} of the Execution Trace's {len(top)} operators find a Kineto "
            "operator of the same name and record function id: the two files are from "
            "different runs (record both in one torch.profiler session)",
            file=k_file,
        )


def _categories(tree: EtTree, top, batch_size):
    """(tensor key -> category for the tensors whose category is not the default, batch
    size, how the batch size was found)."""
    seen, pre = set(), {}
    fwd_read, opt_read, bwd_out, bwd_read = set(), set(), set(), set()
    for i, ph in top:
        ins, outs = _op_tensor_values(tree, i, ph)
        for key, shape, dtype, _ in ins:
            if key not in seen:
                seen.add(key)
                pre[key] = (shape, dtype)
            if ph == "forward":
                fwd_read.add(key)
            elif ph == "optimizer":
                opt_read.add(key)
            else:
                bwd_read.add(key)
        for key, *_ in outs:
            seen.add(key)
            if ph == "backward":
                bwd_out.add(key)
    marked = {}
    for key in opt_read:
        if key in bwd_out:
            marked[key] = "gradient"
        elif key in pre:
            used = key in fwd_read or key in bwd_read
            marked[key] = "weight" if used else "optimizer_state"
    others = [k for k in pre if k not in marked and k in fwd_read]
    how = "given"
    if batch_size is None:
        multi = [k for k in others if isinstance(pre[k][0], list) and len(pre[k][0]) >= 2]
        # a language model's input is token ids (batch x sequence, integers), read after
        # float buffers such as a rotary cache (8192 x 1 x 128 in Llama): integers first
        ids = [k for k in multi if pre[k][1] not in _FLOAT_DTYPES]
        pick = (ids or multi or [None])[0]
        first = pre[pick][0] if pick is not None else None
        batch_size = int(first[0]) if first else 1
        how = (
            f"inferred: first dimension of the first pre-existing {'integer ' if ids else ''}"
            f"tensor of 2+ dimensions the forward pass reads ({' x '.join(map(str, first))}, "
            f"{pre[pick][1]})"
            if first
            else "assumed 1: no pre-existing tensor of 2+ dimensions in the forward pass"
        )
    for k in others:
        s, dtype = pre[k]
        # a batch-sized first dimension; one-dimensional: labels or indices (integers),
        # not a batch norm's running statistics of as many channels as the batch
        is_input = (
            isinstance(s, list)
            and len(s) >= 1
            and s[0] == batch_size
            and (len(s) >= 2 or dtype not in _FLOAT_DTYPES)
        )
        marked[k] = "input" if is_input else "buffer"
    return marked, batch_size, how


def _user_range(tree: EtTree, i: int) -> str | None:
    """The innermost user range (record_function, not the profiler's or the optimizer's)
    around node i."""
    for a in tree.ancestors(i):
        an = tree.nodes[a]["name"]
        if an.startswith("## module "):
            return an[len("## module ") : -3]
        if is_op(an) or an.startswith(("[pytorch", _STEP, *_OPT_RANGES, "##")):
            continue
        return an
    return None


def _layers(tree: EtTree, ops, tensors) -> str:
    """Set every operator's layer; returns how they were found."""
    fwd = [o for o in ops if o.phase == "forward"]
    ranges = {o.id: _user_range(tree, o.id) for o in fwd}
    if any(ranges.values()):
        for o in fwd:
            o.layer = ranges[o.id] or "(model)"
        how = "record_function ranges of the profile (operators outside any: '(model)')"
    else:
        k, current = 0, None
        for o in fwd:
            if any(tensors[t].category == "weight" for t in o.inputs) or current is None:
                current = f"{k}.{o.name.rpartition('::')[2]}"
                k += 1
            o.layer = current
        how = (
            "inferred: each forward operator reading a weight starts a layer "
            "'<k>.<operator>', the weight-free operators after it join it"
        )
    by_id = {o.id: o for o in ops}
    made_by: dict[int, str] = {}
    prev = "(model)"
    for o in ops:
        if o.phase == "optimizer":
            o.layer = "optimizer"
            continue
        if o.phase != "backward":
            continue
        if o.fwd_id is not None and o.fwd_id in by_id:
            o.layer = by_id[o.fwd_id].layer
        elif o.name.endswith(_ACCUMULATE):
            o.layer = next((made_by[t] for t in o.inputs if t in made_by), prev)
        else:
            o.layer = prev
        for t in o.outputs:
            made_by.setdefault(t, o.layer)
        prev = o.layer
    return how


def _torch_flops():
    """tracer.torch_flops.node_flops when PyTorch is installed, else None (the shape
    formulas of triosim.trace.flops then count every operator)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    from tracer.torch_flops import node_flops

    return node_flops


def _kineto_gpu(kineto: dict) -> str | None:
    """The catalogue name of the GPU in the Kineto trace's deviceProperties, or its own
    name when the catalogue does not know it."""
    props = kineto.get("deviceProperties") or []
    name = props[0].get("name") if props and isinstance(props[0], dict) else None
    if not name:
        return None
    from triosim.common.errors import ConfigError
    from triosim.hardware import catalogue

    try:
        return catalogue.gpu(name).name
    except ConfigError:
        return name


def _host_totals(tree: EtTree, top, times: _KinetoTimes, events, step_name) -> dict:
    """Host-side totals (seconds): the profiled step's wall span on the host (with the
    profiler's overhead) and the top-level operators' CPU spans by phase (per operator: the
    host columns)."""
    by_phase: dict[str, float] = {}
    for i, ph in top:
        ev = times.by_rf.get(tree.attrs[i].get("rf_id"))
        if ev is not None:
            by_phase[ph] = by_phase.get(ph, 0.0) + float(ev.get("dur", 0.0)) * 1e-6
    span = next(
        (
            float(e.get("dur", 0.0)) * 1e-6
            for e in events
            if isinstance(e, dict)
            and e.get("cat") == "user_annotation"
            and e.get("name") == step_name
        ),
        None,
    )
    return {"step_span": span, "operator_cpu_time": by_phase}
