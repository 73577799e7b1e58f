"""Where the host model's numbers come from (perfmodel/host.py), from the real GPU data.

1. `kernel_gap` and `launch_latency`, measured (not fitted to any iteration time) from the
   imported H100 profiles (traces/h100/imported, host columns): the GPU's idle time that is
   not host wait, per kernel, in the GPU-bound profiles (the gap between queued kernels) and
   in the host-bound ones (launched, then started: the launch latency).
2. `op_cost`, fitted per host-bound run (triosim/studies/host_fit.py; a run within 5 % of
   its GPU's work alone is refused: ResNet-152 b64) of the tracer's machine
   (`timings.json`): ResNet-152 b32 and DenseNet-121 b32 from their b64 traces (operators
   scaled by the regression model), DenseNet-121 b64 replayed; each model's median, their
   mean beside the catalogue's entry for that host (perfmodel/host_cpus.py, h100-traces,
   the default). Leave one model out:
   each model's fits predict the other's b32 run. Then every real trace of that machine
   replayed with the default against its plain measured time; the profiled pairs' machine
   (`et_pairs/README.json`) fitted on DenseNet-121 b32 (the catalogue's h100-profiles).
3. Why the trace's own host column is not the default source: the same fit with `source:
   trace` (the profiled host spans x a fitted `trace_scale`) on DenseNet-121 b32 predicts
   the pairs.
Needs ../shared/gpu (says so and stops without it). Prints Markdown tables.
Run: python benchmarks/host_fit.py
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from perfmodel.host import OP_COST, HostOptions
from perfmodel.host_cpus import DEFAULT_CPU, HOST_CPUS
from triosim.common.errors import ConfigError
from triosim.studies.host_fit import fit_kernel_gap, fit_op_cost, fit_option, replay_time
from triosim.trace.model import load

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "gpu"


def measured_gaps():
    """(median gap per kernel in GPU-bound profiles, median in host-bound ones), seconds."""
    bound, free = [], []
    for path in sorted((ROOT / "traces" / "h100" / "imported").glob("*.trace.json.gz")):
        ops = load(path).operators
        kernels = sum(o.kernels for o in ops if o.time > 0)
        wait = sum(o.host_wait or 0.0 for o in ops)
        gap = sum((o.gpu_idle or 0.0) - (o.host_wait or 0.0) for o in ops) / kernels
        (bound if wait > 0.1 * sum(o.time for o in ops) else free).append((path.name, gap))
    return free, bound


def tracer_traces() -> dict:
    doc = json.loads((SHARED / "timings.json").read_text())
    out = {}
    for gpu in ("h100", "h200"):
        plain = {(r["model"], r["batch"]): r["mean_ms"] * 1e-3 for r in doc[gpu]["timing"]}
        for path in sorted((ROOT / "traces" / gpu).glob("*.trace.json.gz")):
            t = load(path)
            key = (t.metadata["model"], t.batch_size)
            out[f"{gpu} {key[0]} b{key[1]}"] = (t, plain[key])
    return out


def pair_traces() -> dict:
    doc = json.loads((SHARED / "et_pairs" / "README.json").read_text())
    wall = {r["tag"]: r["wall_ms_mean"] * 1e-3 for r in doc["runs"]}
    folder = ROOT / "traces" / "h100" / "imported"
    return {tag: (load(folder / f"{tag}.trace.json.gz"), w) for tag, w in wall.items()}


def predict(traces: dict, fit_on: tuple, host: HostOptions) -> list:
    rows = []
    for name, (t, plain) in traces.items():
        sim = replay_time(t, host)
        rows.append((name, plain, t.total_time, sim, name in fit_on))
    return rows


def table(title: str, rows: list) -> None:
    print(f"\n{title}\n")
    print("| trace | plain measured ms | sum of GPU time ms | simulated ms | error % |")
    print("|---|---|---|---|---|")
    errs = []
    for name, plain, gpu_sum, sim, fitted in rows:
        err = (sim - plain) / plain * 100
        if not fitted:
            errs.append(abs(err))
        note = " (fitted on)" if fitted else ""
        print(
            f"| {name}{note} | {plain * 1e3:.2f} | {gpu_sum * 1e3:.2f} | {sim * 1e3:.2f} "
            f"| {err:+.1f} |"
        )
    print(
        f"\nheld out: {len(errs)} traces, mean |error| {statistics.mean(errs):.1f} %, "
        f"worst {max(errs):.1f} %"
    )


def main() -> int:
    if not SHARED.exists():
        print(f"no real GPU data: {SHARED} is absent")
        return 0
    free, bound = measured_gaps()
    print("| imported profile | GPU-bound | idle not waiting for the host, per kernel, us |")
    print("|---|---|---|")
    for name, gap in free + bound:
        print(
            f"| {name.split('.')[0]} | {'yes' if (name, gap) in free else 'no'} | {gap * 1e6:.2f} |"
        )
    print(
        f"\nkernel gap: median of the GPU-bound {statistics.median(g for _, g in free) * 1e6:.2f} us;"
        f" launch latency: the host-bound {', '.join(f'{g * 1e6:.1f}' for _, g in bound)} us"
    )

    tracer = tracer_traces()
    gap_on = "h100 resnet50 b128"  # GPU-bound: its time decides the gap, not the host
    t, plain = tracer[gap_on]
    gap = fit_kernel_gap(t, plain)
    print(f"\nkernel gap fitted on {gap_on} (plain {plain * 1e3:.2f} ms): {gap * 1e6:.3f} us")
    doc = json.loads((SHARED / "timings.json").read_text())
    plain_ms = {(r["model"], r["batch"]): r["mean_ms"] * 1e-3 for r in doc["h100"]["timing"]}
    runs = {  # host-bound runs: (trace, batch or None for its own, measured)
        "resnet152 b32": ("h100 resnet152 b64", 32),
        "densenet121 b32": ("h100 densenet121 b64", 32),
        "densenet121 b64": ("h100 densenet121 b64", None),
    }
    try:
        fit_op_cost(*tracer["h100 resnet152 b64"])
    except ConfigError as e:
        print(f"\nResNet-152 b64 (80.50 ms) refused: {e}")
    print("\n| host-bound run | measured ms | op_cost fitted, us |\n|---|---|---|")
    fits = {}
    for name, (key, batch) in runs.items():
        model, b = name.split(" b")
        measured = plain_ms[(model, int(b))]
        kind = "regression" if batch else "trace"
        fits[name] = fit_op_cost(tracer[key][0], measured, None, batch, kind)
        print(f"| {name} | {measured * 1e3:.2f} | {fits[name] * 1e6:.3f} |")
    per_model = {
        m: statistics.median(v for k, v in fits.items() if k.startswith(m))
        for m in ("resnet152", "densenet121")
    }
    default = statistics.mean(per_model.values())
    entry = HOST_CPUS[DEFAULT_CPU]
    print(
        f"\neach model's median ({', '.join(f'{m} {c * 1e6:.2f}' for m, c in per_model.items())}"
        f" us), their mean {default * 1e6:.3f} us: the catalogue's {entry.name} "
        f"(perfmodel/host_cpus.py) holds {entry.op_cost * 1e6:g} us"
    )
    print("\nleave one model out: one model's fits (median) predict the other's b32 run\n")
    print("| fitted on | op_cost us | predicted run | measured ms | predicted ms | error % |")
    print("|---|---|---|---|---|---|")
    for on, other in (("resnet152", "densenet121"), ("densenet121", "resnet152")):
        cost = statistics.median(v for k, v in fits.items() if k.startswith(on))
        key, batch = runs[f"{other} b32"]
        sim = replay_time(
            tracer[key][0], HostOptions(model="on", op_cost=cost), batch, "regression"
        )
        measured = plain_ms[(other, 32)]
        print(
            f"| {on} | {cost * 1e6:.2f} | {other} b32 | {measured * 1e3:.2f} | {sim * 1e3:.2f} "
            f"| {(sim / measured - 1) * 100:+.1f} |"
        )
    fitted = (gap_on, "h100 densenet121 b64")  # the kernel gap; a run of the default op_cost
    rows = predict(tracer, fitted, HostOptions(model="on", op_cost=OP_COST, kernel_gap=gap))
    table(
        f"Tracer traces (timings.json machine) at their own batch, op_cost {OP_COST * 1e6:g} us "
        f"(the default), kernel gap on {gap_on}:",
        rows,
    )

    pairs = pair_traces()
    fit_on = "densenet121-b32"
    t, plain = pairs[fit_on]
    cost = fit_op_cost(t, plain)
    table(
        f"Imported profiles (et_pairs machine), op_cost {cost * 1e6:.2f} us fitted on {fit_on} "
        f"(the catalogue's h100-profiles: {HOST_CPUS['h100-profiles'].op_cost * 1e6:g} us):",
        predict(pairs, (fit_on,), HostOptions(model="on", op_cost=cost)),
    )

    # the profiled host spans as the source: one scale fitted on the same trace
    base = HostOptions(model="on", source="trace")
    # (trace_scale > 0: the bisection starts just above it)
    scale = fit_option(t, plain, "trace_scale", base, 1.0, 1e-6, host_bound=True, lower=1e-9)
    opts = dataclasses.replace(base, trace_scale=scale)
    table(
        f"Imported profiles, source: trace (profiled host spans x {opts.trace_scale:.3f}, "
        f"fitted on {fit_on}):",
        predict(pairs, (fit_on,), opts),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
