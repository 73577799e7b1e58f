"""Collect one training iteration of a PyTorch model as a triosim Trace.

Warm-up iterations, then `measure` timed iterations (CUDA events on a GPU,
perf_counter with synchronisation on CPU), then one further iteration recorded with
torch.profiler (record_shapes, kernels on GPU) and the ExecutionTraceObserver.
Profiled and timed iterations differ, so profiling overhead stays out of the
measured time. Peak memory: torch.cuda.max_memory_allocated over the profiled iteration on a
GPU; on CPU one more iteration under the profiler's memory events (`_cpu_peak_memory`). Shape-only (`shapes_only=True`): the same profiled iteration on meta tensors,
nothing computed or timed. This module never imports SimPy (it runs on machines without it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

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


def _tagging_mode():
    """A dispatch mode that numbers every tensor an operator reads or returns, and records
    each call's numbers in order. Meta tensors have no data, so the Execution Trace cannot
    tell them apart by storage, and an ET tensor id (a TensorImpl address) is reused once a
    tensor is freed; the linker renames ET tensors with these numbers instead
    (tracer.meta_trace.prepare_meta_trace). The mode keeps no tensor alive, so autograd behaves
    as without it (AccumulateGrad still steals a gradient nobody else holds)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakIdKeyDictionary

    class Tagging(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.serial = WeakIdKeyDictionary()
            self.calls: list[tuple[list[int], list[int]]] = []
            self.storages: dict[int, int] = {}
            self.count = 0

        def number(self, ts):
            out = []
            for t in ts:
                n = self.serial.get(t)
                if n is None:
                    self.count += 1
                    n = self.serial[t] = self.count
                    # the storage it lives in (views and saved-tensor handles share it)
                    self.storages[n] = t.untyped_storage()._cdata
                out.append(n)
            return out

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ins = self.number(_schema_tensors(func, args, kwargs))
            out = func(*args, **kwargs)
            self.calls.append((ins, self.number(_tensors(out)), str(func)))
            return out

    return Tagging()


# the record_function name that stands in for the composite attention operator
SDPA = "aten::scaled_dot_product_attention"
_FLASH = 1  # torch._fused_sdp_choice's number for flash attention (SDPBackend.FLASH_ATTENTION)


@contextlib.contextmanager
def _cpu_attention():
    """On the meta device, F.scaled_dot_product_attention takes the math path (matrix
    products and a softmax) where the CPU, and a GPU, run one fused kernel. While tracing
    shapes, it asks the CPU which kernel it would pick for these shapes and dtypes (on empty
    CPU tensors) and, for flash attention, calls that kernel itself inside a range named as
    the composite operator, which the linker turns back into it."""
    import torch
    from torch.nn import functional as F

    original = F.scaled_dot_product_attention
    choices: dict[tuple, int] = {}

    def cpu(t):
        if t is None:
            return None
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")

    def sdpa(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if query.device.type != "meta":
            return original(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        sig = tuple(
            (t.shape, t.stride(), t.dtype) if t is not None else None
            for t in (query, key, value, attn_mask)
        ) + (dropout_p, is_causal, scale, enable_gqa)
        if sig not in choices:  # asked in the warm-up step, so no profiled step records it
            choices[sig] = torch._fused_sdp_choice(
                cpu(query),
                cpu(key),
                cpu(value),
                cpu(attn_mask),
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        if choices[sig] != _FLASH:
            return original(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        with torch._C._profiler._RecordFunctionFast(
            SDPA, [query, key, value, attn_mask, dropout_p, is_causal]
        ):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _tensors(x):
    import torch

    if torch.is_tensor(x):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _schema_tensors(func, args, kwargs):
    """The tensors among an operator's arguments in schema order (what the ET records)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return _tensors(list(args) + list(kwargs.values()))
    out = []
    for i, arg in enumerate(schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(arg.name)
        out += _tensors(v)
    return out


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
    if not isinstance(model, torch.nn.Module):
        raise TracerError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if not params:
        raise TracerError(
            f"model {model_name or type(model).__name__} has no trainable "
            "parameters: nothing to train, so nothing to trace"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise TracerError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if shapes_only:
        off = sorted({str(p.device) for p in params} - {"meta"})
        if off:
            raise TracerError(
                f"a shape-only trace needs the model on the meta device (build it "
                f"under `with torch.device('meta'):`); parameters are on {off}"
            )
        device, warmup, measure = "meta", 1, 0
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise TracerError("device 'cuda' asked for, but torch.cuda.is_available() is False")
    gpu = device.startswith("cuda")
    rec = _record_fast if shapes_only else _record
    (model if shapes_only else model.to(device)).train()

    def sync():
        if gpu:
            torch.cuda.synchronize()

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

    try:
        with _cpu_attention() if shapes_only else contextlib.nullcontext():
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
                sync,
            )
    except TracerError:
        raise
    except Exception as e:  # the user's model, batch or loss raised
        raise TracerError(f"the model raised while tracing: {type(e).__name__}: {e}") from e

    cudnn_tf32 = bool(torch.backends.cudnn.allow_tf32)
    matmul_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    meta = {
        "model": model_name or type(model).__name__,
        "batch_size": batch_size,
        "device": device,
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "torch_version": torch.__version__,
        "dtype": dtype,
        # the math float32 convolutions and matrix products ran in (TF32 or not): PyTorch's
        # defaults are cudnn.allow_tf32 = True, cuda.matmul.allow_tf32 = False ("highest")
        "cudnn_allow_tf32": cudnn_tf32,
        "matmul_allow_tf32": matmul_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "optimizer": type(optimizer).__name__,
        "parameters": int(sum(p.numel() for p in params)),
        "measured_iteration_time": statistics.mean(times) if times else None,
        "measured_iteration_time_stdev": statistics.stdev(times) if len(times) > 1 else 0.0,
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
        "et_schema": et_doc.get("schema"),
        "time_source": "union of GPU kernel busy time" if gpu else "CPU operator duration",
    }
    if shapes_only:
        meta.update(
            {
                "gpu": None,  # set by the performance model that times the operators
                "shapes_only": True,
                "measured_iteration_time_stdev": None,
                "time_source": "none yet: a shape-only trace (meta tensors, nothing computed); "
                "times come from a performance model",
                "math_source": "assumed: CUDA with this process's TF32 settings (PyTorch's "
                "defaults: convolutions in TF32, matrix products in float32)",
            }
        )
    return et_doc, k_doc, meta


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
    sync,
):
    """Warm-up and timed iterations, then one profiled: (ET, Kineto trace, times, memory),
    memory = (peak bytes, bytes alive at the step's start), None for shape-only traces."""
    import torch
    from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile

    gpu = device.startswith("cuda")
    batch = make_batch(batch_size, device)
    for _ in range(max(warmup, 1)):  # at least one: creates the optimizer states
        step(batch)
    sync()
    times = []
    for _ in range(measure):
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
    if gpu:
        torch.cuda.reset_peak_memory_stats()
        start_bytes = int(torch.cuda.memory_allocated())
    handles = _module_markers(model, rec)
    tags = _tagging_mode() if shapes_only else contextlib.nullcontext()
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
    return et_doc, k_doc, times, memory
