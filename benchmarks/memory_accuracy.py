"""Predicted against measured peak memory, for every trace whose metadata holds a measured
peak (`peak_memory_bytes`: torch.cuda.max_memory_allocated on a GPU, the profiler's memory
events on CPU; see tracer/collect.py). Each trace is simulated on one GPU at its own batch
size, as it was measured. Target (issue 15): within 5 %.

With --shapes-only (needs torch): also predict each peak from the trace's shape-only twin
(benchmarks/shape_twins.py: the same model, batch and sequence on meta tensors, cached in
out/twins/; timed by perfmodel 'learned'), against the same measurement.

Run: PYTHONPATH=. python benchmarks/memory_accuracy.py [--traces traces] [--shapes-only]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.05


def measured_traces(folder: Path):
    """(path, metadata) of every trace under `folder` that records a measured peak."""
    for f in sorted(folder.rglob("*.trace.json*")):
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            meta = json.load(fh).get("metadata", {})
        if meta.get("peak_memory_bytes"):
            yield f, meta


def _source(meta: dict) -> str:
    src = meta.get("peak_memory_source") or ""
    return "torch.cuda.max_memory_allocated" if "cuda" in src else "CPU profiler events"


def predicted_peak(trace, on_cpu: bool = False) -> float:
    """The one-GPU peak at the trace's batch; `on_cpu`: measured on a CPU, so without the
    GPU's cuBLAS workspaces (a CPU trace's twin is timed for an A100 and would get them)."""
    from triosim.simulation.wiring import Simulation

    cfg = {
        "num_gpus": 1,
        "batch_size": trace.metadata["batch_size"],
        "parallelism": {"mode": "single"},
    }
    if on_cpu:
        cfg["memory"] = {"workspace": 0}
    return Simulation(cfg, trace=trace).run().peak_memory[0]


def shape_only_twin(trace):
    """The shape-only twin of a real GPU trace (benchmarks/shape_twins.py: the same model,
    batch and sequence on meta tensors), timed for the trace's GPU by perfmodel 'learned'
    as `triosim trace --shapes-only` does; for a CPU trace, its model traced the same way
    (times for an A100: the memory model needs an order in time, not these times)."""
    from benchmarks.shape_twins import twin
    from perfmodel.modelled import model_times
    from triosim.common.errors import TrioSimError
    from triosim.hardware import catalogue as hardware

    try:
        gpu = hardware.gpu(trace.metadata.get("gpu") or "").name
    except TrioSimError:  # a CPU trace
        gpu = "A100-80GB"
    meta = trace.metadata
    if meta.get("device") == "cpu" and "small" in str(meta.get("model")):
        return None  # the --small CPU models: no reference model of that size to twin
    return model_times(twin(trace), gpu, "learned")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=str(ROOT / "traces"))
    ap.add_argument("--shapes-only", action="store_true")
    a = ap.parse_args(argv)
    from triosim.trace.model import load

    rows = []
    for f, meta in measured_traces(Path(a.traces)):
        measured = meta["peak_memory_bytes"]
        rows.append(
            (
                f.name.split(".")[0],
                "measured trace",
                measured,
                predicted_peak(load(f)),
                _source(meta),
            )
        )
        twin = shape_only_twin(load(f)) if a.shapes_only else None
        if twin is not None:
            rows.append(
                (
                    f.name.split(".")[0],
                    "shape-only twin",
                    measured,
                    predicted_peak(twin, on_cpu=meta.get("device") == "cpu"),
                    "same measurement",
                )
            )
    if not rows:
        print(f"no trace under {a.traces} records a measured peak")
        return 1
    print(
        f"{'trace':<20} {'predicted from':<16} {'measured MB':>12} {'predicted MB':>13} "
        f"{'error':>8}  measured by"
    )
    worst, worst_twin = 0.0, 0.0
    for name, kind, meas, pred, source in rows:
        err = pred / meas - 1
        if kind == "measured trace":
            worst = max(worst, abs(err))
        else:
            worst_twin = max(worst_twin, abs(err))
        print(
            f"{name:<20} {kind:<16} {meas / 1e6:>12.2f} {pred / 1e6:>13.2f} {err:>+8.1%}  {source}"
        )
    print(
        f"# worst error of the measured traces: {worst:.1%} (target {TARGET:.0%}: "
        f"{'met' if worst <= TARGET else 'MISSED'})"
    )
    if a.shapes_only:
        print(
            f"# worst error of the shape-only twins: {worst_twin:.1%} (target {TARGET:.0%}: "
            f"{'met' if worst_twin <= TARGET else 'MISSED'})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
