"""The commands over many runs and saved results: `sweep`, `compare`, `plot`; each with its
arguments (`*_arguments(sub)` adds the command to the parser and sets its `cmd_*`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from triosim.cli.common import (
    clear_earlier,
    out_path,
    parse_assignment,
    positive_int,
    spare_inputs,
    taken,
    writable,
)
from triosim.common.errors import InputError

# -- sweep ----------------------------------------------------------------------------------------

SHOWN = (
    "iteration_time_ms",
    "compute_ms_mean",
    "comm_ms_mean",
    "exposed_comm_ms_mean",
    "idle_ms_mean",
)


def _sweep_folder(out, stem: str, force: bool, pts, retry_failed: bool):
    """The folder and its plan: --out (resumed if it holds this grid's table; refused if
    it holds anything else, unless --force), or out/<stem>/ resumed likewise, else the
    first free out/<stem>-2/, -3/, ..."""
    from triosim.studies import sweep as sw

    def has_table(folder):
        return any((folder / f"{sw.TABLE}.{e}").exists() for e in ("csv", "parquet"))

    if out is not None:
        folder = Path(out)
        if folder.exists() and not folder.is_dir():
            raise InputError(f"--out {folder} is a file, expected a folder")
        if taken(folder) and not has_table(folder) and not force:
            raise InputError(
                f"--out {folder} already holds files and no sweep table; pass "
                "--force to write there anyway, or name another folder"
            )
        return writable(folder), sw.plan(pts, folder, retry_failed, fresh=force)
    n = 1
    while True:
        folder = Path("out") / (stem if n == 1 else f"{stem}-{n}")
        if force or not taken(folder):
            return writable(folder), sw.plan(pts, folder, retry_failed, fresh=True)
        if has_table(folder):
            try:
                return writable(folder), sw.plan(pts, folder, retry_failed)
            except InputError:
                pass  # another sweep's table: not this one
        n += 1


def _sweep_where(workers, scheduler) -> str:
    if scheduler:
        return f"on the Dask cluster at {scheduler}"
    if workers <= 1:
        return "in this process"
    from triosim.studies import sweep as sw

    kind = "a local Dask cluster of" if sw._have_dask() else "local processes (no Dask installed):"
    return f"on {kind} {workers} worker processes"


def _note_dropped(pts) -> None:
    """A note per group of points whose selector left base fields out (of another part)."""
    dropped: dict = {}  # the points' selector values -> base fields left out of them
    for p in pts:
        if p.dropped:
            sections = {f.split(".")[0] for f in p.dropped}
            where = ", ".join(
                f"{k}={v}" for k, v in p.params.items() if k.split(".")[0] in sections
            )
            dropped.setdefault(where, set()).update(p.dropped)
    for where, fields in dropped.items():
        print(
            f"note: with {where}, the base's {', '.join(sorted(fields))} (fields of another "
            "part) are left out"
        )


def _say_resuming(folder: Path, plan) -> None:
    done = len(plan.earlier) - plan.failed_kept
    print(
        f"resuming {folder}/: {done} finished earlier, "
        + (
            f"{plan.failed_kept} failed earlier (kept: --retry-failed reruns them), "
            if plan.failed_kept
            else ""
        )
        + (f"{plan.retried} failed earlier (retried), " if plan.retried else "")
        + (f"{len(plan.todo)} to run" if plan.todo else "nothing to run")
    )


def _print_sweep_table(df, pts, bad) -> None:
    """Each point's parameters and SHOWN results (and error, cut to 80 characters)."""
    import pandas as pd

    params = list(dict.fromkeys(k for p in pts for k in p.params))
    shown = df[["point", *params, *(c for c in SHOWN if c in df)]].copy()
    if bad.any():
        shown["error"] = [
            f"{t}: {e}"[:80] if b else ""
            for t, e, b in zip(df["error_type"], df["error"], bad, strict=True)
        ]
    with pd.option_context("display.max_rows", 200, "display.width", 200):
        print()
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.4f}"))


