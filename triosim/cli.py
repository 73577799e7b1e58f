"""The `triosim` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from triosim.errors import ConfigError, InputError, TracerError, TrioSimError
from triosim.trace_io import import_csv, load_any_trace

EPILOG = """examples:
  triosim simulate examples/ddp.yaml               simulate, print a summary, write outputs
  triosim simulate examples/ddp.yaml --set num_gpus=8 --set topology.bandwidth="100 GB/s"
  triosim info traces/cpu/resnet18-b8.trace.json.gz
  triosim trace resnet18 --batch-size 8 --device cpu --out traces/mine
  triosim import ../triosim-go-traces/vgg13 vgg13.trace.json.gz
"""


def _set(data: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise InputError(f"--set expects FIELD=VALUE, got {assignment!r}")
    from triosim.config import parse_yaml, set_field

    key, value = assignment.split("=", 1)
    set_field(data, key, parse_yaml(value, f"--set {assignment!r}"))


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
            raise InputError(f"--out {folder} already holds files; pass --force to "
                             "overwrite them, or name another folder")  # fmt: skip
    else:
        folder, n = Path("out") / stem, 1
        while _taken(folder) and not force:
            n += 1
            folder = Path("out") / f"{stem}-{n}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".triosim-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise InputError(
            f"output folder {folder}: cannot write there ({e.strerror or e})"
        ) from None
    return folder


def cmd_simulate(args) -> int:
    from triosim.config import from_dict, read_yaml
    from triosim.simulation import Simulation

    path = Path(args.config)
    data = read_yaml(path)
    for s in args.set or []:
        _set(data, s)
    cfg = from_dict(data, base_dir=path.parent)
    out = None if args.no_save else _out_folder(args.out, path.stem, args.force)
    if out is not None and args.out is None and out.name != path.stem:
        print(f"out/{path.stem}/ already holds files: writing to {out}/ instead")
    trace = load_any_trace(cfg.trace_path(), progress=True)
    from triosim.trace import fidelity_warnings

    for w in fidelity_warnings(trace):
        print(f"warning: {w}", file=sys.stderr)
    result = Simulation(cfg, trace=trace, progress=True).run()
    print(result.summary())
    if out is not None:
        result.save(out)
        print(f"\noutputs written to {out}/ (timeline.csv, per_gpu.csv, per_layer.csv, links.csv,"
              " summary.json, chrome_trace.json, timeline.png, config.yaml)")  # fmt: skip
    return 0


def cmd_info(args) -> int:
    from collections import Counter

    from triosim.trace import fidelity_warnings, trace_stats

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
    print(f"pairing       {st['backward_paired']} of {st['backward_operators']} backward operators "
          f"({pct(st['pairing'])})")  # fmt: skip
    print(f"FLOPs         {st['operators_with_flops']} of {st['operators']} operators "
          f"({pct(st['flops_coverage'])}), {st['total_flops'] / 1e9:.3f} GFLOP")  # fmt: skip
    tm = t.metadata.get("time_model")
    if t.metadata.get("modelled") and isinstance(tm, dict):
        print(f"times         MODELLED, not measured: perfmodel '{tm.get('kind')}' for "
              f"{tm.get('gpu')}")  # fmt: skip
        if tm.get("calibration"):
            print(f"calibration   fitted on {tm.get('fitted_on')} ({tm.get('form')} form): "
                  f"{tm['calibration']}")  # fmt: skip
        if tm.get("assumption"):
            print(f"assumption    {tm['assumption']}")
    lay = t.metadata.get("layers")
    if isinstance(lay, dict):
        print(f"layers        {lay.get('total')} ({lay.get('how')})")
    for w in fidelity_warnings(t):
        print(f"warning: {w}")
    return 0


def cmd_import(args) -> int:
    from triosim import hardware
    from triosim.trace import save

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
    try:  # an unknown GPU fails before any work
        gpu = hardware.gpu(args.gpu).name if args.gpu else None
    except ConfigError as e:
        raise InputError(f"--gpu {args.gpu!r} is not in the catalogue: {e.allowed}") from None
    t = import_csv(src, batch_size=args.batch_size, gpu=gpu)
    try:
        save(t, out)
    except OSError as e:
        raise InputError(f"output {out}: cannot write it ({e.strerror or e})") from None
    print(f"imported {len(t.operators)} operators, {len(t.tensors)} tensors -> {out}")
    return 0


def cmd_trace(args) -> int:
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise TracerError(
            f"triosim trace needs PyTorch ({e}): pip install 'triosim[trace]'"
        ) from None
    from tracer.cli import run_trace

    def timer(trace, gpu, calibration):
        from perfmodel.modelled import model_times

        return model_times(trace, gpu, "calibrated", calibration=calibration)

    return run_trace(args, timer)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


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
        from triosim.config import fields_help

        return plain() + "\n" + fields_help() + "\n"

    parser.format_help = format_help


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="triosim",
        description="Predict multi-GPU DNN training iteration time from a single-GPU trace.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("simulate", help="run the simulation a YAML config describes",
                       description="Simulate one training iteration as the YAML config says; print "
                       "a summary (ms) and write timeline, breakdowns, Chrome trace and plot.")  # fmt: skip
    s.add_argument("config", help="YAML config (see examples/)")
    s.add_argument("--out", help="output folder (default: out/<config name>/, or out/<config name>-2/, "
                   "-3/, ... when that one already holds files)")  # fmt: skip
    s.add_argument("--force", action="store_true",
                   help="write into the output folder even if it already holds files")  # fmt: skip
    s.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override a config field, e.g. --set num_gpus=8 --set parallelism.mode=dp")  # fmt: skip
    s.add_argument("--no-save", action="store_true", help="print the summary only")
    s.set_defaults(func=cmd_simulate)
    _with_fields_help(s)

    i = sub.add_parser(
        "info", help="describe a trace", description="Load, validate and describe a trace."
    )
    i.add_argument("trace", help="a .trace.json(.gz) file or a TrioSim CSV folder")
    i.set_defaults(func=cmd_info)

    im = sub.add_parser("import", help="convert an original TrioSim trace.csv + tensor.csv",
                        description="Convert the original TrioSim CSV pair into a triosim trace file.")  # fmt: skip
    im.add_argument("source", help="folder with trace.csv and tensor.csv (or trace.csv)")
    im.add_argument("out", help="output .trace.json or .trace.json.gz")
    im.add_argument("--batch-size", type=_positive_int,
                    help="batch size (default: first input's first dim)")  # fmt: skip
    im.add_argument("--gpu", help="the GPU the trace was taken on (a name from the catalogue)")
    im.add_argument("--force", action="store_true", help="overwrite an existing output file")
    im.set_defaults(func=cmd_import)

    t = sub.add_parser("trace", help="trace one training iteration of a model with PyTorch",
                       description="Run warm-up and timed iterations, then profile one iteration with "
                       "PyTorch Profiler + Execution Trace Observer; write a triosim trace.")  # fmt: skip
    t.add_argument("model", help="a reference model: resnet18, resnet50, resnet152, vgg11, vgg13, "
                   "vgg16, vgg19, densenet121, gpt2, bert, llama3-8b, llama3-70b, llama3.2-1b, or "
                   "module:function returning (model, make_batch(batch_size, device), loss_fn)")  # fmt: skip
    t.add_argument("--batch-size", type=_positive_int, required=True)
    t.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--warmup", type=int, default=3, help="warm-up iterations (paper: 30)")
    t.add_argument("--measure", type=int, default=5, help="timed iterations (paper: 10)")
    t.add_argument("--seq-len", type=int, default=128, help="sequence length for gpt2/bert")
    t.add_argument("--small", action="store_true", help="a reduced model size (fast CPU traces)")
    t.add_argument("--image-size", type=int, default=224, help="image side for CNNs")
    t.add_argument("--shapes-only", action="store_true",
                   help="run the model on meta tensors (no memory, no compute) and take each "
                   "operator's time from the calibrated performance model for --gpu; the trace "
                   "says its times are modelled")  # fmt: skip
    t.add_argument("--gpu", help="with --shapes-only: the catalogue GPU to model (H100-SXM, "
                   "A100-80GB, A40, ...)")  # fmt: skip
    t.add_argument("--layers", type=_positive_int, metavar="K",
                   help="transformers: trace K of the identical layers at full width and "
                   "replicate them to the model's depth (K must divide it)")  # fmt: skip
    t.add_argument("--calibration", help="with --shapes-only: a calibration table (JSON) "
                   "instead of the shipped H100 one")  # fmt: skip
    t.add_argument("--master-weights", action="store_true",
                   help="Llama: bfloat16 parameters with float32 master weights in the optimizer "
                   "(Megatron-LM) instead of float32 parameters cast where used (torchtitan)")  # fmt: skip
    t.set_defaults(func=cmd_trace)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TrioSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
