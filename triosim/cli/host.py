"""`triosim fit-host TRACE --measured TIME`: the host model's CPU cost for your machine.

    triosim fit-host traces/h100/densenet121-b64.trace.json.gz --measured 66.21ms
fits `host.op_cost` (seconds per operator dispatch and kernel launch) so that the one-GPU
replay of TRACE takes the measured plain iteration time, and prints the config lines that
use it; a run the GPU decides (within 5 % of its GPU work alone) is refused. `--batch-size
32 --perfmodel learned` fits a run at another batch than the trace's (ResNet-152's b64
trace and its b32 run). `--kernel-gap` fits the GPU's gap per kernel instead, on a
GPU-bound trace.
"""

from __future__ import annotations

from triosim.cli.common import positive_int


def add_parser(subparsers) -> None:
    """Add `fit-host` to triosim's sub-commands."""
    p = subparsers.add_parser(
        "fit-host",
        help="fit the host model's CPU cost (host.op_cost) to a measured iteration",
        description="Fit host.op_cost (or, with --kernel-gap, host.kernel_gap) so that the "
        "one-GPU replay of TRACE (its own operator times) takes the measured plain "
        "iteration time (no profiler: e.g. CUDA events or perf_counter + synchronize around "
        "a training step). Fit op_cost on a host-bound trace (many small operators) and "
        "kernel_gap on a GPU-bound one.",
    )
    p.add_argument("trace", help="a trace recorded on the GPU machine (file or CSV folder)")
    p.add_argument(
        "--measured", required=True, help="the plain iteration time, with a unit (80.5ms)"
    )
    p.add_argument(
        "--kernel-gap", action="store_true", help="fit host.kernel_gap instead of op_cost"
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        help="the measured run's batch, if not the trace's (its operators then scaled by "
        "--perfmodel)",
    )
    p.add_argument(
        "--perfmodel",
        default=None,
        help="operator model for another batch: regression (default with --batch-size), "
        "learned, roofline, calibrated; without --batch-size the trace's own times",
    )
    p.set_defaults(func=cmd_fit_host)


def cmd_fit_host(args) -> int:
    import functools

    from triosim.common.errors import ConfigError, InputError
    from triosim.common.units import parse_seconds
    from triosim.studies.host_fit import fit_kernel_gap, fit_op_cost, fit_spread
    from triosim.trace.files import load_any_trace

    measured = parse_seconds(args.measured, "--measured")
    if not measured > 0:  # before loading the trace
        raise ConfigError("--measured", args.measured, "a positive iteration time in seconds")
    trace = load_any_trace(args.trace)
    device = str(trace.metadata.get("device") or "")
    if device == "cpu":  # (a fit there ran and printed a cost no GPU run has)
        raise InputError(
            f"trace {args.trace}: device 'cpu'; fit-host needs a trace recorded on the GPU "
            "machine (device cuda): on the CPU the operators ran on the host that issues them"
        )
    from perfmodel import MODELS

    kinds = [k for k in MODELS.names() if k != "trace"]  # the models that scale operators
    if args.perfmodel is not None and args.perfmodel not in (*kinds, "trace"):
        raise InputError(f"--perfmodel {args.perfmodel!r}: one of {', '.join(kinds)}")
    if args.batch_size is not None and args.perfmodel == "trace":
        raise InputError(
            f"--perfmodel trace with --batch-size {args.batch_size}: the trace's own times are "
            f"of its own batch; name a model that scales them: {', '.join(kinds)}"
        )
    if args.batch_size is None and args.perfmodel not in (None, "trace"):
        raise InputError(
            f"--perfmodel {args.perfmodel}: with --batch-size (at the trace's batch its own "
            "operator times are replayed)"
        )
    if args.batch_size is not None and args.kernel_gap:
        raise InputError("--batch-size: for op_cost (fit kernel_gap on the trace's own run)")
    field, fit = ("kernel_gap", fit_kernel_gap) if args.kernel_gap else ("op_cost", fit_op_cost)
    at = ""
    if args.batch_size is not None:
        kind = args.perfmodel or "regression"
        fit = functools.partial(fit_op_cost, batch_size=args.batch_size, perfmodel=kind)
        at = f" at batch {args.batch_size} ({kind} operator model)"
    try:
        value = fit(trace, measured)
    except ConfigError as e:  # the fit's argument is this command's --measured
        if e.field != "measured":
            raise
        raise ConfigError("--measured", args.measured, e.allowed) from None
    print(
        f"host.{field} = {value * 1e6:.3f} us: the one-GPU replay of {args.trace}{at} then "
        f"takes {measured * 1e3:.3f} ms"
    )
    print(f"config:\nhost:\n  {field}: {value * 1e6:.3f} us")
    lo, hi = fit_spread(fit, trace, measured)
    if hi - lo > 0.5 * value:  # loosely identified: say so (a GPU-bound trace)
        print(
            f"caveat: the measurement 1 % lower or higher gives {field} {lo * 1e6:.3g} to "
            f"{hi * 1e6:.3g} us: this trace's time depends little on the host (close to "
            "GPU-bound); fit on a host-bound one (many small operators: DenseNet, ResNet-152 "
            "at a small batch)"
        )
    return 0
