"""`triosim variability CONFIG --cv 0.03 --runs 50`: the iteration time's distribution when
each GPU's compute varies from iteration to iteration (triosim.studies.variability), and
by order statistics how slow the slowest GPU is at larger scales (`--at 1024,16384`);
`--slow 0.001 --slow-factor 1.2`: persistent stragglers, a fraction of GPUs slower in every
iteration; `--op-cv 0.05`: every operator on every GPU drawn apart too; `--net-cv 0.1`:
network jitter, every link's bandwidth drawn per run (heterogeneity.op_cv / link_cv).
"""

from __future__ import annotations

from triosim.cli.common import config_with_sets, cv_arg, nonnegative_int, out_path, plot_file


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
    p.add_argument(
        "--cv", type=cv_arg, default=0.0, help="per-GPU compute coefficient of variation (0.03)"
    )
    p.add_argument(
        "--op-cv",
        type=cv_arg,
        default=0.0,
        help="per-operator coefficient of variation: each operator on each GPU drawn apart",
    )
    p.add_argument(
        "--net-cv",
        type=cv_arg,
        default=0.0,
        help="network jitter: each link's bandwidth / (1 + |N(0, cv)|), drawn per run",
    )
    p.add_argument(
        "--runs",
        type=nonnegative_int,
        default=50,
        help="simulations (default 50; 0: none, only the --at estimates)",
    )
    p.add_argument("--seed", type=nonnegative_int, help="the draws' seed (default 0)")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a field")
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
    p.add_argument(
        "--plot",
        type=out_path,
        help="PNG: the step's distribution at the config's size (the runs) and at each --at",
    )
    p.add_argument("--force", action="store_true", help="overwrite the --plot PNG if it exists")
    p.set_defaults(func=cmd_variability)


def cmd_variability(args) -> int:
    from pathlib import Path

    import numpy as np

    from triosim.common.errors import InputError
    from triosim.config.loading import read_yaml
    from triosim.studies.variability import (
        draws_of,
        effective_cv,
        iteration_times,
        slowest_factor,
        slowest_quantile,
        step_run,
    )

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
    if not args.runs and not at:
        raise InputError("--runs 0 without --at: nothing to simulate")
    if not args.runs and args.seed is not None:
        raise InputError(f"--seed {args.seed}: only with seeded runs (--runs 0 draws nothing)")
    if not args.runs and args.net_cv:
        raise InputError(
            f"--net-cv {args.net_cv:g}: only with seeded runs; the step at scale (--runs 0 "
            "--at) has no network jitter in it"
        )
    seed = args.seed or 0
    slow = (args.slow, args.slow_factor)
    config = read_yaml(path) if not args.set else config_with_sets(path, args.set).to_dict()
    op_cv, net_cv = draws_of(config, args.op_cv, args.net_cv)
    png = None
    if args.plot:
        from triosim.config.loading import from_dict

        if not at:
            raise InputError("--plot draws the step at the --at GPU counts: give --at")
        png = plot_file(args.plot, args.force, from_dict(config, base_dir=path.parent), path)
    det, cv = None, args.cv
    if at or op_cv:  # the deterministic step, and a GPU's compute cv with operator draws
        det = step_run(config, 1.0, path.parent)
        tl = det.timeline
        mine = tl[(tl.gpu == det.gpus[0]) & (tl.kind == "compute") & (tl.iteration == 0)]
        cv = effective_cv(args.cv, op_cv, (mine.end - mine.start).to_numpy())
    if not args.runs:
        return _at_scale(config, path.parent, det, cv, at, slow, png=png)
    times, _, gpus = iteration_times(
        config,
        args.cv,
        args.runs,
        seed,
        path.parent,
        None,
        *slow,
        op_cv=op_cv,
        link_cv=net_cv,
        slowest=(slowest := []),
    )
    ms = times * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    drawn = f"compute cv {args.cv:g} per GPU"
    if op_cv:
        drawn += f", {op_cv:g} per operator"
    if net_cv:
        drawn += f", links cv {net_cv:g}"
    print(f"{args.runs} runs, {len(gpus)} GPUs, {drawn} (seed {seed})")
    if args.slow:
        k = round(args.slow * len(gpus))
        print(f"persistent stragglers     {k} of {len(gpus)} GPUs x {args.slow_factor:g}")
    print(
        f"iteration ms             mean {ms.mean():.4f}  P50 {p50:.4f}  P90 {p90:.4f}  P99 {p99:.4f}"
    )
    if args.cv or op_cv or args.slow:
        from collections import Counter

        most = Counter(slowest).most_common(3)
        print(
            "slowest GPUs (most compute)  "
            + ", ".join(f"GPU {g} in {n} of {args.runs} runs" for g, n in most)
        )
    for n in [len(gpus), *at]:
        print(
            f"slowest of {n:,} GPUs    factor mean {slowest_factor(cv, n, *slow):.4f}  "
            f"P99 {slowest_quantile(cv, n, 0.99, *slow):.4f}"
        )
    if at:
        if net_cv:
            print("(the step at scale below has no network jitter in it: compute draws only)")
        _at_scale(config, path.parent, det, cv, at, slow, times, png)
    return 0