def cmd_sweep(args) -> int:
    from triosim.studies import sweep as sw

    path = Path(args.grid)
    spec = sw.read_grid(path, [parse_assignment(a) for a in args.set or []])
    sizes = [f"{len(v)} {k}" for k, v in spec.grid.items()]
    if spec.zipped:
        sizes.append(f"{len(next(iter(spec.zipped.values())))} zipped ({', '.join(spec.zipped)})")
    # the count first: checking a large grid's points takes a while (a bar shows it)
    print(
        f"sweep {path}: {sw.count(spec.grid, spec.zipped)} points ({' x '.join(sizes)})", flush=True
    )
    pts = sw.points(spec.base, spec.grid, spec.zipped, spec.base_dir, spec.grid_dir, progress=True)
    folder, plan = _sweep_folder(args.out, path.stem, args.force, pts, args.retry_failed)
    if args.force:  # start over: no table or figure of an earlier run beside the new ones
        from triosim.common.outputs import written_before

        own = [f"{sw.TABLE}.csv", f"{sw.TABLE}.parquet"]
        from triosim.config.inputs import input_files

        # every point's inputs (traces, path options, workloads), as every writer's
        inputs = [path, spec.base_file, *{f for p in pts for f in input_files(p.config)}]
        spare_inputs(folder, [*own, *written_before(folder, "sweep")], [i for i in inputs if i])
        clear_earlier(folder, own, "sweep")
    _note_dropped(pts)
    if plan.earlier or plan.retried:
        _say_resuming(folder, plan)
    # no more worker processes than points to run (--workers 1000 for 12 points: 12)
    workers = max(1, min(args.workers or os.cpu_count() or 1, len(plan.todo)))
    if plan.todo:
        print(f"running {len(plan.todo)} points {_sweep_where(workers, args.scheduler)}")
    try:
        df = sw.sweep_to(folder, plan, workers, args.scheduler)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: the points finished so far are in {folder}/{sw.TABLE}.csv; "
            "rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    bad = sw.failed(df)
    _print_sweep_table(df, pts, bad)
    files = " and ".join(str(f) for f in sw.write_table(df, folder))
    print(f"\ntable written to {files} ({len(df)} rows, {len(df.columns)} columns)")
    if bad.any():  # the table is written; the exit status says not every point ran
        print(
            f"error: {int(bad.sum())} of {len(df)} points failed (the error_type and error "
            "columns say why)",
            file=sys.stderr,
        )
        return 1
    return 0


# -- compare -----------------------------------------------------------------------------------------


def _png_out(out, default: Path, force: bool, inputs=()) -> Path:
    """Where a figure goes: --out (refused if it is one of `inputs`, always, or exists,
    unless --force), else `default` or the first free NAME-2.png, -3.png, ... beside it."""
    from triosim.common.outputs import refuse_inputs

    if out is not None:
        path = Path(out)
        refuse_inputs(path, inputs)
        if path.is_dir():
            raise InputError(f"--out {path} is a folder; name a .png file")
        if path.suffix.lower() != ".png":
            raise InputError(f"--out {path}: name a .png file")
        if path.exists() and not force:
            raise InputError(f"--out {path} exists; pass --force to overwrite it")
    else:
        path, n = default, 1
        while path.exists() and not force:
            n += 1
            path = default.with_name(f"{default.stem}-{n}{default.suffix}")
    writable(path.parent)
    return path


def cmd_compare(args) -> int:
    from triosim.config.loading import from_dict, read_yaml
    from triosim.studies import compare

    if len(args.runs) < 2:
        raise InputError("compare needs two runs or more (configs or result folders)")
    from triosim.config.inputs import input_files

    inputs: list = []  # what the runs read: never the chart
    for a in args.runs:  # every mistake before the first simulation
        p = Path(a)
        if p.is_dir():
            if not (p / "summary.json").is_file():
                raise InputError(f"{p} is a folder without summary.json: not a saved result")
            inputs += list(p.iterdir())
        elif p.exists():
            inputs += input_files(from_dict(read_yaml(p), base_dir=p.parent), p)
        else:
            raise InputError(f"{p} does not exist (give a config file or a result folder)")
    png = _png_out(args.out, Path(), args.force, inputs) if args.out else None
    runs = [compare.load(a) for a in args.runs]
    print(compare.format_table(runs))
    if png is not None:
        compare.plot(runs, png)
        print(f"\nchart written to {png}")
    return 0


# -- plot ---------------------------------------------------------------------------------------------


def _noted(png: Path, folder: Path, kind: str) -> None:
    """A figure written into the output folder it draws is listed in its manifest, so that
    the next `simulate`/`sweep --force` there removes it with the rest (not elsewhere)."""
    from triosim.common.outputs import note_written, same_file

    if same_file(png.parent, folder):
        note_written(folder, [png.name], kind)


def cmd_plot(args) -> int:
    from triosim.results import saved as saved_folder
    from triosim.results import sweep_plots

    target = Path(args.target)
    if target.is_dir() and (target / "summary.json").is_file():
        if args.x or args.y or args.hue:
            raise InputError(
                "--x, --y and --hue are for a sweep table; a result folder takes --kind"
            )
        saved = saved_folder.read_result_folder(target)
        png = _png_out(args.out, target / f"plot-{args.kind}.png", args.force)
        saved_folder.plot_result(saved, args.kind, png, max_gpus=args.max_gpus)
        _noted(png, target, "simulate")
        print(f"{args.kind} of {target} written to {png}")
        return 0
    from triosim.studies import sweep as sw

    if not target.exists():
        raise InputError(f"{target} does not exist (give a result folder or a sweep table)")
    if target.is_dir() and not any(
        (target / f"{sw.TABLE}.{e}").exists() for e in ("csv", "parquet")
    ):
        raise InputError(
            f"{target} holds neither summary.json (a result folder) nor {sw.TABLE}.csv (a sweep)"
        )
    if args.kind != "overview":
        raise InputError("--kind is for a result folder; a sweep table takes --x, --y, --hue")
    df = sw.read_table(target)
    x, y, hue, notes = sw.axes(df, args.x, args.y, args.hue)
    folder = target if target.is_dir() else target.parent
    png = _png_out(args.out, folder / f"plot-{y}-vs-{x}.png", args.force)
    ok = ~sw.failed(df)
    sweep_plots.plot_sweep(df[ok], x, y, hue, png, title=f"sweep {target}: {y} against {x}")
    _noted(png, folder, "sweep")
    for n in notes:
        print(f"note: {n}")
    print(f"{y} against {x}" + (f" by {', '.join(hue)}" if hue else "") + f" written to {png}")
    return 0


