"""Predicted against measured peak memory, for every trace whose metadata holds a measured
peak (`peak_memory_bytes`: torch.cuda.max_memory_allocated on a GPU, the profiler's memory
events on CPU; see tracer/collect.py). Each trace is simulated on one GPU at its own batch
size, as it was measured. Target (issue 15): within 5 %.

With --shapes-only (needs torch): also trace each measured model on meta tensors at the same
batch and predict its peak from that shape-only trace, against the same measurement.

Run: PYTHONPATH=. python benchmarks/memory_accuracy.py [--traces traces] [--shapes-only]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import tempfile
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


def predicted_peak(trace) -> float:
    from triosim.simulation.wiring import Simulation

    cfg = {
        "num_gpus": 1,
        "batch_size": trace.metadata["batch_size"],
        "parallelism": {"mode": "single"},
    }
    return Simulation(cfg, trace=trace).run().peak_memory[0]


def shape_only_twin(meta: dict, out: Path):
    """A shape-only trace (times from the calibrated A100 model) of the measured model at
    its batch: the shipped CPU traces' models, by the name the tracer gave them."""
    from triosim.cli.main import main as cli
    from triosim.trace.model import load

    name = meta["model"]
    args = [
        "trace",
        name.split("-")[0],
        "--batch-size",
        str(meta["batch_size"]),
        "--shapes-only",
        "--gpu",
        "A100-80GB",
        "--out",
        str(out),
    ]
    if name.split("-")[0] in ("gpt2", "bert") and "small" in name:
        args.append("--small")
    with contextlib.redirect_stdout(io.StringIO()):  # the trace command's own report
        cli(args)
    return load(next(out.glob("*.trace.json*")))


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
        if a.shapes_only:
            with tempfile.TemporaryDirectory() as tmp:
                twin = shape_only_twin(meta, Path(tmp))
                rows.append(
                    (
                        f.name.split(".")[0],
                        "shape-only twin",
                        measured,
                        predicted_peak(twin),
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
    worst = 0.0
    for name, kind, meas, pred, source in rows:
        err = pred / meas - 1
        worst = max(worst, abs(err)) if kind == "measured trace" else worst
        print(
            f"{name:<20} {kind:<16} {meas / 1e6:>12.2f} {pred / 1e6:>13.2f} {err:>+8.1%}  {source}"
        )
    print(
        f"# worst error of the measured traces: {worst:.1%} (target {TARGET:.0%}: "
        f"{'met' if worst <= TARGET else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
