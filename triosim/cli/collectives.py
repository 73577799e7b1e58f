"""`triosim collectives` and `triosim calibrate`: collective communication on its own.

    triosim collectives CONFIG --op all_reduce -b 8 -e 1G -f 2
prints what nccl-tests' all_reduce_perf prints (same columns, sizes, busbw factors),
simulated on the config's topology, GPUs and communication model, to compare line by line
with a real run.

    triosim calibrate nccl-tests.log --config CONFIG --out calib.yaml
fits the NCCL model to a measured nccl-tests log; name the file in the config as
`communication: {calibration: calib.yaml}`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from triosim.cli.common import out_path
from triosim.common.errors import InputError

# -- what the commands' arguments take (triosim.cli.main uses these too) ----------------------------


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        n = int(text)
    except ValueError:
        n = low - 1
    if n < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return n


def assignment(text: str) -> tuple[str, object]:
    """--set FIELD=VALUE: the field and the value as YAML reads it."""
    if "=" not in text:
        raise InputError(f"--set expects FIELD=VALUE, got {text!r}")
    from triosim.config.loading import parse_yaml

    key, value = text.split("=", 1)
    if not key.strip():
        raise InputError(f"--set expects FIELD=VALUE, got {text!r} (no field)")
    return key, parse_yaml(value, f"--set {text!r}")


def _config(path: str, sets):
    """The config of a system: topology, GPUs and communication. A trace is not needed (a
    collective runs none), so a config without one is taken as it is."""
    from triosim.config.loading import IN_MEMORY, from_dict, read_yaml, set_field

    p = Path(path)
    data = read_yaml(p)
    for s in sets or []:
        set_field(data, *assignment(s))
    if data.get("trace") is None:
        data["trace"] = IN_MEMORY
    return from_dict(data, base_dir=p.parent)


def cmd_collectives(args) -> int:
    from triosim.hardware import nccl_tests
    from triosim.studies.calibration import collective_times

    b = nccl_tests.parse_size(args.minbytes, "-b")
    e = nccl_tests.parse_size(args.maxbytes, "-e")
    i = nccl_tests.parse_size(args.stepbytes, "-i") if args.stepbytes is not None else 0
    if i and args.stepfactor not in (None, 1):
        raise InputError(
            f"-f {args.stepfactor} and -i {args.stepbytes}: sizes either grow by "
            "a factor (-f) or by a step (-f 1 -i BYTES), not both"
        )
    factor = args.stepfactor if args.stepfactor is not None else (1 if i else 2)
    sizes = nccl_tests.sizes(b, e, factor, i, max_rows=args.max_rows)
    cfg = _config(args.config, args.set)
    n = cfg.num_gpus
    if not args.root < n:
        raise InputError(f"-r {args.root}: the root must be a rank of the {n} GPUs (0 to {n - 1})")
    rows = collective_times(cfg, args.op, sizes, root=args.root)
    rooted = nccl_tests.OPS[args.op][2]
    print(
        f"# triosim collectives: {args.op}_perf simulated on {args.config} ({n} GPUs, "
        f"topology {cfg.topology.kind}, communication {cfg.communication.kind})"
    )
    print(
        f"# minBytes {sizes[0]} maxBytes {sizes[-1]} step: "
        + (f"{factor}(factor)" if factor > 1 else f"{i}(bytes)")
    )
    print("#")
    for line in nccl_tests.header_lines():
        print(line)
    busbw = []
    for nbytes, count, seconds, algo, proto in rows:
        line = nccl_tests.row_line(
            args.op, nbytes, count, "float", args.root if rooted else -1, seconds, n
        )
        if args.verbose and algo:
            line += f"  # {algo}/{proto}"
        print(line)
        algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        busbw.append(algbw * nccl_tests.busbw_factor(args.op, n))
    print("# Out of bounds values : 0 OK")
    print(f"# Avg bus bandwidth    : {sum(busbw) / len(busbw):g}")
    print("#")
    return 0


def cmd_calibrate(args) -> int:
    from triosim.common.outputs import check_output_file
    from triosim.hardware import nccl_tests
    from triosim.studies.calibration import calibrate, write_calibration

    log = Path(args.log)
    # the output before any work: never the log or the config, an existing file only with
    # --force, a folder that can be written
    from triosim.config.inputs import config_inputs
    from triosim.config.loading import read_yaml, set_field

    data = read_yaml(Path(args.config))
    for s in args.set or []:
        set_field(data, *assignment(s))
    check_output_file(args.out, args.force, inputs=(log, *config_inputs(args.config, data)))
    from triosim.trace.files import read_text

    text = read_text(log, "nccl-tests log", errors="replace")  # MPI prefixes: not always UTF-8
    tables = nccl_tests.parse(text)  # each table's test as the log names it
    if not tables:
        raise InputError(
            f"nccl-tests log {log}: no result rows found (expected the output of "
            "all_reduce_perf or another nccl-tests test)"
        )
    if args.table >= len(tables):
        raise InputError(
            f"--table {args.table}: {log} holds {len(tables)} result table(s), "
            f"numbered 0 to {len(tables) - 1}"
        )
    table = tables[args.table]
    if table.op is not None and args.op is not None and args.op != table.op:
        raise InputError(
            f"--op {args.op}: table {args.table} of {log} is {table.op}_perf's; "
            "drop --op (it is for a log that does not name its test)"
        )
    if table.op is None:
        if args.op is None:
            import warnings

            warnings.warn(
                f"{log} does not name its test: fitting table {args.table} as "
                "all_reduce (give --op if it is another)",
                stacklevel=1,
            )
        # read again as that test (its rank count follows from busbw / algbw)
        table = nccl_tests.parse(text, op=args.op or "all_reduce")[args.table]
    cfg = _config(args.config, args.set)
    rows = table.rows[args.offset :: args.every]
    if not rows:
        raise InputError(
            f"--offset {args.offset}: the table has {len(table.rows)} rows, "
            f"numbered 0 to {len(table.rows) - 1}"
        )
    tuning, report = calibrate(cfg, table, rows)
    out = write_calibration(args.out, tuning, report, source=str(log))
    print(
        f"calibrated the NCCL model on {report['rows']} rows of {log} ({report['op']}, "
        f"{report['ranks']} ranks; {', '.join(report['algorithms'])})"
    )
    for name in report["fitted"]:
        v = getattr(tuning, name)
        shown = (
            f"{v * 1e6:.3f} us" if name in ("launch_overhead", "pipeline_overhead") else f"{v:.4f}"
        )
        print(f"  {name:<24} {shown}")
    print(
        f"median |error| of time on these rows: {report['median_abs_error_before']:.1%} with "
        f"NCCL's figures, {report['median_abs_error_after']:.1%} fitted"
    )
    print(f"written to {out}; use it with communication: {{calibration: {out}}}")
    return 0


def _step_factor(text: str) -> int:
    """-f: nccl-tests' step factor, an integer >= 1 (1: add -i bytes instead)."""
    try:
        f = float(text)
    except ValueError:
        f = math.nan
    if not (math.isfinite(f) and f >= 1 and f == int(f)):
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(f)


