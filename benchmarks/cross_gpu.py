"""H100 traces predicting the H200 measurements (ResNet-50 b128, GPT-2 b8).

What differs between the two GPUs, from the catalogue (triosim/hardware/catalogue.py, with
its sources): memory bandwidth 3.35 -> 4.8 TB/s and capacity 80 -> 141 GB; the same chip
otherwise (132 SMs, boost 1,980 MHz, 50 MB L2, the same peaks per math mode). The models
keep what does not change from the H100 (each kind's fixed overhead, the fraction of its
roof an operator of a given shape reaches) and take the H200's peaks and bandwidth.

Each H100 trace (traces/h100/, its tracer trace) is run on one H200 (mode single, the host
model on) with:
- learned: the shipped table (fitted on the H100 traces), from the trace's shapes;
- learned, anchored: each operator's measured H100 time x learned(H200) / learned(H100);
- roofline: the per-name efficiency fitted on the H100 trace itself;
- calibrated: the older table (the original TrioSim's two H100 traces).
Against the plain H200 time (../shared/gpu/timings.json) and, per operator sum, the H200
trace's (traces/h200/). Target (issue 32): within 5 %.
Run: PYTHONPATH=. python benchmarks/cross_gpu.py
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from perfmodel import CalibratedModel, LearnedModel, Roofline, Target
from perfmodel.learned import shipped
from triosim.hardware import catalogue as hardware
from triosim.simulation.wiring import Simulation
from triosim.trace.model import load

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ROOT.parent / "shared" / "gpu" / "timings.json"
PAIRS = [("resnet50-b128", 128), ("gpt2-s512-b8", 8)]


def on_h200(trace, times):
    t = copy.deepcopy(trace)
    for op, x in zip(t.operators, times, strict=True):
        op.time = float(x)
    t.metadata.update({"gpu": "H200", "modelled": True})
    return Simulation({"num_gpus": 1, "host": {"model": "on"}}, trace=t).run().iteration_time


def predictions(h100) -> dict:
    """model -> operator times of the H100 trace on the H200."""
    h200 = Target(gpu="H200")
    table = shipped()
    ops = h100.operators
    on_h = table.times(h100, ops, hardware.gpu("H100-SXM"))
    on_200 = table.times(h100, ops, hardware.gpu("H200"))
    ratio = np.where(on_h > 0, on_200 / np.where(on_h > 0, on_h, 1.0), 1.0)
    learned, roof, cal = LearnedModel(h100, identity=False), Roofline(h100), CalibratedModel(h100)
    return {
        "learned": [learned.time(o, h200) for o in ops],
        "learned, anchored": [o.time * r for o, r in zip(ops, ratio, strict=True)],
        "roofline": [roof.time(o, h200) for o in ops],
        "calibrated": [cal.time(o, h200) for o in ops],
    }


def main() -> int:
    plain = {}
    if TIMINGS.exists():
        doc = json.loads(TIMINGS.read_text())
        plain = {(r["model"], r["batch"]): r["mean_ms"] * 1e-3 for r in doc["h200"]["timing"]}
    else:
        print(f"no {TIMINGS}: the plain H200 column is empty")
    print(
        "| model | batch | H100 plain ms | H200 plain ms | H200 ops ms | predicted by | "
        "ops ms | err % | iteration ms | err % |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    errs: dict[str, list] = {}
    for stem, batch in PAIRS:
        h100 = load(ROOT / "traces" / "h100" / f"{stem}.trace.json.gz")
        h200 = load(ROOT / "traces" / "h200" / f"{stem}.trace.json.gz")
        model = h100.metadata["model"]
        meas = plain.get((model, batch))
        base = Simulation({"num_gpus": 1}, trace=h100).run().iteration_time
        for name, times in predictions(h100).items():
            ops = float(np.sum(times))
            it = on_h200(h100, times)
            e = (it / meas - 1) * 100 if meas else float("nan")
            errs.setdefault(name, []).append(e)
            print(
                f"| {model} | {batch} | {base * 1e3:.2f} (1 GPU, host) | "
                f"{meas * 1e3 if meas else 0:.2f} | {h200.total_time * 1e3:.2f} | {name} | "
                f"{ops * 1e3:.2f} | {(ops / h200.total_time - 1) * 100:+.1f} | {it * 1e3:.2f} "
                f"| {e:+.1f} |"
            )
    for name, e in errs.items():
        print(f"{name}: worst |error| {max(map(abs, e)):.1f} % (target 5 %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
