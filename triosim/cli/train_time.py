"""`triosim train-time CONFIG --tokens 15T`: how long training on that many tokens takes on
the config's system, failures, checkpoints and restarts included
(triosim.studies.train_time).

    triosim train-time examples/titan_llama8b_fsdp.yaml --tokens 1T
simulates one iteration, then prints the steps, the failure-free time, the run's mean time
between failures, the checkpoint's size and write time, the checkpoint interval that
minimises the expected time (and Young's first-order one beside it), the expected wall time
and the goodput, each input with its source.
"""

from __future__ import annotations

import argparse
import math

from triosim.cli.common import cv_arg, nonnegative_int, out_path, plot_file
from triosim.common.errors import InputError

SUFFIX = {"k": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12}


def tokens(text: str) -> float:
    """A token count: 15e12, 15T, 1.5B."""
    s = str(text).strip()
    mult = SUFFIX.get(s[-1:], 1.0) if s[-1:].isalpha() else 1.0
    try:
        v = float(s[:-1] if mult != 1.0 else s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"a count such as 15e12 or 15T, got {text!r}") from None
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"a positive count, got {text!r}")
    return v


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train-time",
        help="the time to train on N tokens: iterations, failures, checkpoints, restarts",
        description="Simulate CONFIG's iteration, then the whole training run: steps for "
        "--tokens, failures at a mean time between failures per GPU, checkpoints (the "
        "model's weights and optimizer states over the storage bandwidth) at the best "
        "interval, a restart after each failure (Daly's expected time).",
    )
    p.add_argument("config", help="the config (YAML) of one training iteration")
    p.add_argument("--tokens", required=True, type=tokens, help="tokens to train on (15T)")
    p.add_argument("--mtbf-gpu", help="mean time between GPU failures per GPU (default: Llama 3's)")
    p.add_argument(
        "--mtbf-node",
        help="mean time between failures per node: host, software, NIC (default: Llama 3's)",
    )
    p.add_argument(
        "--mtbf-link",
        help="mean time between failures per GPU's link into the network (default: Llama 3's)",
    )
    p.add_argument("--storage-bandwidth", help="checkpoint write bandwidth (default: 2 TB/s)")
    p.add_argument("--restart", help="time from a failure to training again (default: 600 s)")
    p.add_argument(
        "--checkpoint-interval", help="training time between checkpoints (default: best)"
    )
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a field")
    p.add_argument(
        "--cv",
        type=cv_arg,
        default=0.0,
        help="per-GPU compute variability (as `triosim variability`): the steps' mean over "
        "--runs seeded simulations is the step, their P50 and P99 printed; with --runs 0, "
        "the step with every GPU at the slowest GPU's mean factor (order statistics)",
    )
    p.add_argument(
        "--runs",
        type=nonnegative_int,
        help="with --cv: simulations (default 20; 0: the order statistics' step instead)",
    )
    p.add_argument("--seed", type=nonnegative_int, help="with --cv: the draws' seed (default 0)")
    p.add_argument("--plot", type=out_path, help="PNG: goodput against the checkpoint interval")
    p.add_argument("--force", action="store_true", help="overwrite the --plot PNG if it exists")
    p.set_defaults(func=cmd_train_time)


