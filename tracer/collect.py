"""Collect one training iteration of a PyTorch model as a triosim Trace.

Warm-up iterations, then `measure` timed iterations (CUDA events on a GPU,
perf_counter with synchronisation on CPU), then one further iteration recorded with
torch.profiler (record_shapes, kernels on GPU) and the ExecutionTraceObserver.
Profiled and timed iterations differ, so profiling overhead stays out of the
measured time. This module never imports SimPy (it runs on machines without it).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from triosim.errors import TracerError
from triosim.trace import Trace


def _record(name):
    import torch

    return torch.autograd.profiler.record_function(name)


def _module_markers(model):
    """Forward pre/post hooks that open and close a '## module <path> ##' range per module."""
    handles, stack = [], []

    def pre(name):
        def hook(mod, args):
            rf = _record(f"## module {name} ##")
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


def _mark(category, tensors):
    import torch

    with _record(f"## mark {category} ##"):
        for t in tensors:
            if t is not None:
                torch.ops.aten.alias(t)


def collect(model, make_batch, loss_fn, optimizer, *, batch_size: int, device: str = "cpu",
            warmup: int = 3, measure: int = 5, model_name: str | None = None,
            dtype: str = "float32") -> Trace:  # fmt: skip
    """Trace one iteration of `model` and return a validated Trace.

    make_batch(batch_size, device) -> (inputs, target); loss_fn(output, target) -> loss;
    optimizer: a torch.optim.Optimizer over the model's parameters.
    """
    from tracer.linking import link, node_flops

    et_doc, k_doc, meta = record(model, make_batch, loss_fn, optimizer, batch_size=batch_size,
                                 device=device, warmup=warmup, measure=measure,
                                 model_name=model_name, dtype=dtype)  # fmt: skip
    return link(et_doc, k_doc, gpu=device.startswith("cuda"), metadata=meta, flops_of=node_flops)


def record(model, make_batch, loss_fn, optimizer, *, batch_size: int, device: str = "cpu",
           warmup: int = 3, measure: int = 5, model_name: str | None = None,
           dtype: str = "float32") -> tuple[dict, dict, dict]:  # fmt: skip
    """Run and profile the iterations; return (Execution Trace, Kineto trace, metadata).

    make_batch(batch_size, device) -> (inputs, target); loss_fn(output, target) -> loss;
    optimizer: a torch.optim.Optimizer over the model's parameters.
    """
    try:
        import torch
        from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile
    except ImportError:
        raise TracerError("tracing needs PyTorch: pip install 'triosim[trace]'") from None
    if not isinstance(model, torch.nn.Module):
        raise TracerError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TracerError(f"model {model_name or type(model).__name__} has no trainable "
                          "parameters: nothing to train, so nothing to trace")  # fmt: skip
    if not isinstance(batch_size, int) or batch_size < 1:
        raise TracerError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TracerError("device 'cuda' asked for, but torch.cuda.is_available() is False")
    gpu = device.startswith("cuda")
    model.to(device).train()

    def sync():
        if gpu:
            torch.cuda.synchronize()

    def step(batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        with _record("## forward ##"):
            out = model(x)
            with _record("## module loss ##"):
                loss = loss_fn(out, y)
        with _record("## backward ##"):
            loss.backward()
        with _record("## optimizer ##"):
            optimizer.step()

    try:
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
        handles = _module_markers(model)
        with tempfile.TemporaryDirectory() as tmp:
            et_path, k_path = Path(tmp) / "et.json", Path(tmp) / "kineto.json"
            et = ExecutionTraceObserver().register_callback(str(et_path))
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
            # one unrecorded profiler warm-up step first: the first profiled step pays
            # the profiler's start-up costs, which would inflate operator times
            sched = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
            with profile(activities=acts, record_shapes=True, execution_trace_observer=et,
                         schedule=sched) as prof:  # fmt: skip
                step(batch)
                sync()
                prof.step()
                _mark("weight", params)
                _mark("input", batch if isinstance(batch, (tuple, list)) else [batch])
                _mark("optimizer_state", [v for s in optimizer.state.values() for v in s.values()
                                          if torch.is_tensor(v) and v.dim() > 0])  # fmt: skip
                step(batch)
                sync()
                _mark("gradient", [p.grad for p in params])
                prof.step()
            for h in handles:
                h.remove()
            prof.export_chrome_trace(str(k_path))
            et_doc = json.loads(et_path.read_text())
            k_doc = json.loads(k_path.read_text())
    except TracerError:
        raise
    except Exception as e:  # the user's model, batch or loss raised
        raise TracerError(f"the model raised while tracing: {type(e).__name__}: {e}") from e

    meta = {
        "model": model_name or type(model).__name__,
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
        "measured_iteration_time": statistics.mean(times) if times else None,
        "measured_iteration_time_stdev": statistics.stdev(times) if len(times) > 1 else 0.0,
        "measured_iterations": measure,
        "warmup_iterations": warmup,
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated()) if gpu else None,
        "et_schema": et_doc.get("schema"),
        "time_source": "union of GPU kernel busy time" if gpu else "CPU operator duration",
    }
    return et_doc, k_doc, meta
