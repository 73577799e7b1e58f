"""Batch-size scaling accuracy of the operator models on the shipped traces.

For every model with traces at several batch sizes (traces/<device>/*.trace.json.gz),
predict each batch size's iteration time from one other batch size's trace (the
regression model's single-trace FLOP-ratio scaling), and from all the other traces
together (per-operator lines). Errors are against the measured iteration time (mean of
the timed iterations) and against the target trace's own sum of operator times, which
isolates the model's error from the profiler overhead inside traced operator times.
Run: python benchmarks/batch_scaling.py [traces-folder]
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from perfmodel import LinearRegressionModel, Target
from triosim.trace.model import load

ROOT = Path(__file__).resolve().parents[1]


def groups(folder: Path):
    by_model = defaultdict(dict)
    for p in sorted(folder.rglob("*.trace.json.gz")):
        t = load(p)
        key = (p.parent.name, t.metadata.get("model", p.name))
        by_model[key][t.batch_size] = t
    return {k: v for k, v in by_model.items() if len(v) > 1}


def predict(source, target_batch, extra=()):
    model = LinearRegressionModel(source, extra_traces=list(extra))
    return model.iteration_time(Target(batch_size=target_batch))


def rows(folder: Path, pairs=None):
    out = []
    for (device, name), traces in groups(folder).items():
        for bt, target in sorted(traces.items()):
            measured = target.metadata.get("measured_iteration_time")
            sources = [(bs, s) for bs, s in sorted(traces.items()) if bs != bt]
            if pairs is not None:
                sources = [(bs, s) for bs, s in sources if (bs, bt) in pairs]
            for bs, s in sources:
                out.append(
                    (device, name, f"b{bs}", bt, predict(s, bt), measured, target.total_time)
                )
            others = [s for bs, s in sorted(traces.items()) if bs != bt]
            if pairs is None and len(others) >= 2:
                p = predict(others[0], bt, others[1:])
                out.append((device, name, "all others", bt, p, measured, target.total_time))
    return out


def table(out) -> float:
    print(
        f"{'device':<8} {'model':<14} {'from':<11} {'batch':>5} {'predicted ms':>13} "
        f"{'measured ms':>12} {'err %':>7} {'op-sum ms':>10} {'err %':>7}"
    )
    errs_m, errs_s = [], []
    for device, name, src, bt, pred, meas, opsum in out:
        em = abs(pred - meas) / meas * 100 if meas else float("nan")
        es = abs(pred - opsum) / opsum * 100
        errs_m.append(em)
        errs_s.append(es)
        print(
            f"{device:<8} {name:<14} {src:<11} {bt:>5} {pred * 1e3:>13.3f} "
            f"{(meas or float('nan')) * 1e3:>12.3f} {em:>7.2f} {opsum * 1e3:>10.3f} {es:>7.2f}"
        )
    for name in sorted({r[1] for r in out}):
        pick = [k for k, r in enumerate(out) if r[1] == name]
        print(
            f"  {name}: mean error {sum(errs_m[k] for k in pick) / len(pick):.2f}% vs measured, "
            f"{sum(errs_s[k] for k in pick) / len(pick):.2f}% vs op-sum"
        )
    if out:
        mm = sum(errs_m) / len(errs_m)
        ms = sum(errs_s) / len(errs_s)
        print(f"mean absolute error: {mm:.2f}% vs measured, {ms:.2f}% vs the target trace's op-sum")
        return mm
    print("no model has traces at two or more batch sizes here")
    return float("nan")


if __name__ == "__main__":
    table(rows(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "traces"))