SWEEP_EPILOG = """grid file:
  base: ../examples/ddp.yaml        # a config file (relative to the grid file), or a mapping
  grid:                              # the cartesian product of these lists
    num_gpus: [2, 4, 8]
    parallelism.mode: [dp, ddp]
  zip:                               # lists of one length, varied together
    topology.bandwidth: [25 GB/s, 100 GB/s]
    topology.latency: [2 us, 1 us]

runs on a local Dask cluster (pip install 'triosim[cluster]'; local processes without it),
on an existing one with --scheduler, in this process with --workers 1. Relative paths are
resolved here, before a config is sent to a worker.
"""


def sweep_arguments(sub) -> None:
    w = sub.add_parser(
        "sweep",
        help="run a grid of configs: one table (CSV, Parquet), resumable",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run every point of a grid file and write one table with a "
        "row per point: its parameters, its results and, for a failed point, "
        "the error. Rerunning into the same folder runs only the points not "
        "there yet; failed points are kept as they are unless --retry-failed.",
        epilog=SWEEP_EPILOG,
    )
    w.add_argument("grid", help="grid file (YAML): base, grid and/or zip")
    w.add_argument(
        "--out",
        type=out_path,
        help="output folder (default: out/<grid name>/, resumed when it "
        "holds this grid's table, else out/<grid name>-2/, ...)",
    )
    w.add_argument(
        "--workers",
        type=positive_int,
        help="local worker processes (default: "
        "one per CPU core, at most one per point); 1 runs in this process",
    )
    w.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="run on an existing Dask cluster, e.g. tcp://10.0.0.5:8786",
    )
    w.add_argument(
        "--retry-failed",
        action="store_true",
        help="run the points that failed in an earlier run again",
    )
    w.add_argument(
        "--force",
        action="store_true",
        help="start over: ignore a table already in the output folder",
    )
    w.add_argument(
        "--set", action="append", metavar="FIELD=VALUE", help="override a field of the base config"
    )
    w.set_defaults(func=cmd_sweep)


def compare_arguments(sub) -> None:
    c = sub.add_parser(
        "compare",
        help="runs side by side: configs (run now) or result folders",
        description="Compare runs: each a config file (simulated now) or a "
        "result folder written by simulate. Prints iteration time, compute, "
        "communication, exposed communication, idle, bytes moved and peak memory "
        "(when known) side by side, with differences and ratios against the first.",
    )
    c.add_argument(
        "runs", nargs="+", metavar="RUN", help="a config file or a result folder (two or more)"
    )
    c.add_argument("--out", type=out_path, help="write a grouped bar chart to this PNG")
    c.add_argument("--force", action="store_true", help="overwrite the --out PNG if it exists")
    c.set_defaults(func=cmd_compare)


def plot_arguments(sub) -> None:
    pl = sub.add_parser(
        "plot",
        help="figures of a result folder or of a sweep table",
        description="A result folder (written by simulate): the timeline, the "
        "per-GPU breakdown and the per-link utilisation (--kind). A sweep "
        "folder or table: --y against --x, one line or bar group per --hue.",
    )
    pl.add_argument(
        "target",
        metavar="RESULT_DIR|SWEEP_TABLE",
        help="a result folder, a sweep folder, or its sweep.csv / sweep.parquet",
    )
    pl.add_argument(
        "--out",
        type=out_path,
        help="PNG to write (default: plot-<what>.png in the folder, or "
        "plot-<what>-2.png, ... when it exists)",
    )
    pl.add_argument("--force", action="store_true", help="overwrite the --out PNG if it exists")
    pl.add_argument(
        "--kind",
        default="overview",
        choices=plots_kinds(),
        help="result folder: overview (all three, the default), timeline, breakdown or links",
    )
    pl.add_argument(
        "--max-gpus",
        type=positive_int,
        default=16,
        help="result folder: GPUs the timeline shows before it samples (default 16)",
    )
    pl.add_argument(
        "--x",
        help="sweep: the parameter on the x axis (default: num_gpus if it "
        "varies, else the first parameter)",
    )
    pl.add_argument("--y", help="sweep: the metric (default: iteration_time_ms)")
    pl.add_argument(
        "--hue",
        action="append",
        help="sweep: a parameter drawn as separate lines "
        "(default: every other parameter that varies); repeatable",
    )
    pl.set_defaults(func=cmd_plot)


def plots_kinds() -> tuple[str, ...]:
    return ("overview", "timeline", "breakdown", "links")