def add_commands(sub) -> None:
    """Register the two subcommands on the main parser's subparsers."""
    from triosim.hardware.nccl_tests import OPS

    c = sub.add_parser(
        "collectives",
        help="simulate nccl-tests on a config's system",
        description="Print what nccl-tests' <op>_perf prints, simulated on the "
        "config's topology, GPUs and communication model.",
    )
    c.add_argument("config", help="YAML config (its topology, gpu and communication)")
    c.add_argument(
        "--op",
        "-o",
        default="all_reduce",
        choices=sorted(OPS),
        help="the nccl-tests test (default all_reduce)",
    )
    c.add_argument(
        "-b",
        "--minbytes",
        default="8",
        help="smallest size (K/M/G/T binary: 1G = 2^30; at most 1T)",
    )
    c.add_argument("-e", "--maxbytes", default="1G", help="largest size (default 1G)")
    c.add_argument(
        "-f",
        "--stepfactor",
        type=_step_factor,
        help="size factor, an integer (default 2; 1 with -i)",
    )
    c.add_argument("-i", "--stepbytes", help="size increment in bytes (implies -f 1)")
    c.add_argument(
        "-r", "--root", type=nonnegative_int, default=0, help="root rank (broadcast, reduce)"
    )
    c.add_argument(
        "--max-rows",
        type=positive_int,
        default=100_000,
        help="refuse more sizes than this (default 100000)",
    )
    c.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a config field")
    c.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="append the algorithm/protocol the model ran to each line",
    )
    c.set_defaults(func=cmd_collectives)

    k = sub.add_parser(
        "calibrate",
        help="fit the NCCL model to an nccl-tests log",
        description="Fit the NCCL model's latency, bandwidth per protocol and "
        "pipeline cost to the output of nccl-tests (all_reduce_perf and friends) "
        "on the config's system; write them to a YAML file that "
        "communication.calibration names.",
    )
    k.add_argument("log", help="nccl-tests output (MPI prefixes, NCCL INFO lines are fine)")
    k.add_argument("--config", required=True, help="YAML config describing the measured system")
    k.add_argument(
        "--out",
        required=True,
        type=out_path,
        help="calibration YAML to write (never the log or the config)",
    )
    k.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    k.add_argument("--op", choices=sorted(OPS), help="the test, if the log does not say")
    k.add_argument(
        "--table", type=nonnegative_int, default=0, help="which table of the log (default 0)"
    )
    k.add_argument("--every", type=positive_int, default=1, help="fit every k-th row (default 1)")
    k.add_argument(
        "--offset", type=nonnegative_int, default=0, help="first row to fit (with --every)"
    )
    k.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a config field")
    k.set_defaults(func=cmd_calibrate)
