"""The commands of one run or one trace: `simulate`, `info`, `import`, `search`, `trace`; each
with its arguments (`*_arguments(sub)` adds the command to the parser and sets its `cmd_*`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from triosim.cli.common import (
    apply_set,
    clear_earlier,
    config_with_sets,
    device_name,
    nonnegative_int,
    out_folder,
    out_path,
    positive_int,
    spare_inputs,
    with_fields_help,
)
from triosim.common.errors import ConfigError, InputError, TracerError
from triosim.trace.files import import_csv, load_any_trace


def cmd_simulate(args) -> int:
    from triosim.common.outputs import written_before
    from triosim.config.inputs import input_files
    from triosim.results.result import Result
    from triosim.simulation.wiring import Simulation

    path = Path(args.config)
    cfg = config_with_sets(path, args.set)
    if args.no_save and args.out is not None:
        raise InputError(f"--no-save and --out {args.out}: give one (--no-save writes nothing)")
    out = None if args.no_save else out_folder(args.out, path.stem, args.force)
    if out is not None:
        spare_inputs(
            out, [*Result.OUTPUTS, *written_before(out, "simulate")], input_files(cfg, path)
        )
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
            clear_earlier(out, Result.OUTPUTS, "simulate")
        result.save(out)
        print(
            f"\noutputs written to {out}/ (timeline.csv, per_gpu.csv, per_layer.csv, links.csv,"
            " summary.json, chrome_trace.json, timeline.png, memory.csv, memory.png, config.yaml)"
        )
        if result.symmetry.startswith("auto"):
            print(
                "symmetric run: the timeline, memory and Chrome trace hold its representatives'"
                " rows (every other GPU's are copies); summary.json's represented_by maps"
                " each GPU to its representative"
            )
    return 0


def _host_model_line(t) -> str | None:
    """What the simulator's host model (on by default for this trace, perfmodel/host.py)
    makes of one GPU: its host time per iteration and the one-GPU replay against the sum of
    operator times (the share the GPU then idles); None where the model is off."""
    from perfmodel.host import HostModel

    host = HostModel.for_trace(t, None)
    if host is None or not t.operators:
        return None
    issue = sum(host.issue(o) for o in t.operators)
    head = f"host {issue * 1e3:.4f} ms per iteration (defaults: host.op_cost x launches)"
    try:  # (the tracer's GPU machine may have no SimPy: the host time alone there)
        from triosim.simulation.wiring import Simulation
    except ImportError:
        return head
    replay = Simulation({"num_gpus": 1, "perfmodel": {"kind": "trace"}}, trace=t).run()
    it = replay.iteration_time
    busy = t.total_time / it if it else 1.0
    return f"{head}; one-GPU replay {it * 1e3:.4f} ms, kernels busy {100 * busy:.1f} % of it" + (
        " (host-bound)" if issue > t.total_time else ""
    )


def _host_line(h: dict) -> str:
    """What `info` says of the host (trace.model.host_stats): the idle-time breakdown where
    the trace has it, the host time alone where only that, else unknown."""
    ms = lambda x: f"{x * 1e3:.2f} ms"  # noqa: E731
    if h["host_wait_share"] is not None:
        return (
            f"{ms(h['host_time'])} over {h['operators_with_host_time']} operators "
            f"({h['sync_operators']} synchronising); GPU span {ms(h['gpu_span'])} = GPU "
            f"{ms(h['gpu_time'])} + idle {ms(h['gpu_idle'])} ({100 * h['idle_share']:.1f} %): "
            f"host wait {100 * h['host_wait_share']:.1f} %, kernel gap "
            f"{100 * h['kernel_gap_share']:.1f} % (the profiled iteration, profiler included)"
        )
    if h["host_time"] is not None:
        return f"{ms(h['host_time'])} over {h['operators_with_host_time']} operators"
    return "unknown (a trace without host columns)"


def cmd_info(args) -> int:
    from collections import Counter

    from triosim.trace.model import fidelity_warnings, host_stats, trace_stats

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
    print(f"host          {_host_line(host_stats(t))}")
    model_line = _host_model_line(t)
    if model_line:
        print(f"host model    {model_line}")
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
    from triosim.common.bars import Heartbeat

    with Heartbeat(f"importing {et.name}") as beat:  # a large model's pair: minutes
        beat.stage("reading the Execution Trace and the Kineto profile")
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
    how = t.metadata.get("batch_size_source") or ""
    if how != "given":  # a guess is said, with the way to set it
        print(f"batch size {t.metadata['batch_size']}: {how}; --batch-size sets it")
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


def ranked_table(frame) -> str:
    """The search's table as printed: a missing figure (no FLOPs, no sequence length) is
    "n/a" in every row, whether the row holds None or NaN."""
    import pandas as pd

    shown = frame.copy()
    for c in shown.columns[1:]:
        shown[c] = pd.to_numeric(shown[c], errors="coerce")
    return shown.to_string(index=False, float_format=lambda x: f"{x:.4g}", na_rep="n/a")


def cmd_search(args) -> int:
    import yaml

    from triosim.common.outputs import check_output_file, write_text
    from triosim.config.loading import read_yaml
    from triosim.studies.search import search

    path = Path(args.config)
    base = read_yaml(path)
    for s in args.set or []:
        apply_set(base, s)
    # --out before the search (which can take long): never the config, an existing file
    # only with --force
    from triosim.config.inputs import config_inputs

    out = check_output_file(args.out, args.force, inputs=config_inputs(path, base))
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
        print(ranked_table(ranked[cols]))
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

        if calibration is not None:  # a calibration table: the calibrated model
            return model_times(trace, gpu, "calibrated", calibration=calibration)
        return model_times(trace, gpu, "learned")

    return run_trace(args, timer)


# -- the commands' arguments ----------------------------------------------------------------------
# One function per command: it adds the command's parser to `sub` and sets `func`, the
# cmd_* function that reads its arguments. build_parser calls them in `triosim --help` order.


def simulate_arguments(sub) -> None:
    s = sub.add_parser(
        "simulate",
        help="run the simulation a YAML config describes",
        description="Simulate one training iteration as the YAML config says; print "
        "a summary (ms) and write timeline, breakdowns, Chrome trace and plot.",
    )
    s.add_argument("config", help="YAML config (see examples/)")
    s.add_argument(
        "--out",
        type=out_path,
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
    with_fields_help(s)


def info_arguments(sub) -> None:
    i = sub.add_parser(
        "info", help="describe a trace", description="Load, validate and describe a trace."
    )
    i.add_argument("trace", help="a .trace.json(.gz) file or a TrioSim CSV folder")
    i.set_defaults(func=cmd_info)


def import_arguments(sub) -> None:
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
        "source",
        help="a folder holding trace.csv and tensor.csv (or the path of trace.csv, its "
        "tensor.csv beside it: both are needed), or the ET JSON",
    )
    im.add_argument(
        "out", type=out_path, help="output .trace.json or .trace.json.gz, or the Kineto JSON"
    )
    im.add_argument(
        "profile_out", nargs="?", type=out_path, help="with an ET + Kineto pair: the output file"
    )
    im.add_argument(
        "--step",
        type=positive_int,
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
        "--batch-size", type=positive_int, help="batch size (default: first input's first dim)"
    )
    im.add_argument("--gpu", help="the GPU the trace was taken on (a name from the catalogue)")
    im.add_argument("--force", action="store_true", help="overwrite an existing output file")
    im.set_defaults(func=cmd_import)


def trace_arguments(sub) -> None:
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
    t.add_argument("--batch-size", type=positive_int, required=True)
    t.add_argument(
        "--device", default="cpu", type=device_name, help="cpu, cuda or cuda:N (default: cpu)"
    )
    t.add_argument(
        "--out",
        required=True,
        type=out_path,
        help="output folder (the trace file's name is the "
        "model's and the batch's; an existing one is refused without --force)",
    )
    t.add_argument("--force", action="store_true", help="overwrite the trace file if it exists")
    t.add_argument(
        "--warmup", type=nonnegative_int, default=3, help="warm-up iterations (paper: 30)"
    )
    t.add_argument("--measure", type=positive_int, default=5, help="timed iterations (paper: 10)")
    t.add_argument(
        "--seq-len", type=positive_int, default=128, help="sequence length for gpt2/bert"
    )
    t.add_argument("--small", action="store_true", help="a reduced model size (fast CPU traces)")
    t.add_argument("--image-size", type=positive_int, default=224, help="image side for CNNs")
    t.add_argument(
        "--shapes-only",
        action="store_true",
        help="run the model on meta tensors (no memory, no compute) and take each "
        "operator's time from the learned performance model (perfmodel 'learned', fitted "
        "on the shipped real H100 traces) for --gpu; the trace "
        "says its times are modelled",
    )
    t.add_argument(
        "--gpu",
        help="with --shapes-only: the catalogue GPU to model (H100-SXM, A100-80GB, A40, ...)",
    )
    t.add_argument(
        "--layers",
        type=positive_int,
        metavar="K",
        help="transformers: trace K of the identical layers at full width and "
        "replicate them to the model's depth (K must divide it)",
    )
    t.add_argument(
        "--calibration",
        help="with --shapes-only: time with perfmodel 'calibrated' and this calibration "
        "table (JSON) instead of the learned model",
    )
    t.add_argument(
        "--master-weights",
        action="store_true",
        help="Llama: bfloat16 parameters with float32 master weights in the optimizer "
        "(Megatron-LM) instead of float32 parameters cast where used (torchtitan)",
    )
    t.add_argument(
        "--capacity-factor",
        type=float,
        metavar="F",
        help="MoE models: token-dropping routing, each expert taking F x its balanced "
        "share of tokens (default: dropless, traced at the balanced load)",
    )
    t.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="D",
        help="DeepSeek-V3: D multi-token prediction modules after the main model (the "
        "report trains with 1; Megatron-Core's mtp_num_layers); default 0",
    )
    t.set_defaults(func=cmd_trace)


def search_arguments(sub) -> None:
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
        type=out_path,
        help="where the best config goes (checked before the search; never the config)",
    )
    se.add_argument("--force", action="store_true", help="overwrite --out")
    se.add_argument("--workers", type=positive_int, default=1, help="parallel processes")
    se.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a field")
    se.set_defaults(func=cmd_search)