def cmd_train_time(args) -> int:
    from triosim.cli.common import config_with_sets
    from triosim.common import schema
    from triosim.results.memory import model_state_bytes
    from triosim.simulation.wiring import Simulation
    from triosim.studies.train_time import TrainTimeOptions, estimate

    for flag in ("runs", "seed"):  # without variability nothing is drawn: refused, not ignored
        if getattr(args, flag) is not None and not args.cv:
            raise InputError(
                f"--{flag} {getattr(args, flag)}: only with --cv (the variability drawn)"
            )
    if args.runs == 0 and args.seed is not None:
        raise InputError(f"--seed {args.seed}: only with seeded runs (--runs 0 draws nothing)")
    runs = 20 if args.runs is None else args.runs
    seed = args.seed or 0
    cfg = config_with_sets(args.config, args.set)
    png = plot_file(args.plot, args.force, cfg, args.config) if args.plot else None
    given = {"tokens": args.tokens}
    for field in (
        "mtbf_gpu",
        "mtbf_node",
        "mtbf_link",
        "storage_bandwidth",
        "restart",
        "checkpoint_interval",
    ):
        text = getattr(args, field)
        if text is not None:  # each by its option's unit and bounds (0 s MTBF was a math error)
            given[field] = schema.convert_field(
                TrainTimeOptions, field, text, "--" + field.replace("_", "-")
            )
    o = TrainTimeOptions(**given)
    sim = Simulation(cfg)
    r = sim.run()
    seq = sim.trace.metadata.get("seq_len")
    batch = sim.config.batch_size or sim.trace.batch_size
    if not seq or not batch:
        raise InputError(
            f"{args.config}: a trace with a sequence length (metadata seq_len) and a batch "
            "size: --tokens counts tokens, a step trains batch x sequence of them"
        )
    state = model_state_bytes(sim.trace, sim.config.memory, sim.extrapolator)
    step = r.iteration_time
    if args.cv and not runs:
        from triosim.studies.variability import slowest_factor, uniform_step

        f = slowest_factor(args.cv, len(sim.gpus))
        step = uniform_step(cfg.to_dict(), f, cfg.base_dir)
        print(
            f"step with cv {args.cv:g}       {step * 1e3:.4f} ms: every GPU at the slowest of "
            f"{len(sim.gpus):,}'s mean factor {f:.4f} (deterministic {r.iteration_time * 1e3:.4f})"
        )
    elif args.cv:
        import numpy as np

        from triosim.studies.variability import iteration_times

        times, _, _ = iteration_times(cfg.to_dict(), args.cv, runs, seed, cfg.base_dir)
        step = float(times.mean())  # a run's steps add up: their mean (S is large)
        p50, p99 = np.percentile(times, [50, 99]) * 1e3
        print(
            f"step with cv {args.cv:g}       mean {step * 1e3:.4f} ms, P50 {p50:.4f}, P99 "
            f"{p99:.4f} ({runs} runs; deterministic {r.iteration_time * 1e3:.4f})"
        )
    t = estimate(step, batch * seq, len(sim.gpus), state, o, nodes_of(sim))
    day = 86400.0
    print(
        f"iteration                {t.iteration * 1e3:.4f} ms ({len(sim.gpus)} GPUs, "
        f"{batch * seq:,.0f} tokens a step)"
    )
    print(f"steps                    {t.steps:,.0f} for {o.tokens:.4g} tokens")
    print(
        f"training, no failures    {t.work / day:.3f} days (checkpoints included: "
        f"{t.no_failures / day:.3f})"
    )
    print(
        f"run's MTBF               {t.mtbf / 3600:.3f} h ({t.gpus:,} GPUs x 1 per "
        f"{o.mtbf_gpu / day:,.1f} days, {t.nodes:,} nodes x 1 per {o.mtbf_node / day:,.1f}, "
        f"{t.links:,} links x 1 per {o.mtbf_link / day:,.1f})"
    )
    print(
        f"checkpoint               {t.state_bytes / 1e9:,.1f} GB in {t.checkpoint_write:.3g} s "
        f"at {o.storage_bandwidth / 1e12:g} TB/s"
    )
    print(
        f"checkpoint interval      {t.interval / 60:.1f} min (best {t.best / 60:.1f}, "
        f"Young's sqrt(2 x write x MTBF) {t.young / 60:.1f})"
    )
    print(f"restart                  {o.restart / 60:.1f} min")
    print(
        f"expected wall time       {t.expected / day:.3f} days (P10 {t.spread[0] / day:.3f}, "
        f"P90 {t.spread[1] / day:.3f}); goodput {t.goodput:.1%}"
    )
    if png is not None:
        plot_goodput(t, o, png)
        print(f"wrote {png}")
    return 0


def nodes_of(sim) -> int | None:
    """The nodes the topology puts its GPUs in (its builders' `node` attribute), or None
    where it names none."""
    nodes = {sim.graph.nodes[g].get("node") for g in sim.gpus}
    return None if None in nodes else len(nodes)


def plot_goodput(t, o, png) -> None:
    """Goodput against the checkpoint interval (a tenth to ten times Young's), the best
    and Young's marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from triosim.common.outputs import replacing
    from triosim.studies.train_time import expected_time

    taus = np.geomspace(t.young / 10, min(t.work, t.young * 10), 200)
    good = [t.work / expected_time(t.work, x, t.checkpoint_write, o.restart, t.mtbf) for x in taus]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.semilogx(taus / 60, np.array(good) * 100, color="C0")
    ax.axvline(t.best / 60, color="C1", ls="--", label=f"best {t.best / 60:.1f} min")
    ax.axvline(t.young / 60, color="C2", ls=":", label=f"Young {t.young / 60:.1f} min")
    ax.set_xlabel("checkpoint interval (min of training)")
    ax.set_ylabel("goodput (%)")
    ax.set_title(
        f"{t.gpus:,} GPUs, run MTBF {t.mtbf / 3600:.2f} h, checkpoint {t.checkpoint_write:.3g} s, "
        f"restart {o.restart:.0f} s",
        fontsize=9,
    )
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    with replacing(png) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
