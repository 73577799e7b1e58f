"""How well the calibrated operator model predicts real GPU operator times it was not fitted on.

For every GPU with two or more real traces (the original TrioSim's H100 traces in
shared/reference/triosim-go-traces when present, and any real GPU trace under traces/<gpu>/),
leave one trace out: fit the calibration on the others, predict every operator of the one
left out, and compare with its measured times, per operator kind and per iteration (the sum
of operator times). Both forms of the model are shown, and a baseline: the plain roofline
with one efficiency per operator name fitted on the other traces and no fixed overhead.
Run: python benchmarks/modelled_vs_real.py [--shared DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import defaultdict
from pathlib import Path

from perfmodel import Roofline, Target
from perfmodel.calibrated import FORMS, heldout, op_kind
from triosim.common.errors import TrioSimError
from triosim.hardware import catalogue as hardware
from triosim.trace.files import import_csv
from triosim.trace.model import load

ROOT = Path(__file__).resolve().parents[1]


def go_traces(shared: Path | None) -> dict:
    for s in [shared] if shared else [ROOT / "shared", ROOT.parent / "shared"]:
        d = s / "reference" / "triosim-go-traces" if s else None
        if d and d.is_dir():
            return {
                f"{p.name} (TrioSim Go)": import_csv(p, gpu="H100-SXM")
                for p in sorted(d.iterdir())
                if (p / "trace.csv").exists()
            }
    return {}


def shipped_gpu_traces() -> dict:
    """Real traces the tracer took on a GPU: traces/<gpu>/, never modelled ones."""
    out = {}
    for p in sorted((ROOT / "traces").rglob("*.trace.json.gz")):
        if "modelled" in p.parts or p.parent.name == "cpu":
            continue
        t = load(p)
        if t.metadata.get("modelled") or t.metadata.get("shapes_only"):
            continue
        try:
            hardware.gpu(t.metadata.get("gpu") or "")
        except TrioSimError:
            continue
        out[str(p.relative_to(ROOT))] = t
    return out


def baseline(traces: dict, name: str, gpu: str) -> dict:
    """Per-name roofline efficiency fitted on the other traces; no overhead."""
    test = traces[name]
    g = hardware.gpu(gpu)
    sums: dict[str, list] = defaultdict(lambda: [0.0, 0.0])
    for n, t in traces.items():
        if n == name:
            continue
        r = Roofline(t, source_gpu=gpu)
        for op in t.operators:
            roof = r.roof(op, g, Target())
            if op.time > 0 and roof > 0:
                sums[op.name][0] += roof
                sums[op.name][1] += op.time
    eff = {k: r_ / t_ for k, (r_, t_) in sums.items()}
    default = sum(v[0] for v in sums.values()) / sum(v[1] for v in sums.values())
    r = Roofline(test, source_gpu=gpu)
    kinds: dict[str, list] = defaultdict(lambda: [0.0, 0.0])
    for op in test.operators:
        p = r.roof(op, g, Target()) / eff.get(op.name, default)
        fam = op_kind(op)[0]
        kinds[fam if fam != "none" else "no kernel"][0] += op.time
        kinds[fam if fam != "none" else "no kernel"][1] += p
    return kinds


def report(traces: dict, gpu: str) -> None:
    print(
        f"\n=== {gpu}: {len(traces)} real traces; each predicted by a table fitted on the "
        "others ==="
    )
    results = {form: heldout(traces, gpu, form) for form in FORMS}
    summary = []
    for name in traces:
        print(f"\n-- {name}")
        print(
            f"{'kind':<16} {'ops':>4} {'measured ms':>12} "
            + " ".join(f"{f + ' form ms':>10} {'err %':>7} {'med op %':>8}" for f in FORMS)
            + f" {'roofline ms':>11} {'err %':>7}"
        )
        base = baseline(traces, name, gpu)
        kinds = results[FORMS[0]][name]["kinds"]
        for k in kinds:
            row = f"{k:<16} {kinds[k]['ops']:>4} {kinds[k]['measured_ms']:>12.3f} "
            for form in FORMS:
                v = results[form][name]["kinds"].get(k)
                err = v["sum_error_pct"]
                med = v["median_op_error_pct"]
                row += (
                    f"{v['predicted_ms']:>10.3f} {'' if err is None else f'{err:+.1f}':>7} "
                    f"{'' if med is None else f'{med:.1f}':>8} "
                )
            b = base.get(k, [0.0, 0.0])
            be = (b[1] - b[0]) / b[0] * 100 if b[0] else None
            row += f"{b[1] * 1e3:>11.3f} {'' if be is None else f'{be:+.1f}':>7}"
            print(row)
        meas = results[FORMS[0]][name]["measured_ms"]
        btot = sum(v[1] for v in base.values()) * 1e3
        line = f"{'iteration':<16} {'':>4} {meas:>12.3f} "
        for form in FORMS:
            r = results[form][name]
            line += f"{r['predicted_ms']:>10.3f} {r['error_pct']:>+7.1f} {'':>8} "
        line += f"{btot:>11.3f} {(btot - meas) / meas * 100:>+7.1f}"
        print(line)
        summary.append(
            [abs(results[f][name]["error_pct"]) for f in FORMS] + [abs(btot - meas) / meas * 100]
        )
    print(
        "\nmean absolute iteration error: "
        + ", ".join(
            f"{f} form {statistics.mean(s[i] for s in summary):.1f}%" for i, f in enumerate(FORMS)
        )
        + f", per-name roofline without overhead {statistics.mean(s[-1] for s in summary):.1f}%"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shared",
        type=Path,
        default=os.environ.get("TRIOSIM_SHARED"),
        help="the shared/ folder (default: $TRIOSIM_SHARED, <repo>/shared, <repo>/../shared)",
    )
    args = ap.parse_args()
    by_gpu: dict[str, dict] = defaultdict(dict)
    for name, t in {**go_traces(args.shared), **shipped_gpu_traces()}.items():
        by_gpu[hardware.gpu(t.metadata["gpu"]).name][name] = t
    if not by_gpu:
        print("no real GPU traces found (shared/reference/triosim-go-traces, traces/<gpu>/)")
    for gpu, traces in by_gpu.items():
        if len(traces) < 2:
            print(f"{gpu}: one real trace ({next(iter(traces))}); leaving one out needs two")
            continue
        report(traces, gpu)


if __name__ == "__main__":
    main()
