"""How well the learned operator model predicts real GPU traces from their shapes alone.

Every real H100 trace the project ships (traces/h100/: the tracer's and the imported
profiles) is predicted by a table fitted without any trace of its model (leave one model
out: ResNet-50's four traces are left out together, Llama-3.2-1B's three), in each form of
perfmodel.learned (const, curve, boost), so the choice of form is visible:

- "from its shapes": the real trace's own operators, their times replaced by the model's;
- "shape-only twin": `triosim trace MODEL --shapes-only` of the same model, batch and
  sequence (benchmarks/shape_twins.py; needs torch, cached in out/twins/), as a user gets it.

Columns: the sum of operator times against the trace's (operators only), and the one-GPU
iteration (mode single, the host model on: op_cost 12.9 us for the tracer's machine, and
for the profiles' machine fitted on DenseNet-121 b32 as benchmarks/host_fit.py does) against
the plain measured time (../shared/gpu/timings.json for the tracer's traces, the pairs'
README.json wall time carried by the imported ones). Then, for the chosen form, per
operator family: the error of the family's summed time over every trace.
Targets (issue 32): median |iteration error| <= 5 %, worst <= 10 %; the three Llama-3.2-1B
shapes each within 10 %.
Run: PYTHONPATH=. python benchmarks/modelled_vs_real.py [--no-twins] [--forms boost]
"""

from __future__ import annotations

import argparse
import copy
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from perfmodel.host import HostOptions
from perfmodel.kinds import op_kind
from perfmodel.learned import DEFAULT_FORM, FORMS, fit
from perfmodel.refit import model_of, real_traces
from triosim.hardware import catalogue as hardware
from triosim.simulation.wiring import Simulation
from triosim.studies.host_fit import fit_op_cost

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "gpu"
GPU = "H100-SXM"


def plain_times(traces: dict) -> dict:
    """name -> the plain measured iteration time (s), where known."""
    out = {}
    timings = SHARED / "timings.json"
    doc = json.loads(timings.read_text()) if timings.exists() else {}
    plain = {
        (r["model"], r["batch"]): r["mean_ms"] * 1e-3 for r in doc.get("h100", {}).get("timing", [])
    }
    for n, t in traces.items():
        if t.metadata.get("imported"):
            out[n] = t.metadata.get("measured_iteration_time")
        elif (t.metadata.get("model"), t.batch_size) in plain:
            out[n] = plain[(t.metadata["model"], t.batch_size)]
    return {n: v for n, v in out.items() if v}


def host_options(traces: dict, plain: dict) -> dict:
    """name -> the host model of the machine its trace was taken on."""
    fit_on = next((n for n in traces if "imported/densenet121-b32" in n), None)
    pairs = HostOptions(model="on")
    if fit_on and fit_on in plain:
        pairs = HostOptions(model="on", op_cost=fit_op_cost(traces[fit_on], plain[fit_on]))
    return {
        n: pairs if t.metadata.get("imported") else HostOptions(model="on")
        for n, t in traces.items()
    }


def timed(trace, times):
    """A copy of `trace` with the given operator times, marked modelled."""
    t = copy.deepcopy(trace)
    for op, x in zip(t.operators, times, strict=True):
        op.time = float(x)
    t.metadata.update({"gpu": GPU, "modelled": True, "device": "cuda"})
    return t


def one_gpu(trace, host: HostOptions) -> float:
    cfg = {"num_gpus": 1, "parallelism": {"mode": "single"}, "host": host.__dict__}
    return Simulation(cfg, trace=trace).run().iteration_time


def predict(traces: dict, twins: dict, form: str) -> dict:
    """name -> (predicted operator times of the real trace, of its twin or None)."""
    g = hardware.gpu(GPU)
    models = {n: model_of(t) for n, t in traces.items()}
    out = {}
    for m in sorted(set(models.values())):
        table = fit([t for n, t in traces.items() if models[n] != m], GPU, form)
        for n, t in traces.items():
            if models[n] == m:
                tw = twins.get(n)
                out[n] = (
                    table.times(t, t.operators, g),
                    table.times(tw, tw.operators, g) if tw is not None else None,
                )
    return out