def _at_scale(config: dict, base_dir, det, cv, at, slow, runs=None, png=None) -> int:
    """The step at each --at GPU count: the config with every GPU at the slowest-of-N
    factor's P50, mean and P99 (triosim.studies.variability.uniform_step; an upper bound
    except where compute ends in a collective all GPUs wait for); `det` the deterministic
    run, `cv` a GPU's compute cv (its operator draws included)."""
    from triosim.studies.variability import slowest_factor, slowest_quantile, uniform_step

    print(
        f"deterministic iteration  {det.iteration_time * 1e3:.4f} ms ({len(det.gpus):,} GPUs); "
        f"a GPU's compute cv {cv:.4g}"
    )
    known = {1.0: det.iteration_time}  # T(f): the step with every GPU at f
    for n in at:
        f50, fm = slowest_quantile(cv, n, 0.5, *slow), slowest_factor(cv, n, *slow)
        f99 = slowest_quantile(cv, n, 0.99, *slow)
        for f in (f50, fm, f99):
            known[f] = known.get(f) or uniform_step(config, f, base_dir)
        print(
            f"step at {n:,} GPUs      P50 {known[f50] * 1e3:.4f}  mean {known[fm] * 1e3:.4f}  "
            f"P99 {known[f99] * 1e3:.4f} ms  (every GPU at the slowest's factor {f50:.4f} / "
            f"{fm:.4f} / {f99:.4f})"
        )
    if png is not None:
        plot_steps(png, known, cv, at, slow, runs, len(det.gpus))
        print(f"wrote {png}")
    return 0


def plot_steps(png, known: dict, cv: float, at, slow, runs, gpus: int) -> None:
    """The step's distribution function at each --at count: T(F) at the quantiles of the
    slowest-of-N factor F, T interpolated linearly between the simulated points (exact
    where the step is linear in the factor, as in mode dp); the seeded runs' empirical one
    at the config's size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from triosim.common.outputs import replacing
    from triosim.studies.variability import slowest_quantile

    fs = np.array(sorted(known))
    ts = np.array([known[f] for f in fs]) * 1e3

    def step(f):  # linear through the points, extended by the last segment's slope
        if len(fs) == 1:
            return np.full_like(f, ts[0])
        inside = np.interp(f, fs, ts)
        k = (ts[-1] - ts[-2]) / (fs[-1] - fs[-2])
        return np.where(f > fs[-1], ts[-1] + k * (f - fs[-1]), inside)

    qs = np.linspace(0.005, 0.995, 199)
    fig, ax = plt.subplots(figsize=(7, 4))
    if runs is not None and len(runs):
        x = np.sort(np.asarray(runs) * 1e3)
        ax.step(
            x,
            np.arange(1, len(x) + 1) / len(x),
            where="post",
            color="k",
            lw=1.2,
            label=f"{gpus:,} GPUs: {len(x)} simulated runs",
        )
    for i, n in enumerate(at):
        f = np.array([slowest_quantile(cv, n, q, *slow) for q in qs])
        ax.plot(step(f), qs, color=f"C{i}", label=f"{n:,} GPUs (order statistics)")
    ax.set_xlabel("iteration time (ms)")
    ax.set_ylabel("probability the step is at most")
    ax.set_title(f"the step waits for the slowest GPU (a GPU's compute cv {cv:.3g})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    with replacing(png) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
