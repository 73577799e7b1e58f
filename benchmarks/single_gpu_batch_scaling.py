"""Each real GPU trace predicting the other measured batch sizes of its model, one GPU.

Every real H100 trace (traces/h100) predicts the plain measured time of every other batch
of its model that `../shared/gpu/timings.json` holds (without that folder the table says so
and stops): ResNet-50 b64 <-> b128, VGG-16 b64 <-> b128, GPT-2 b8 <-> b16, ResNet-152 and
DenseNet-121 b64 -> b32 and b128 (the b32 runs host-bound). Mode single, `batch_size` the
other batch, each operator model that scales operators (regression, roofline, calibrated),
with the host model on (its default for GPU traces: perfmodel/host.py) and off. The host's
time does not change with the batch (the same operators launch the same kernels); the GPU
time comes from the operator model (the host model's default op_cost was fitted on
ResNet-152 b64: perfmodel/host.py). Prints a Markdown table, per model and host setting the
mean and worst |error|, and last the default's (regression, host on):
`N predictions: mean |error| X %, worst Y % (NAME)`.
Run: python benchmarks/single_gpu_batch_scaling.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from triosim.simulation.wiring import Simulation
from triosim.trace.model import load

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ROOT.parent / "shared" / "gpu" / "timings.json"
TRACED = {"resnet50": (64, 128), "vgg16": (64, 128), "gpt2": (8, 16), "resnet152": (64,)}
TRACED["densenet121"] = (64,)
MODELS = ("regression", "roofline", "calibrated")


def trace_file(model: str, batch: int) -> Path:
    seq = "-s512" if model == "gpt2" else ""
    return ROOT / "traces" / "h100" / f"{model}{seq}-b{batch}.trace.json.gz"


def predictions(measured: dict):
    """(model, traced batch, target batch, perfmodel, host, predicted ms, measured ms)."""
    for model, batches in TRACED.items():
        measured_batches = sorted(b for m, b in measured if m == model)
        for b in batches:
            trace = load(trace_file(model, b))
            for other in measured_batches:
                if other == b:
                    continue
                for kind in MODELS:
                    for host in ("auto", "off"):
                        cfg = {
                            "num_gpus": 1,
                            "batch_size": other,
                            "perfmodel": {"kind": kind},
                            "host": {"model": host},
                        }
                        sim = Simulation(cfg, trace=trace).run().iteration_time * 1e3
                        yield model, b, other, kind, host, sim, measured[(model, other)]


def main() -> int:
    if not TIMINGS.exists():
        print(f"no plain timings: {TIMINGS} is absent (the shared GPU measurements)")
        return 0
    doc = json.loads(TIMINGS.read_text())
    measured = {(r["model"], r["batch"]): r["mean_ms"] for r in doc["h100"]["timing"]}
    rows = list(predictions(measured))
    print(
        "| model | traced batch | predicted batch | perfmodel | host model | predicted ms "
        "| measured ms | error % |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model, b, other, kind, host, sim, meas in rows:
        on = "on" if host == "auto" else "off"
        err = (sim - meas) / meas * 100
        print(f"| {model} | {b} | {other} | {kind} | {on} | {sim:.2f} | {meas:.2f} | {err:+.1f} |")
    print()
    print("| perfmodel | host model | mean abs error % | worst abs error % |")
    print("|---|---|---|---|")
    for kind in MODELS:
        for host in ("auto", "off"):
            errs = [abs(s - m) / m * 100 for _, _, _, k, h, s, m in rows if (k, h) == (kind, host)]
            on = "on" if host == "auto" else "off"
            print(f"| {kind} | {on} | {statistics.mean(errs):.1f} | {max(errs):.1f} |")
    default = [
        (abs(s - m) / m * 100, f"{model} b{b} -> b{o}")
        for model, b, o, k, h, s, m in rows
        if (k, h) == ("regression", "auto")
    ]
    worst = max(default)
    print(
        f"\n{len(default)} predictions: mean |error| "
        f"{statistics.mean(e for e, _ in default):.1f} %, worst {worst[0]:.1f} % ({worst[1]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
