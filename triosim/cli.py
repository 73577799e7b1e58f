"""The `triosim` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from triosim.errors import TrioSimError

EPILOG = """examples:
  triosim simulate examples/ddp.yaml               simulate, print a summary, write outputs
  triosim simulate examples/ddp.yaml --set num_gpus=8 --set topology.bandwidth="100 GB/s"
  triosim info traces/cpu/resnet18-b8.trace.json.gz
  triosim trace resnet18 --batch-size 8 --device cpu --out traces/mine
  triosim import ../triosim-go-traces/vgg13 vgg13.trace.json.gz
"""


def _set(data: dict, assignment: str) -> None:
    import yaml

    if "=" not in assignment:
        raise SystemExit(f"--set expects FIELD=VALUE, got {assignment!r}")
    from triosim.config import set_field

    key, value = assignment.split("=", 1)
    set_field(data, key, yaml.safe_load(value))


def cmd_simulate(args) -> int:
    import yaml

    from triosim.config import from_dict
    from triosim.simulation import Simulation

    path = Path(args.config)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        print(f"error: no config file {path}", file=sys.stderr)
        return 2
    for s in args.set or []:
        _set(data, s)
    cfg = from_dict(data, base_dir=path.parent)
    result = Simulation(cfg, progress=True).run()
    print(result.summary())
    out = Path(args.out) if args.out else Path("out") / path.stem
    if not args.no_save:
        result.save(out)
        print(f"\noutputs written to {out}/ (timeline.csv, per_gpu.csv, per_layer.csv, links.csv,"
              " summary.json, chrome_trace.json, timeline.png, config.yaml)")  # fmt: skip
    return 0


def cmd_info(args) -> int:
    from collections import Counter

    from triosim.simulation import load_any_trace

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
    return 0


def cmd_import(args) -> int:
    from triosim.importers import import_triosim_csv
    from triosim.trace import save

    t = import_triosim_csv(args.source, batch_size=args.batch_size)
    save(t, args.out)
    print(f"imported {len(t.operators)} operators, {len(t.tensors)} tensors -> {args.out}")
    return 0


def cmd_trace(args) -> int:
    from tracer.cli import run_trace

    return run_trace(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="triosim",
        description="Predict multi-GPU DNN training iteration time from a single-GPU trace.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("simulate", help="run the simulation a YAML config describes",
                       description="Simulate one training iteration as the YAML config says; print "
                       "a summary (ms) and write timeline, breakdowns, Chrome trace and plot.")  # fmt: skip
    s.add_argument("config", help="YAML config (see examples/)")
    s.add_argument("--out", help="output folder (default: out/<config name>)")
    s.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override a config field, e.g. --set num_gpus=8 --set parallelism.mode=dp")  # fmt: skip
    s.add_argument("--no-save", action="store_true", help="print the summary only")
    s.set_defaults(func=cmd_simulate)

    i = sub.add_parser(
        "info", help="describe a trace", description="Load, validate and describe a trace."
    )
    i.add_argument("trace", help="a .trace.json(.gz) file or a TrioSim CSV folder")
    i.set_defaults(func=cmd_info)

    im = sub.add_parser("import", help="convert an original TrioSim trace.csv + tensor.csv",
                        description="Convert the original TrioSim CSV pair into a triosim trace file.")  # fmt: skip
    im.add_argument("source", help="folder with trace.csv and tensor.csv (or trace.csv)")
    im.add_argument("out", help="output .trace.json or .trace.json.gz")
    im.add_argument("--batch-size", type=int, help="batch size (default: first input's first dim)")
    im.set_defaults(func=cmd_import)

    t = sub.add_parser("trace", help="trace one training iteration of a model with PyTorch",
                       description="Run warm-up and timed iterations, then profile one iteration with "
                       "PyTorch Profiler + Execution Trace Observer; write a triosim trace.")  # fmt: skip
    t.add_argument("model", help="a reference model: resnet18, resnet50, resnet152, vgg11, vgg16, "
                   "densenet121, gpt2, bert, or module:function returning (model, make_batch(batch_size, device), loss_fn)")  # fmt: skip
    t.add_argument("--batch-size", type=int, required=True)
    t.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--warmup", type=int, default=3, help="warm-up iterations (paper: 30)")
    t.add_argument("--measure", type=int, default=5, help="timed iterations (paper: 10)")
    t.add_argument("--seq-len", type=int, default=128, help="sequence length for gpt2/bert")
    t.add_argument("--small", action="store_true", help="a reduced model size (fast CPU traces)")
    t.add_argument("--image-size", type=int, default=224, help="image side for CNNs")
    t.set_defaults(func=cmd_trace)

    from triosim.cli_comm import add_commands

    add_commands(sub)  # collectives, calibrate
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
