"""Fit a calibration table on real GPU traces (perfmodel.calibrated) and write it as JSON.

    python -m perfmodel.calibrate shared/reference/triosim-go-traces/vgg13 \
        shared/reference/triosim-go-traces/resnet50 --source "..."

writes perfmodel/calibration/h100.json (the shipped table), with the leave-one-trace-out
error of the same fit in its "heldout" field.
"""

from __future__ import annotations

from pathlib import Path

from perfmodel.calibrated import CALIBRATION_DIR, DEFAULT_GPU, FORMS, fit, heldout


def main(argv=None) -> int:
    """Refit a table: python -m perfmodel.calibrate [--form max|sum] TRACE..."""
    import argparse

    from triosim.trace.files import load_any_trace

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument(
        "traces", nargs="+", help="real traces of one GPU (files or TrioSim CSV folders)"
    )
    ap.add_argument("--gpu", default=DEFAULT_GPU)
    ap.add_argument("--form", default="max", choices=FORMS)
    ap.add_argument("--out", default=str(CALIBRATION_DIR / "h100.json"))
    ap.add_argument("--source", default="", help="where the traces come from (recorded)")
    args = ap.parse_args(argv)
    traces = {Path(p).name.split(".")[0]: load_any_trace(p) for p in args.traces}
    cal = fit(
        list(traces.values()), args.gpu, args.form, args.source or "fitted on " + ", ".join(traces)
    )
    if len(traces) > 1:
        cal.heldout = heldout(traces, args.gpu, args.form)
    print(f"wrote {cal.save(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
