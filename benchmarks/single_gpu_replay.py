"""One-GPU replay of the real GPU traces against their plain measured iteration time.

For each trace under traces/h100/ and traces/h200/ (made by this project's tracer on those
GPUs): the plain measured time (no profiler, no hooks: ../shared/gpu/timings.json, when that
folder is present beside the repository; otherwise the column is empty and this says so),
the trace's own measured_iteration_time (taken, for these traces, with the tracer's phase
ranges on), the sum of operator GPU times, the one-GPU simulation (mode single, perfmodel
trace) without and with the host model (perfmodel/host.py, its defaults: op_cost from the
tracing machine's host-bound runs, DenseNet-121 b64 one of them (perfmodel/host_cpus.py),
kernel_gap on ResNet-50 b128, both marked; the rest are predictions) and
its error against the plain time. The share the sum misses is the GPU's idle time (the
host not issuing kernels fast enough). Prints a Markdown table.
Run: python benchmarks/single_gpu_replay.py
"""

from __future__ import annotations

import json
from pathlib import Path

from triosim.simulation.wiring import Simulation
from triosim.trace.model import load

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ROOT.parent / "shared" / "gpu" / "timings.json"
# the traces the host model's defaults were fitted on (perfmodel/host.py)
FITTED = {
    ("h100", "densenet121", 64): " (op_cost fitted, with b32 runs)",
    ("h100", "resnet50", 128): " (kernel_gap fitted)",
}


def plain_times() -> dict | None:
    """(gpu folder, model, batch) -> plain mean ms, or None without ../shared."""
    if not TIMINGS.exists():
        return None
    doc = json.loads(TIMINGS.read_text())
    return {
        (gpu, r["model"], r["batch"]): r["mean_ms"]
        for gpu in ("h100", "h200")
        for r in doc.get(gpu, {}).get("timing", [])
    }


def rows():
    plain = plain_times()
    for gpu in ("h100", "h200"):
        for path in sorted((ROOT / "traces" / gpu).glob("*.trace.json.gz")):
            t = load(path)
            m = t.metadata
            model = m["model"]
            batch = m["batch_size"]
            sim = Simulation({"num_gpus": 1}, trace=t).run().iteration_time * 1e3
            off = {"num_gpus": 1, "host": {"model": "off"}}
            no_host = Simulation(off, trace=t).run().iteration_time * 1e3
            measured = (plain or {}).get((gpu, model, batch))
            yield {
                "gpu": gpu,
                "model": model,
                "batch": batch,
                "plain": measured,
                "traced": m["measured_iteration_time"] * 1e3,
                "sum": t.total_time * 1e3,
                "sim": sim,
                "no_host": no_host,
                "fitted": FITTED.get((gpu, model, batch), ""),
            }


def pct(a, b):
    return f"{(a - b) / b * 100:+.1f}" if b else "-"


if __name__ == "__main__":
    if plain_times() is None:
        print(f"no {TIMINGS} (plain timings): the plain and error columns are empty")
    print(
        "| GPU | model | batch | plain measured ms | trace's measured ms | sum of GPU time ms "
        "| share the sum misses % | 1-GPU, no host model ms | error % "
        "| 1-GPU, host model ms | error % |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows():
        p = r["plain"]
        ps = f"{p:.2f}" if p else "-"
        miss = f"{(p - r['sum']) / p * 100:.1f}" if p else "-"
        print(
            f"| {r['gpu']} | {r['model']}{r['fitted']} | {r['batch']} | {ps} | {r['traced']:.2f} "
            f"| {r['sum']:.2f} | {miss} | {r['no_host']:.2f} | {pct(r['no_host'], p)} "
            f"| {r['sim']:.2f} | {pct(r['sim'], p)} |"
        )