def pct(a, b):
    return f"{(a / b - 1) * 100:+.1f}" if b else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-twins", action="store_true", help="skip the shape-only twins")
    ap.add_argument("--forms", default=",".join(FORMS))
    a = ap.parse_args(argv)
    traces = real_traces(ROOT / "traces" / "h100", GPU)
    plain = plain_times(traces)
    if not plain:
        print(f"no plain measured times ({SHARED} absent): iteration columns are empty")
    hosts = host_options(traces, plain)
    twins = {}
    if not a.no_twins:
        from benchmarks.shape_twins import twin

        twins = {n: twin(t) for n, t in traces.items()}
        for tw in twins.values():
            tw.metadata.update({"gpu": GPU, "device": "cuda"})
    summary = {}
    for form in a.forms.split(","):
        preds = predict(traces, twins, form)
        print(f"\n### form {form}: each trace predicted with its model left out\n")
        print(
            "| trace | ops ms | predicted | err % | plain ms | from its shapes ms | err % "
            "| shape-only twin ms | err % |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        errs, twin_errs = [], []
        for n, t in traces.items():
            p, ptw = preds[n]
            meas = plain.get(n)
            it = one_gpu(timed(t, p), hosts[n]) if meas else None
            itw = one_gpu(timed(twins[n], ptw), hosts[n]) if meas and ptw is not None else None
            if it:
                errs.append((n, it / meas - 1))
            if itw:
                twin_errs.append((n, itw / meas - 1))
            print(
                f"| {n.removesuffix('.trace.json.gz')} | {t.total_time * 1e3:.2f} | {p.sum() * 1e3:.2f} "
                f"| {pct(p.sum(), t.total_time)} | {meas * 1e3 if meas else 0:.2f} "
                f"| {it * 1e3 if it else 0:.2f} | {pct(it or 0, meas)} "
                f"| {itw * 1e3 if itw else 0:.2f} | {pct(itw or 0, meas)} |"
            )
        for label, e in (("from its shapes", errs), ("shape-only twin", twin_errs)):
            if e:
                v = np.abs([x for _, x in e]) * 100
                worst = max(e, key=lambda kv: abs(kv[1]))
                print(
                    f"\n{form}, {label}: median |iteration error| {np.median(v):.1f} %, worst "
                    f"{v.max():.1f} % ({worst[0].removesuffix('.trace.json.gz')}), {len(v)} traces"
                )
                summary[(form, label)] = (np.median(v), v.max())
        if form == DEFAULT_FORM or a.forms == form:
            kinds(traces, preds)
    if summary:
        print("\n| form | predicted from | median abs % | worst abs % |\n|---|---|---|---|")
        for (form, label), (med, worst) in summary.items():
            print(f"| {form} | {label} | {med:.1f} | {worst:.1f} |")
    return 0


def kinds(traces: dict, preds: dict) -> None:
    """Per family: the summed time over every trace, measured and predicted (real shapes),
    and the median and worst error of the family's sum per trace (families over 3 % of a
    trace's time)."""
    tot: dict[str, list] = defaultdict(lambda: [0.0, 0.0, []])
    for n, t in traces.items():
        p = preds[n][0]
        per: dict[str, list] = defaultdict(lambda: [0.0, 0.0])
        for op, x in zip(t.operators, p, strict=True):
            fam = op_kind(op)[0]
            per[fam][0] += op.time
            per[fam][1] += x
        for fam, (m, q) in per.items():
            tot[fam][0] += m
            tot[fam][1] += q
            if m > 0.03 * t.total_time:
                tot[fam][2].append(abs(q / m - 1) * 100)
    print(
        "\n| family | measured ms (all traces) | predicted ms | err % | median per-trace |err| % | worst % |"
    )
    print("|---|---|---|---|---|---|")
    for fam, (m, q, e) in sorted(tot.items(), key=lambda kv: -kv[1][0]):
        if m <= 0:
            continue
        med = f"{np.median(e):.1f}" if e else "-"
        worst = f"{max(e):.1f}" if e else "-"
        print(f"| {fam} | {m * 1e3:.1f} | {q * 1e3:.1f} | {pct(q, m)} | {med} | {worst} |")


if __name__ == "__main__":
    raise SystemExit(main())
