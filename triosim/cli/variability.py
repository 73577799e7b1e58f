"""`triosim variability CONFIG --cv 0.03 --runs 50`: the iteration time's distribution when
each GPU's compute varies from iteration to iteration (triosim.studies.variability), and
by order statistics how slow the slowest GPU is at larger scales (`--at 1024,16384`);
`--slow 0.001 --slow-factor 1.2`: persistent stragglers, a fraction of GPUs slower in every
iteration.
"""

from __future__ import annotations

from triosim.cli.common import cv_arg, nonnegative_int, positive_int


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "variability",
        help="iteration time P50/P90/P99 with per-GPU compute variability; stragglers at scale",
        description="Simulate CONFIG --runs times, each GPU's compute slowed by a factor drawn "
        "per GPU and run (log-normal, mean 1, coefficient of variation --cv; seeded), and "
        "print the iteration time's percentiles; with --at, the slowest GPU's factor at "
        "those GPU counts by order statistics (no simulation).",
    )
    p.add_argument("config", help="the config (YAML) of one training iteration")
    p.add_argument("--cv", type=cv_arg, required=True, help="coefficient of variation (0.03)")
    p.add_argument("--runs", type=positive_int, default=50, help="simulations (default 50)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="the draws' seed (default 0)")
    p.add_argument("--at", help="GPU counts for the order statistics, comma-separated")
    p.add_argument(
        "--slow",
        type=float,
        default=0.0,
        help="fraction of GPUs slow in every iteration (persistent stragglers; default 0)",
    )
    p.add_argument(
        "--slow-factor",
        type=float,
        default=1.0,
        help="how much slower a slow GPU computes (>= 1; e.g. 1.2)",
    )
    p.set_defaults(func=cmd_variability)


def cmd_variability(args) -> int:
    from pathlib import Path

    import numpy as np

    from triosim.common.errors import InputError
    from triosim.config.loading import read_yaml
    from triosim.studies.variability import iteration_times, slowest_factor, slowest_quantile

    if not 0 <= args.slow < 1:
        raise InputError(f"--slow {args.slow:g}: a fraction of the GPUs, 0 <= f < 1")
    if not args.slow_factor >= 1:
        raise InputError(f"--slow-factor {args.slow_factor:g}: at least 1 (how much slower)")
    # each without the other slows nothing: refused rather than ignored
    if args.slow_factor != 1 and not args.slow:
        raise InputError(
            f"--slow-factor {args.slow_factor:g}: only with --slow (the fraction of GPUs it "
            "slows); without it no GPU is slower"
        )
    if args.slow and args.slow_factor == 1:
        raise InputError(
            f"--slow {args.slow:g}: with --slow-factor above 1 (how much slower those GPUs "
            "compute); at the default 1 they are not slower"
        )
    at = []
    for x in (args.at or "").split(","):
        if x.strip():
            try:
                at.append(int(x))
            except ValueError:
                at.append(0)
            if at[-1] < 1:
                raise InputError(f"--at {args.at!r}: GPU counts (integers >= 1) such as 1024,16384")
    path = Path(args.config)
    slow = (args.slow, args.slow_factor)
    times, _, gpus = iteration_times(
        read_yaml(path), args.cv, args.runs, args.seed, path.parent, None, *slow
    )
    ms = times * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    print(f"{args.runs} runs, {len(gpus)} GPUs, compute cv {args.cv:g} per GPU (seed {args.seed})")
    if args.slow:
        k = round(args.slow * len(gpus))
        print(f"persistent stragglers     {k} of {len(gpus)} GPUs x {args.slow_factor:g}")
    print(
        f"iteration ms             mean {ms.mean():.4f}  P50 {p50:.4f}  P90 {p90:.4f}  P99 {p99:.4f}"
    )
    for n in [len(gpus), *at]:
        print(
            f"slowest of {n:,} GPUs    factor mean {slowest_factor(args.cv, n, *slow):.4f}  "
            f"P99 {slowest_quantile(args.cv, n, 0.99, *slow):.4f}"
        )
    return 0
