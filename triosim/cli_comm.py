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

from pathlib import Path

from triosim.errors import ConfigError


def _config(path: str, sets):
    from triosim.config import from_dict, parse_yaml, read_yaml, set_field

    p = Path(path)
    data = read_yaml(p)
    for s in sets or []:
        if "=" not in s:
            raise ConfigError("--set", s, "FIELD=VALUE")
        k, v = s.split("=", 1)
        set_field(data, k, parse_yaml(v, f"--set {s!r}"))
    return from_dict(data, base_dir=p.parent)


def cmd_collectives(args) -> int:
    from triosim import nccl_tests
    from triosim.calibration import collective_times

    cfg = _config(args.config, args.set)
    sizes = nccl_tests.sizes(nccl_tests.parse_size(args.minbytes),
                             nccl_tests.parse_size(args.maxbytes), args.stepfactor,
                             nccl_tests.parse_size(args.stepbytes))  # fmt: skip
    rows = collective_times(cfg, args.op, sizes, root=args.root)
    n = cfg.num_gpus
    rooted = nccl_tests.OPS[args.op][2]
    print(f"# triosim collectives: {args.op}_perf simulated on {args.config} ({n} GPUs, "
          f"topology {cfg.topology.kind}, communication {cfg.communication.kind})")  # fmt: skip
    print(f"# minBytes {sizes[0]} maxBytes {sizes[-1]} step: {args.stepfactor}(factor)")
    print("#")
    for line in nccl_tests.header_lines():
        print(line)
    busbw = []
    for nbytes, count, seconds, algo, proto in rows:
        line = nccl_tests.row_line(args.op, nbytes, count, "float", args.root if rooted else -1,
                                   seconds, n)  # fmt: skip
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
    from triosim import nccl_tests
    from triosim.calibration import calibrate, write_calibration

    log = Path(args.log)
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        raise ConfigError("nccl-tests log", str(log), "an existing file") from None
    tables = nccl_tests.parse(text, op=args.op)
    if not tables:
        raise ConfigError("nccl-tests log", str(log), "nccl-tests output with result rows")
    table = tables[args.table]
    if table.op is None:
        table.op = "all_reduce"
    cfg = _config(args.config, args.set)
    rows = table.rows[args.offset :: args.every]
    tuning, report = calibrate(cfg, table, rows)
    out = write_calibration(args.out, tuning, report, source=str(log))
    print(f"calibrated the NCCL model on {report['rows']} rows of {log} ({report['op']}, "
          f"{report['ranks']} ranks; {', '.join(report['algorithms'])})")  # fmt: skip
    for name in report["fitted"]:
        v = getattr(tuning, name)
        shown = (
            f"{v * 1e6:.3f} us" if name in ("launch_overhead", "pipeline_overhead") else f"{v:.4f}"
        )
        print(f"  {name:<24} {shown}")
    print(f"median |error| of time on these rows: {report['median_abs_error_before']:.1%} with "
          f"NCCL's figures, {report['median_abs_error_after']:.1%} fitted")  # fmt: skip
    print(f"written to {out}; use it with communication: {{calibration: {out}}}")
    return 0


def add_commands(sub) -> None:
    """Register the two subcommands on the main parser's subparsers."""
    from triosim.nccl_tests import OPS

    c = sub.add_parser("collectives", help="simulate nccl-tests on a config's system",
                       description="Print what nccl-tests' <op>_perf prints, simulated on the "
                       "config's topology, GPUs and communication model.")  # fmt: skip
    c.add_argument("config", help="YAML config (its topology, gpu and communication)")
    c.add_argument("--op", "-o", default="all_reduce", choices=sorted(OPS),
                   help="the nccl-tests test (default all_reduce)")  # fmt: skip
    c.add_argument("-b", "--minbytes", default="8", help="smallest size (K/M/G binary: 1G = 2^30)")
    c.add_argument("-e", "--maxbytes", default="1G", help="largest size (default 1G)")
    c.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size factor (default 2)")
    c.add_argument("-i", "--stepbytes", default="0", help="size increment when -f is 1")
    c.add_argument("-r", "--root", type=int, default=0, help="root rank (broadcast, reduce)")
    c.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a config field")
    c.add_argument("-v", "--verbose", action="store_true",
                   help="append the algorithm/protocol the model ran to each line")  # fmt: skip
    c.set_defaults(func=cmd_collectives)

    k = sub.add_parser("calibrate", help="fit the NCCL model to an nccl-tests log",
                       description="Fit the NCCL model's latency, bandwidth per protocol and "
                       "pipeline cost to the output of nccl-tests (all_reduce_perf and friends) "
                       "on the config's system; write them to a YAML file that "
                       "communication.calibration names.")  # fmt: skip
    k.add_argument("log", help="nccl-tests output (MPI prefixes, NCCL INFO lines are fine)")
    k.add_argument("--config", required=True, help="YAML config describing the measured system")
    k.add_argument("--out", required=True, help="calibration YAML to write")
    k.add_argument("--op", choices=sorted(OPS), help="the test, if the log does not say")
    k.add_argument("--table", type=int, default=0, help="which table of the log (default 0)")
    k.add_argument("--every", type=int, default=1, help="fit every k-th row (default 1)")
    k.add_argument("--offset", type=int, default=0, help="first row to fit (with --every)")
    k.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a config field")
    k.set_defaults(func=cmd_calibrate)
