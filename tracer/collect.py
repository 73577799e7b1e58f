"""Collect one training iteration of a PyTorch model as a triosim Trace.

Warm-up iterations, then `measure` timed iterations (CUDA events on a GPU,
perf_counter with synchronisation on CPU) run as a plain loop, with no module hook, marker
range or profiler of the tracer's (`measured_iteration_time`); then the module markers go on,
`measure` more iterations are timed with them (`measured_iteration_time_hooked`, the markers'
overhead), and one further iteration is recorded with torch.profiler (record_shapes, kernels
on GPU) and the ExecutionTraceObserver. Profiled and timed iterations differ, so profiling
and marking overhead stay out of the measured time. Peak memory: torch.cuda.max_memory_allocated over the profiled iteration on a
GPU; on CPU one more iteration under the profiler's memory events (`_cpu_peak_memory`).
Shape-only (`shapes_only=True`): the same profiled iteration on meta tensors, nothing
computed or timed (tracer.meta_run). This module never imports SimPy (it runs on machines without it).

`record` runs the model: `_trainable` and `_check_on_meta` check it, `_training_step` is the
iteration (inside the phase ranges the linker reads), `_profile` runs and profiles it, and
`_metadata` says what ran. `collect` then links the traces (tracer.linking; a shape-only run's
ET first through tracer.meta_trace).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

from tracer.meta_run import cpu_attention, tagging_mode
from triosim.common.errors import TracerError
from triosim.trace.model import Trace


def _record(name):
    import torch

    return torch.autograd.profiler.record_function(name)


def _record_fast(name):
    """A profiler range that is no dispatcher call: under a dispatch mode (the shape-only
    tracer's), torch.autograd.profiler.record_function would go through the mode and leave
    its ranges out of place in the Execution Trace."""
    import torch

    return torch._C._profiler._RecordFunctionFast(name)


def _module_markers(model, record=_record):
    """Forward pre/post hooks that open and close a '## module <path> ##' range per module."""
    handles, stack = [], []

    def pre(name):
        def hook(mod, args):
            rf = record(f"## module {name} ##")
            rf.__enter__()
            stack.append(rf)

        return hook

    def post(mod, args, out):
        if stack:
            stack.pop().__exit__(None, None, None)

    for name, mod in model.named_modules():
        if name:  # every module; an op's layer is the innermost one around it
            handles.append(mod.register_forward_pre_hook(pre(name)))
            handles.append(mod.register_forward_hook(post))
    return handles


def _mark(category, named, record=_record):
    """Tag tensors with their category and name: one '## mark <category> <name> ##' range
    around an aten::alias of each, which the linker reads back."""
    import torch

    for name, t in named:
        if t is not None:
            with record(f"## mark {category} {name} ##"):
                torch.ops.aten.alias(t)


def _named_states(optimizer, params):
    """(parameter name.state name, tensor) of every tensor state, step counters included."""
    import torch

    names = {id(p): n for n, p in params}
    out = []
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if torch.is_tensor(v):
                out.append((f"{names.get(id(p), '?')}.{k}", v))
    return out


def _live_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _cpu_peak_memory(model, optimizer, named, batch, step) -> tuple[int, int]:
    """(peak bytes allocated during one CPU iteration, bytes alive when it starts).

    The profiler's CPU memory events count only what is allocated while it runs, and it
    cannot see the release of a block allocated before it started: so the gradients are
    dropped first (the step's own zero_grad would free them unseen), the tensors alive at
    the start are counted from the model, optimizer and batch, and the peak is that plus
    the highest running total of the events' bytes, like torch.cuda.max_memory_allocated."""
    from torch.profiler import ProfilerActivity, profile

    optimizer.zero_grad(set_to_none=True)
    states = [t for _, t in _named_states(optimizer, named)]
    batch_ts = [t for _, t in _batch_tensors(batch)]
    base = _live_bytes([p for _, p in named] + list(model.buffers()) + states + batch_ts)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.json"
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(batch)
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    # the running sum of this session's events: the events' "Total Allocated" is the CPU
    # reporter's counter, which carries over bytes from earlier profiling sessions
    deltas = [
        e["args"]["Bytes"]
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    ]
    return base + int(max(itertools.accumulate(deltas), default=0)), base


def _batch_tensors(batch):
    import torch

    items = batch if isinstance(batch, (tuple, list)) else [batch]
    return [(f"batch.{i}", t) for i, t in enumerate(items) if torch.is_tensor(t)]


def collect(
    model,
    make_batch,
    loss_fn,
    optimizer,
    *,
    batch_size: int,
    device: str = "cpu",
    warmup: int = 3,
    measure: int = 5,
    model_name: str | None = None,
    dtype: str = "float32",
    shapes_only: bool = False,
    metadata: dict | None = None,
) -> Trace:
    """Trace one iteration of `model` and return a validated Trace.

    make_batch(batch_size, device) -> (inputs, target); loss_fn(output, target) -> loss;
    optimizer: a torch.optim.Optimizer over the model's parameters.

    shapes_only: the model's parameters are on the meta device (build it under
    `torch.device("meta")`) and nothing is computed or timed: the trace has the operators,
    layers, phases, pairing, tensors and FLOPs of a real trace and every time 0, for a
    performance model to fill (perfmodel.modelled.model_times). Math modes are those of
    CUDA with PyTorch's default TF32 settings.
    """
    from tracer.linking import link
    from tracer.torch_flops import node_flops

    et_doc, k_doc, meta = record(
        model,
        make_batch,
        loss_fn,
        optimizer,
        batch_size=batch_size,
        device=device,
        warmup=warmup,
        measure=measure,
        model_name=model_name,
        dtype=dtype,
        shapes_only=shapes_only,
    )
    meta.update(metadata or {})
    if shapes_only:
        from tracer.meta_trace import prepare_meta_trace

        et_doc = prepare_meta_trace(
            et_doc,
            et_doc.pop("triosim_tensor_numbers"),
            et_doc.pop("triosim_tensor_storages", None),
        )
    trace = link(
        et_doc,
        k_doc,
        gpu=device.startswith("cuda"),
        metadata=meta,
        flops_of=node_flops,
        cuda_math=True if shapes_only else None,
    )
    if shapes_only:
        for op in trace.operators:
            op.time = 0.0
    return trace


def record(
    model,
    make_batch,
    loss_fn,
    optimizer,
    *,
    batch_size: int,
    device: str = "cpu",
    warmup: int = 3,
    measure: int = 5,
    model_name: str | None = None,
    dtype: str = "float32",
    shapes_only: bool = False,
) -> tuple[dict, dict, dict]:
    """Run and profile the iterations; return (Execution Trace, Kineto trace, metadata).

    make_batch(batch_size, device) -> (inputs, target); loss_fn(output, target) -> loss;
    optimizer: a torch.optim.Optimizer over the model's parameters. shapes_only: see
    `collect`; one untimed warm-up step (it creates the optimizer states), no timed ones.
    """
    try:
        import torch
    except ImportError:
        raise TracerError("tracing needs PyTorch: pip install 'triosim[trace]'") from None
    named = _trainable(torch, model, model_name, batch_size)
    if shapes_only:
        _check_on_meta(named)
        device, warmup, measure = "meta", 1, 0
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise TracerError("device 'cuda' asked for, but torch.cuda.is_available() is False")
    gpu = device.startswith("cuda")
    rec = _record_fast if shapes_only else _record
    (model if shapes_only else model.to(device)).train()
    step = _training_step(model, loss_fn, optimizer, rec)
    # the timed iterations' step: no phase ranges (no marker of the tracer's while timing)
    plain = _training_step(model, loss_fn, optimizer, lambda name: contextlib.nullcontext())

    def sync():
        if gpu:
            torch.cuda.synchronize()

    try:
        with cpu_attention() if shapes_only else contextlib.nullcontext():
            et_doc, k_doc, times, memory = _profile(
                model,
                make_batch,
                optimizer,
                named,
                batch_size,
                device,
                warmup,
                measure,
                shapes_only,
                rec,
                step,
                plain,
                sync,
            )
    except TracerError:
        raise
    except Exception as e:  # the user's model, batch or loss raised
        raise TracerError(f"the model raised while tracing: {type(e).__name__}: {e}") from e
    meta = _metadata(
        torch,
        model_name or type(model).__name__,
        optimizer,
        [p for _, p in named],
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        warmup=warmup,
        measure=measure,
        times=times,
        memory=memory,
        shapes_only=shapes_only,
        et_schema=et_doc.get("schema"),
    )
    if shapes_only:
        meta.update(_SHAPE_ONLY_METADATA)
    return et_doc, k_doc, meta


def _trainable(torch, model, model_name, batch_size) -> list:
    """The model's trainable (name, parameter) pairs; TracerError unless `model` is a
    torch.nn.Module with some and batch_size is an integer >= 1."""
    if not isinstance(model, torch.nn.Module):
        raise TracerError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise TracerError(
            f"model {model_name or type(model).__name__} has no trainable "
            "parameters: nothing to train, so nothing to trace"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise TracerError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return named


def _check_on_meta(named) -> None:
    """TracerError unless every parameter is on the meta device (a shape-only trace)."""
    off = sorted({str(p.device) for _, p in named} - {"meta"})
    if off:
        raise TracerError(
            f"a shape-only trace needs the model on the meta device (build it "
            f"under `with torch.device('meta'):`); parameters are on {off}"
        )


def _training_step(model, loss_fn, optimizer, rec):
    """step(batch): one training iteration on batch = (inputs, target), its phases inside
    the "## forward ##", "## module loss ##", "## backward ##" and "## optimizer ##" ranges
    that the linker reads (`rec` opens a range)."""

    def step(batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        with rec("## forward ##"):
            out = model(x)
            with rec("## module loss ##"):
                loss = loss_fn(out, y)
        with rec("## backward ##"):
            loss.backward()
        with rec("## optimizer ##"):
            optimizer.step()

    return step


def _metadata(
    torch,
    model_label,
    optimizer,
    params,
    *,
    batch_size,
    device,
    dtype,
    warmup,
    measure,
    times,
    memory,
    shapes_only,
    et_schema,
) -> dict:
    """The trace's metadata from a run: what ran (model, batch, device, dtype, optimizer,
    parameter count), the math settings PyTorch holds now (read after the run), the
    measured iteration times (times = (plain, hooked)) and memory (memory = (peak bytes, bytes at the step's start)),
    and where times and memory come from. A shape-only trace updates it with
    `_SHAPE_ONLY_METADATA`."""
    gpu = device.startswith("cuda")
    plain, hooked = times
    return {
        "model": model_label,
        "batch_size": batch_size,
        "device": device,
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "torch_version": torch.__version__,
        "dtype": dtype,
        # the math float32 convolutions and matrix products ran in (TF32 or not): PyTorch's
        # defaults are cudnn.allow_tf32 = True, cuda.matmul.allow_tf32 = False ("highest")
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "optimizer": type(optimizer).__name__,
        "parameters": int(sum(p.numel() for p in params)),
        # from iterations with no hook, marker or profiler of the tracer's (a plain loop)
        "measured_iteration_time": statistics.mean(plain) if plain else None,
        "measured_iteration_time_stdev": statistics.stdev(plain) if len(plain) > 1 else 0.0,
        # as many iterations with the tracer's module markers and phase ranges on (no
        # profiler): what the markers cost, which the profiled iteration pays too
        "measured_iteration_time_hooked": statistics.mean(hooked) if hooked else None,
        "measured_iterations": measure,
        "warmup_iterations": warmup,
        "peak_memory_bytes": memory[0],
        "memory_at_step_start_bytes": memory[1],
        "peak_memory_source": (
            None
            if shapes_only
            else "torch.cuda.max_memory_allocated"
            if gpu
            else "CPU profiler memory events (profile_memory=True) "
            "plus the tensors alive at the step's start"
        ),
        "et_schema": et_schema,
        "time_source": "union of GPU kernel busy time" if gpu else "CPU operator duration",
    }


# what a shape-only trace's metadata says instead: nothing was timed on any GPU
_SHAPE_ONLY_METADATA = {
    "gpu": None,  # set by the performance model that times the operators
    "shapes_only": True,
    "measured_iteration_time_stdev": None,
    "measured_iteration_time_hooked": None,
    "time_source": "none yet: a shape-only trace (meta tensors, nothing computed); "
    "times come from a performance model",
    "math_source": "assumed: CUDA with this process's TF32 settings (PyTorch's "
    "defaults: convolutions in TF32, matrix products in float32)",
}


def _profile(
    model,
    make_batch,
    optimizer,
    named,
    batch_size,
    device,
    warmup,
    measure,
    shapes_only,
    rec,
    step,
    plain,
    sync,
):
    """Warm-up and timed iterations, then one profiled: (ET, Kineto trace, times, memory),
    times = (plain, hooked) lists of seconds, memory = (peak bytes, bytes alive at the
    step's start), None for shape-only traces.

    Honest timing: the warm-up and the timed iterations (`plain`: the same step with no
    phase ranges) run with no module hook, marker range or profiler of the tracer's. Then
    the module markers go on, `measure` more iterations are timed with them and the phase
    ranges (`step`; the hooked time, to show the markers' overhead), and the profiled
    iteration runs under them."""
    import torch
    from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile

    gpu = device.startswith("cuda")
    batch = make_batch(batch_size, device)
    for _ in range(max(warmup, 1)):  # at least one: creates the optimizer states
        plain(batch)
    sync()
    times = _timed(plain, batch, measure, gpu, sync)
    handles = _module_markers(model, rec)
    hooked = _timed(step, batch, measure, gpu, sync)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
        start_bytes = int(torch.cuda.memory_allocated())
    tags = tagging_mode() if shapes_only else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp:
        et_path, k_path = Path(tmp) / "et.json", Path(tmp) / "kineto.json"
        et = ExecutionTraceObserver().register_callback(str(et_path))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        # one unrecorded profiler warm-up step first: the first profiled step pays
        # the profiler's start-up costs, which would inflate operator times
        sched = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
        with profile(
            activities=acts, record_shapes=True, execution_trace_observer=et, schedule=sched
        ) as prof:
            step(batch)
            sync()
            prof.step()
            with tags:
                _mark("weight", named, rec)
                _mark("buffer", list(model.named_buffers()), rec)
                _mark("input", _batch_tensors(batch), rec)
                _mark("optimizer_state", _named_states(optimizer, named), rec)
                step(batch)
                sync()
                _mark("gradient", [(n, p.grad) for n, p in named], rec)
            prof.step()
        for h in handles:
            h.remove()
        prof.export_chrome_trace(str(k_path))
        et_doc = json.loads(et_path.read_text())
        k_doc = json.loads(k_path.read_text())
    if shapes_only:
        et_doc["triosim_tensor_numbers"] = tags.calls
        et_doc["triosim_tensor_storages"] = tags.storages
        memory = (None, None)
    elif gpu:
        memory = (int(torch.cuda.max_memory_allocated()), start_bytes)
    else:
        memory = _cpu_peak_memory(model, optimizer, named, batch, step)
    return et_doc, k_doc, (times, hooked), memory


def _timed(step, batch, n, gpu, sync) -> list[float]:
    """Seconds of each of `n` iterations of step(batch): CUDA events on a GPU, perf_counter
    with the iteration run to its end on CPU."""
    import torch

    times = []
    for _ in range(n):
        if gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(batch)
            b.record()
            sync()
            times.append(a.elapsed_time(b) * 1e-3)
        else:
            t0 = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - t0)
    return times
