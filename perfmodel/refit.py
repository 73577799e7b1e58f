"""Refit the learned operator model's table on every real trace of a GPU the project ships.

    python -m perfmodel.refit                      # traces/h100/** -> calibration/h100-learned.json
    python -m perfmodel.refit --gpu H200 --traces traces/h200 --out my-h200.json

Real traces: every *.trace.json.gz under the folder (recursively) that is neither modelled
nor shape-only and names the GPU (the tracer's traces and imported profiles alike). The
table records, per form, the held-out error of the sum of operator times with one model
left out at a time (`lomo`: every trace of a model predicted by a table fitted on the other
models' traces), so the form's choice can be read from it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from perfmodel.base import has_measured_times
from perfmodel.learned import DEFAULT_FORM, FORMS, SHIPPED, fit
from triosim.common.errors import TrioSimError
from triosim.hardware import catalogue as hardware
from triosim.trace.model import Trace

ROOT = Path(__file__).resolve().parents[1]
_TAG = re.compile(r"^(?P<model>.+?)-b\d+(?:-s\d+)?(?:-l\d+)?$")


def model_of(trace: Trace) -> str:
    """The model a trace is of (an imported profile's tag 'gpt2-b8-s512' -> 'gpt2')."""
    name = str(trace.metadata.get("model") or "")
    hit = _TAG.match(name) if trace.metadata.get("imported") else None
    return hit.group("model") if hit else name


def real_traces(folder, gpu: str) -> dict[str, Trace]:
    """name (path under `folder`) -> trace, for the real traces of `gpu` under `folder`."""
    from triosim.trace.model import load

    want = hardware.gpu(gpu).name
    out = {}
    for p in sorted(Path(folder).rglob("*.trace.json.gz")):
        t = load(p)
        try:
            same = hardware.gpu(t.metadata.get("gpu") or "").name == want
        except TrioSimError:
            same = False
        if same and has_measured_times(t):
            out[str(p.relative_to(folder))] = t
    return out


def lomo(traces: dict[str, Trace], gpu: str, form: str) -> dict[str, float]:
    """Leave one model out: name -> error (fraction) of the sum of operator times when the
    table is fitted on the other models' traces."""
    g = hardware.gpu(gpu)
    models = {n: model_of(t) for n, t in traces.items()}
    out = {}
    for m in sorted(set(models.values())):
        table = fit([t for n, t in traces.items() if models[n] != m], gpu, form)
        for n, t in traces.items():
            if models[n] == m:
                pred = float(np.sum(table.times(t, t.operators, g)))
                out[n] = pred / t.total_time - 1
    return out


def main(argv=None) -> int:
    """Refit the learned table: python -m perfmodel.refit [--traces DIR] [--gpu NAME]"""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--traces", type=Path, default=ROOT / "traces" / "h100")
    ap.add_argument("--gpu", default="H100-SXM")
    ap.add_argument("--form", default=DEFAULT_FORM, choices=FORMS)
    ap.add_argument("--out", type=Path, default=SHIPPED)
    ap.add_argument("--no-heldout", action="store_true", help="skip the leave-one-model-out check")
    a = ap.parse_args(argv)
    traces = real_traces(a.traces, a.gpu)
    if not traces:
        print(f"no real {a.gpu} trace under {a.traces}")
        return 1
    models = sorted({model_of(t) for t in traces.values()})
    source = (
        f"{len(traces)} real {hardware.gpu(a.gpu).name} traces under {a.traces.name}/ "
        f"({', '.join(models)}): measured operator times"
    )
    table = fit(list(traces.values()), a.gpu, a.form, source)
    if not a.no_heldout and len(models) > 1:
        for form in FORMS:
            errs = lomo(traces, a.gpu, form)
            e = np.abs(list(errs.values())) * 100
            table.heldout[form] = {
                "median_abs_pct": round(float(np.median(e)), 2),
                "worst_abs_pct": round(float(e.max()), 2),
                "per_trace_pct": {n: round(v * 100, 2) for n, v in errs.items()},
            }
            print(
                f"{form:<6} leave one model out: median |error| {np.median(e):.1f} %, worst {e.max():.1f} %"
            )
    print(f"wrote {table.save(a.out)} ({len(table.samples.y)} merged samples, form {a.form})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
