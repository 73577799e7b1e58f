"""The `triosim` command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from triosim.common.errors import ConfigError, InputError, TracerError, TrioSimError
from triosim.trace.files import import_csv, load_any_trace

EPILOG = """examples:
  triosim simulate examples/ddp.yaml               simulate, print a summary, write outputs
  triosim simulate examples/ddp.yaml --set num_gpus=8 --set topology.bandwidth="100 GB/s"
  triosim sweep examples/sweeps/dp_vs_ddp.yaml     a grid of runs: one table, resumable
  triosim compare examples/dp.yaml examples/ddp.yaml --out compare.png
  triosim plot out/ddp                             timeline, breakdown, link utilisation
  triosim plot out/sweep --x num_gpus --y iteration_time_ms --hue parallelism.mode
  triosim info traces/cpu/resnet18-b8.trace.json.gz
  triosim trace resnet18 --batch-size 8 --device cpu --out traces/mine
  triosim import ../triosim-go-traces/vgg13 vgg13.trace.json.gz
  triosim export-chakra examples/ddp.yaml --out chakra/ddp   a run's per-GPU workload for ASTRA-sim
"""


def _assignment(assignment: str) -> tuple[str, object]:
    from triosim.cli.collectives import assignment as parse

    return parse(assignment)


def _set(data: dict, assignment: str) -> None:
    from triosim.config.loading import set_field

    set_field(data, *_assignment(assignment))


def _taken(folder: Path) -> bool:
    return folder.exists() and (not folder.is_dir() or any(folder.iterdir()))


def _out_folder(out, stem: str, force: bool) -> Path:
    """Where `simulate` writes: --out (refused if it holds files, unless --force), or
    out/<stem>/, else the first free out/<stem>-2/, -3/, ... Created and test-written now,
    before simulating, so that a finished run is never lost to an unwritable folder."""
    if out is not None:
        folder = Path(out)
        if folder.exists() and not folder.is_dir():
            raise InputError(f"--out {folder} is a file, expected a folder")
        if _taken(folder) and not force:
            raise InputError(
                f"--out {folder} already holds files; pass --force to "
                "overwrite them, or name another folder"
            )
    else:
        folder, n = Path("out") / stem, 1
        while _taken(folder) and not force:
            n += 1
            folder = Path("out") / f"{stem}-{n}"
    return _writable(folder)


def _writable(folder: Path) -> Path:
    from triosim.common.outputs import writable_folder

    return writable_folder(folder)


def _inputs(cfg, *files) -> list[Path]:
    """What a run reads: `files` (the config), the trace and every option marked as a path
    (a calibration file, extra traces)."""
    import dataclasses

    from triosim.config.loading import IN_MEMORY

    out = [Path(f) for f in files]
    if cfg.trace and cfg.trace != IN_MEMORY:
        out.append(cfg.trace_path())
    for section in ("parallelism", "topology", "network", "communication", "perfmodel"):
        opts = getattr(cfg, section).options
        if opts is None or not dataclasses.is_dataclass(opts):
            continue
        for f in dataclasses.fields(opts):
            if f.metadata.get("path"):
                v = getattr(opts, f.name)
                out += [cfg.resolve(x) for x in (v if isinstance(v, list) else [v]) if x]
    return out


def _spare_inputs(folder: Path, names, inputs) -> None:
    """Refuse an output folder where one of the files a run writes (or removes, with
    --force) is one of its inputs: the run would destroy what it read."""
    from triosim.common.outputs import same_file

    for name in names:
        for i in inputs:
            if same_file(folder / name, i):
                raise InputError(
                    f"--out {folder}: its {name} is an input of this run ({i}); "
                    "name another folder (an input is never overwritten, not "
                    "even with --force)"
                )


def _clear_earlier(folder: Path, own, kind: str) -> None:
    """--force: remove what an earlier run wrote into `folder` (its own files and the
    manifest's, nothing else), so that no stale output sits beside the new ones."""
    from triosim.common.outputs import remove_written

    removed = remove_written(folder, own, kind)
    extra = [n for n in removed if n not in own]  # not rewritten now: worth naming
    if removed:
        print(
            f"--force: removed the {len(removed)} file(s) an earlier run wrote in {folder}/"
            + (f" ({', '.join(extra)} among them)" if extra else "")
        )


def cmd_simulate(args) -> int:
    from triosim.common.outputs import written_before
    from triosim.config.loading import from_dict, read_yaml
    from triosim.results.result import Result
    from triosim.simulation.wiring import Simulation

    path = Path(args.config)
    data = read_yaml(path)
    for s in args.set or []:
        _set(data, s)
    cfg = from_dict(data, base_dir=path.parent)
    if args.no_save and args.out is not None:
        raise InputError(f"--no-save and --out {args.out}: give one (--no-save writes nothing)")
    out = None if args.no_save else _out_folder(args.out, path.stem, args.force)
    if out is not None:
        _spare_inputs(out, [*Result.OUTPUTS, *written_before(out, "simulate")], _inputs(cfg, path))
    if out is not None and args.out is None and out.name != path.stem:
        print(f"out/{path.stem}/ already holds files: writing to {out}/ instead")
    from triosim.trace.model import fidelity_warnings, no_trace

    trace = load_any_trace(cfg.trace_path(), progress=True) if cfg.trace else no_trace()

    for w in fidelity_warnings(trace):
        print(f"warning: {w}", file=sys.stderr)
    from triosim.simulation.progress import run_with_progress

    result = run_with_progress(Simulation(cfg, trace=trace, progress=True))
    print(result.summary())
    if out is not None:
        if args.force:  # only now: a failed run leaves the earlier outputs as they were
            _clear_earlier(out, Result.OUTPUTS, "simulate")
        result.save(out)
        print(
            f"\noutputs written to {out}/ (timeline.csv, per_gpu.csv, per_layer.csv, links.csv,"
            " summary.json, chrome_trace.json, timeline.png, memory.csv, memory.png, config.yaml)"
        )
    return 0


def cmd_info(args) -> int:
    from collections import Counter

    from triosim.trace.model import fidelity_warnings, trace_stats

    t = load_any_trace(args.trace, progress=True)
    phases = Counter(o.phase for o in t.operators)
    print(f"trace         {args.trace}")
    for k, v in t.metadata.items():
        if not isinstance(v, (dict, list)):
            print(f"{k:<13} {v}")
    print(f"operators     {len(t.operators)} ({', '.join(f'{k} {v}' for k, v in phases.items())})")
    print(f"tensors       {len(t.tensors)}")
    print(f"weights       {t.weight_bytes() / 1e6:.3f} MB")
    print(f"sum of op times {t.total_time * 1e3:.4f} ms")
    st = trace_stats(t)
    pct = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    print(
        f"pairing       {st['backward_paired']} of {st['backward_operators']} backward operators "
        f"({pct(st['pairing'])}; AccumulateGrad nodes have no forward op)"
    )
    print(
        f"FLOPs         {st['operators_with_flops']} of {st['operators']} operators "
        f"({pct(st['flops_coverage'])}), {st['total_flops'] / 1e9:.3f} GFLOP"
    )
    tm = t.metadata.get("time_model")
    if t.metadata.get("modelled") and isinstance(tm, dict):
        print(
            f"times         MODELLED, not measured: perfmodel '{tm.get('kind')}' for "
            f"{tm.get('gpu')}"
        )
        if tm.get("calibration"):
            print(
                f"calibration   fitted on {tm.get('fitted_on')} ({tm.get('form')} form): "
                f"{tm['calibration']}"
            )
        if tm.get("assumption"):
            print(f"assumption    {tm['assumption']}")
    lay = t.metadata.get("layers")
    if isinstance(lay, dict):
        print(f"layers        {lay.get('total')} ({lay.get('how')})")
    for w in fidelity_warnings(t):
        print(f"warning: {w}")
    return 0


def _import_profile(args) -> int:
    """`triosim import ET KINETO OUT`: a PyTorch Execution Trace + Kineto JSON pair."""
    from triosim.hardware import catalogue as hardware
    from triosim.trace.model import save

    et, kineto, out = Path(args.source), Path(args.out), Path(args.profile_out)
    for p in (et, kineto):
        if not p.is_file():
            raise InputError(f"{p}: no such file (give ET.json[.gz] KINETO.json[.gz] OUT)")
    if out.resolve() in {et.resolve(), kineto.resolve()}:
        raise InputError(f"output {out} is one of the inputs; name a new file")
    if out.is_dir():
        raise InputError(
            f"output {out} is a folder; name a file such as {out / 'NAME.trace.json.gz'}"
        )
    if out.exists() and not args.force:
        raise InputError(f"output {out} exists; pass --force to overwrite it")
    try:
        gpu = hardware.gpu(args.gpu).name if args.gpu is not None else None
    except ConfigError as e:
        raise InputError(f"--gpu {args.gpu!r} is not in the catalogue: {e.allowed}") from None
    from tracer.profile_import import import_profile

    t = import_profile(
        et,
        kineto,
        batch_size=args.batch_size,
        gpu=gpu,
        step=args.step,
        cudnn_tf32=args.cudnn_tf32,
        matmul_tf32=args.matmul_tf32,
    )
    try:
        save(t, out)
    except OSError as e:
        raise InputError(f"output {out}: cannot write it ({e.strerror or e})") from None
    gpu_ms = sum(o.time for o in t.operators) * 1e3
    print(
        f"imported {len(t.operators)} operators, {len(t.tensors)} tensors "
        f"({t.metadata['profiled_step'] or 'the whole profile'}, sum of GPU time "
        f"{gpu_ms:.3f} ms, batch size {t.metadata['batch_size']}) -> {out}"
    )
    return 0


def cmd_import(args) -> int:
    from triosim.hardware import catalogue as hardware
    from triosim.trace.model import save

    if args.profile_out is not None:
        return _import_profile(args)
    for flag in ("step", "cudnn_tf32", "matmul_tf32"):
        if getattr(args, flag) is not None:
            raise InputError(f"--{flag.replace('_', '-')} is for an ET + Kineto pair only")
    src, out = Path(args.source), Path(args.out)
    trace_csv = src / "trace.csv" if src.is_dir() else src
    inputs = {p.resolve() for p in (src, trace_csv, trace_csv.with_name("tensor.csv"))}
    if out.resolve() in inputs:
        raise InputError(f"output {out} is the input {src} or one of its files; name a new file")
    if out.is_dir():
        raise InputError(
            f"output {out} is a folder; name a file such as {out / 'NAME.trace.json.gz'}"
        )
    if out.exists() and not args.force:
        raise InputError(f"output {out} exists; pass --force to overwrite it")
    try:  # an unknown GPU (or an empty name) fails before any work
        gpu = hardware.gpu(args.gpu).name if args.gpu is not None else None
    except ConfigError as e:
        raise InputError(f"--gpu {args.gpu!r} is not in the catalogue: {e.allowed}") from None
    t = import_csv(src, batch_size=args.batch_size, gpu=gpu)
    try:
        save(t, out)
    except OSError as e:
        raise InputError(f"output {out}: cannot write it ({e.strerror or e})") from None
    print(f"imported {len(t.operators)} operators, {len(t.tensors)} tensors -> {out}")
    return 0


def cmd_search(args) -> int:
    import yaml

    from triosim.common.outputs import check_output_file, write_text
    from triosim.config.loading import read_yaml
    from triosim.studies.search import search

    path = Path(args.config)
    base = read_yaml(path)
    for s in args.set or []:
        _set(base, s)
    # --out before the search (which can take long): never the config, an existing file
    # only with --force
    out = check_output_file(args.out, args.force, inputs=(path,))
    ranked, table, best = search(base, base_dir=str(path.parent), workers=args.workers)
    cols = [
        c
        for c in (
            "plan",
            "iteration_time_ms",
            "peak_memory_gb_max",
            "samples_per_s",
            "tokens_per_s",
            "mfu",
        )
        if c in ranked
    ]
    if len(ranked):
        print(ranked[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    dropped = table[table["status"] != "ok"]
    for r in dropped.itertuples(index=False):
        print(
            f"not ranked: {r.plan}: {r.status}"
            + (f" ({r.reason})" if isinstance(getattr(r, "reason", None), str) else "")
        )
    if not (table["status"] != "invalid").any():
        raise InputError(
            f"no plan is valid for {path} ({len(table)} tried; each one's reason "
            "is listed above): check num_gpus, batch_size and the trace"
        )
    if best is None:
        print("error: no candidate fits", file=sys.stderr)
        return 1
    best = {**best, "trace": str((path.parent / best["trace"]).resolve())}
    write_text(out, yaml.safe_dump(best, sort_keys=False))
    print(
        f"\nbest: {ranked.loc[0, 'plan']} ({ranked.loc[0, 'iteration_time_ms']:.4f} ms); "
        f"config written to {out}"
    )
    return 0


def cmd_trace(args) -> int:
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise TracerError(
            f"triosim trace needs PyTorch ({e}): pip install 'triosim[trace]'"
        ) from None
    from tracer.cli import run_trace

    if args.gpu is not None and args.shapes_only:  # before tracing, not after
        from triosim.hardware import catalogue as hardware

        hardware.gpu(args.gpu)
    if args.calibration is not None and args.shapes_only:
        from perfmodel.calibrated import Calibration

        Calibration.load(args.calibration)

    def timer(trace, gpu, calibration):
        from perfmodel.modelled import model_times

        return model_times(trace, gpu, "calibrated", calibration=calibration)

    return run_trace(args, timer)


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
        if _taken(folder) and not has_table(folder) and not force:
            raise InputError(
                f"--out {folder} already holds files and no sweep table; pass "
                "--force to write there anyway, or name another folder"
            )
        return _writable(folder), sw.plan(pts, folder, retry_failed, fresh=force)
    n = 1
    while True:
        folder = Path("out") / (stem if n == 1 else f"{stem}-{n}")
        if force or not _taken(folder):
            return _writable(folder), sw.plan(pts, folder, retry_failed, fresh=True)
        if has_table(folder):
            try:
                return _writable(folder), sw.plan(pts, folder, retry_failed)
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
    spec = sw.read_grid(path, [_assignment(a) for a in args.set or []])
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
        inputs = [path, spec.base_file, *{p.config.trace_path() for p in pts if p.config.trace}]
        _spare_inputs(folder, [*own, *written_before(folder, "sweep")], [i for i in inputs if i])
        _clear_earlier(folder, own, "sweep")
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


def _png_out(out, default: Path, force: bool) -> Path:
    """Where a figure goes: --out (refused if it exists, unless --force), else `default`
    or the first free NAME-2.png, -3.png, ... beside it."""
    if out is not None:
        path = Path(out)
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
    _writable(path.parent)
    return path


def cmd_compare(args) -> int:
    from triosim.config.loading import from_dict, read_yaml
    from triosim.studies import compare

    if len(args.runs) < 2:
        raise InputError("compare needs two runs or more (configs or result folders)")
    for a in args.runs:  # every mistake before the first simulation
        p = Path(a)
        if p.is_dir():
            if not (p / "summary.json").is_file():
                raise InputError(f"{p} is a folder without summary.json: not a saved result")
        elif p.exists():
            from_dict(read_yaml(p), base_dir=p.parent)
        else:
            raise InputError(f"{p} does not exist (give a config file or a result folder)")
    png = _png_out(args.out, Path(), args.force) if args.out else None
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
    from triosim.results import plots

    target = Path(args.target)
    if target.is_dir() and (target / "summary.json").is_file():
        if args.x or args.y or args.hue:
            raise InputError(
                "--x, --y and --hue are for a sweep table; a result folder takes --kind"
            )
        saved = plots.read_result_folder(target)
        png = _png_out(args.out, target / f"plot-{args.kind}.png", args.force)
        plots.plot_result(saved, args.kind, png, max_gpus=args.max_gpus)
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
    plots.plot_sweep(df[ok], x, y, hue, png, title=f"sweep {target}: {y} against {x}")
    _noted(png, folder, "sweep")
    for n in notes:
        print(f"note: {n}")
    print(f"{y} against {x}" + (f" by {', '.join(hue)}" if hue else "") + f" written to {png}")
    return 0


def _positive_int(text: str) -> int:
    from triosim.cli.collectives import positive_int

    return positive_int(text)


def _nonnegative_int(text: str) -> int:
    from triosim.cli.collectives import nonnegative_int

    return nonnegative_int(text)


def _device(text: str) -> str:
    """trace --device: cpu, cuda or cuda:N (what the tracer can time)."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triosim")
    except PackageNotFoundError:
        return "unknown"


def _with_fields_help(parser) -> None:
    """`simulate --help` ends with every config field, from the schema itself (built only
    when help is asked for: listing the parts imports them all)."""
    plain = parser.format_help

    def format_help():
        from triosim.config.loading import fields_help

        return plain() + "\n" + fields_help() + "\n"

    parser.format_help = format_help


# -- the commands' arguments ----------------------------------------------------------------------
# One function per command: it adds the command's parser to `sub` and sets `func`, the
# cmd_* function that reads its arguments. build_parser calls them in `triosim --help` order.


def _simulate_arguments(sub) -> None:
    s = sub.add_parser(
        "simulate",
        help="run the simulation a YAML config describes",
        description="Simulate one training iteration as the YAML config says; print "
        "a summary (ms) and write timeline, breakdowns, Chrome trace and plot.",
    )
    s.add_argument("config", help="YAML config (see examples/)")
    s.add_argument(
        "--out",
        help="output folder (default: out/<config name>/, or out/<config name>-2/, "
        "-3/, ... when that one already holds files)",
    )
    s.add_argument(
        "--force",
        action="store_true",
        help="write into the output folder even if it already holds files",
    )
    s.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="override a config field, e.g. --set num_gpus=8 --set parallelism.mode=dp",
    )
    s.add_argument("--no-save", action="store_true", help="print the summary only")
    s.set_defaults(func=cmd_simulate)
    _with_fields_help(s)


def _info_arguments(sub) -> None:
    i = sub.add_parser(
        "info", help="describe a trace", description="Load, validate and describe a trace."
    )
    i.add_argument("trace", help="a .trace.json(.gz) file or a TrioSim CSV folder")
    i.set_defaults(func=cmd_info)


def _import_arguments(sub) -> None:
    im = sub.add_parser(
        "import",
        help="convert an original TrioSim CSV pair or a PyTorch ET + Kineto pair",
        description=(
            "Convert the original TrioSim CSV pair (import DIR OUT), or a PyTorch Execution "
            "Trace + Kineto JSON pair recorded with torch.profiler (import ET KINETO OUT; "
            "plain or gzipped), into a triosim trace file."
        ),
    )
    im.add_argument(
        "source", help="folder with trace.csv and tensor.csv (or trace.csv), or the ET JSON"
    )
    im.add_argument("out", help="output .trace.json or .trace.json.gz, or the Kineto JSON")
    im.add_argument("profile_out", nargs="?", help="with an ET + Kineto pair: the output file")
    im.add_argument(
        "--step",
        type=_positive_int,
        help="ET + Kineto: the ProfilerStep#N to import (default: the last)",
    )
    tf32 = "ET + Kineto: whether {} ran float32 in TF32 (default: PyTorch's default, {})"
    im.add_argument(
        "--cudnn-tf32",
        action=argparse.BooleanOptionalAction,
        help=tf32.format("cuDNN (convolutions)", "on"),
    )
    im.add_argument(
        "--matmul-tf32",
        action=argparse.BooleanOptionalAction,
        help=tf32.format("cuBLAS (matrix products)", "off"),
    )
    im.add_argument(
        "--batch-size", type=_positive_int, help="batch size (default: first input's first dim)"
    )
    im.add_argument("--gpu", help="the GPU the trace was taken on (a name from the catalogue)")
    im.add_argument("--force", action="store_true", help="overwrite an existing output file")
    im.set_defaults(func=cmd_import)


def _trace_arguments(sub) -> None:
    t = sub.add_parser(
        "trace",
        help="trace one training iteration of a model with PyTorch",
        description="Run warm-up and timed iterations, then profile one iteration with "
        "PyTorch Profiler + Execution Trace Observer; write a triosim trace.",
    )
    t.add_argument(
        "model",
        help="a reference model: resnet18, resnet50, resnet152, vgg11, vgg13, "
        "vgg16, vgg19, densenet121, gpt2, bert, llama3-8b, llama3-70b, llama3.2-1b, or "
        "module:function returning (model, make_batch(batch_size, device), loss_fn)",
    )
    t.add_argument("--batch-size", type=_positive_int, required=True)
    t.add_argument(
        "--device", default="cpu", type=_device, help="cpu, cuda or cuda:N (default: cpu)"
    )
    t.add_argument(
        "--out",
        required=True,
        help="output folder (the trace file's name is the "
        "model's and the batch's; an existing one is refused without --force)",
    )
    t.add_argument("--force", action="store_true", help="overwrite the trace file if it exists")
    t.add_argument(
        "--warmup", type=_nonnegative_int, default=3, help="warm-up iterations (paper: 30)"
    )
    t.add_argument("--measure", type=_positive_int, default=5, help="timed iterations (paper: 10)")
    t.add_argument(
        "--seq-len", type=_positive_int, default=128, help="sequence length for gpt2/bert"
    )
    t.add_argument("--small", action="store_true", help="a reduced model size (fast CPU traces)")
    t.add_argument("--image-size", type=_positive_int, default=224, help="image side for CNNs")
    t.add_argument(
        "--shapes-only",
        action="store_true",
        help="run the model on meta tensors (no memory, no compute) and take each "
        "operator's time from the calibrated performance model for --gpu; the trace "
        "says its times are modelled",
    )
    t.add_argument(
        "--gpu",
        help="with --shapes-only: the catalogue GPU to model (H100-SXM, A100-80GB, A40, ...)",
    )
    t.add_argument(
        "--layers",
        type=_positive_int,
        metavar="K",
        help="transformers: trace K of the identical layers at full width and "
        "replicate them to the model's depth (K must divide it)",
    )
    t.add_argument(
        "--calibration",
        help="with --shapes-only: a calibration table (JSON) instead of the shipped H100 one",
    )
    t.add_argument(
        "--master-weights",
        action="store_true",
        help="Llama: bfloat16 parameters with float32 master weights in the optimizer "
        "(Megatron-LM) instead of float32 parameters cast where used (torchtitan)",
    )
    t.set_defaults(func=cmd_trace)


def _search_arguments(sub) -> None:
    se = sub.add_parser(
        "search",
        help="rank every way to spread a trace over the GPUs",
        description="Enumerate data, sharded, tensor, pipeline and hybrid plans "
        "for the config's trace, GPU count, topology and global batch; drop those "
        "that do not fit in memory; simulate and rank the rest; write the best "
        "as a config ready to run.",
    )
    se.add_argument("config", help="YAML config giving trace, num_gpus, batch_size, topology")
    se.add_argument(
        "--out",
        default="best.yaml",
        help="where the best config goes (checked before the search; never the config)",
    )
    se.add_argument("--force", action="store_true", help="overwrite --out")
    se.add_argument("--workers", type=_positive_int, default=1, help="parallel processes")
    se.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a field")
    se.set_defaults(func=cmd_search)


def _sweep_arguments(sub) -> None:
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
        help="output folder (default: out/<grid name>/, resumed when it "
        "holds this grid's table, else out/<grid name>-2/, ...)",
    )
    w.add_argument(
        "--workers",
        type=_positive_int,
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


def _compare_arguments(sub) -> None:
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
    c.add_argument("--out", help="write a grouped bar chart to this PNG")
    c.add_argument("--force", action="store_true", help="overwrite the --out PNG if it exists")
    c.set_defaults(func=cmd_compare)


def _plot_arguments(sub) -> None:
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
        type=_positive_int,
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="triosim",
        description="Predict multi-GPU DNN training iteration time from a single-GPU trace.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    _simulate_arguments(sub)
    _info_arguments(sub)
    _import_arguments(sub)
    _trace_arguments(sub)
    _search_arguments(sub)

    from triosim.cli.chakra import add_parser as add_chakra
    from triosim.cli.collectives import add_commands

    add_commands(sub)  # collectives, calibrate
    add_chakra(sub)  # export-chakra

    _sweep_arguments(sub)
    _compare_arguments(sub)
    _plot_arguments(sub)
    return p


def plots_kinds() -> tuple[str, ...]:
    return ("overview", "timeline", "breakdown", "links")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as the CLI's own lines (`warning: ...`), not Python's file:line form."""
    print(f"warning: {message}", file=sys.stderr)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import warnings

    warnings.showwarning = _show_warning
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `triosim ... | head`: the reader left; nothing more to say
        sys.stdout = open(os.devnull, "w")  # so that the exit flush is quiet
        return 0
    except TrioSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
