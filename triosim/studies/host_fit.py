"""Fit the host model's costs to measured iterations: what `triosim fit-host` prints.

The host's time per operator dispatch and kernel launch (`host.op_cost`, perfmodel/host.py)
is a property of the CPU that runs the training loop, not of the GPU: two H100 machines
needed 12.9 and 19.2 us (perfmodel/host_cpus.py). The GPU's gap per kernel (`host.kernel_gap`) is the device's and
the driver's. Each is fitted on the one-GPU simulation (mode single, the trace's own
operator times) of one trace whose time it decides, by bisection (the simulated time does
not decrease as either grows):

- `fit_op_cost(trace, measured)` on a host-bound run (many small operators: DenseNet,
  ResNet-152 at a small batch). A run whose time with a free host (the GPU's work alone)
  is within `HOST_BOUND` (5 %) of the measurement is not decided by its host: the fit
  would only find the knee where the host starts to matter (at most an upper bound), as
  ResNet-152 b64 did (0.8 % above its GPU time: 12.7 us, where its host-bound b32 run
  needs 11.7): an error says so. `batch_size` and `perfmodel` fit a run at another batch
  than the trace's (its operators scaled by that operator model), e.g. the b32 run of a
  b64 trace.
- `fit_kernel_gap(trace, measured)` on a GPU-bound one (its host issues ahead of the GPU).

A measurement below the trace's time with a free host (and no gap) fits nothing: the GPU
work alone takes longer.
"""

from __future__ import annotations

import dataclasses

from perfmodel.host import HostOptions
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation
from triosim.trace.model import Trace

# a run is host-bound when its measured time exceeds the GPU's work alone by more than this
# (the shared H100 timings' run-to-run spread: 0.2-2.3 % where the GPU decides)
HOST_BOUND = 0.05


def replay_time(
    trace: Trace, host: HostOptions, batch_size: int | None = None, perfmodel: str = "trace"
) -> float:
    """Seconds of the one-GPU simulation of `trace` with `host` (at `batch_size`, the
    operators timed by `perfmodel`; default: the trace's own batch and times)."""
    cfg = {"num_gpus": 1, "perfmodel": {"kind": perfmodel}, "host": dataclasses.asdict(host)}
    if batch_size is not None:
        cfg["batch_size"] = batch_size
    return Simulation(cfg, trace=trace).run().iteration_time


def fit_option(
    trace,
    measured,
    field,
    host,
    upper,
    tol,
    host_bound: bool,
    lower: float = 0.0,
    batch_size: int | None = None,
    perfmodel: str = "trace",
) -> float:
    """The value of host option `field` in [lower, upper] (to `tol`) at which the replay of
    `trace` with `host` (model on; its other options as given) takes `measured` seconds;
    `host_bound`: refuse a run whose time at `lower` is within HOST_BOUND of it."""
    if not measured > 0:
        raise ConfigError("measured", measured, "a positive iteration time in seconds")
    base = dataclasses.replace(host or HostOptions(), model="on")

    def at(x: float) -> float:
        # (a fitted op_cost is the host's own: not beside a catalogued host.cpu)
        mine = {"cpu": None} if field == "op_cost" else {}
        host = dataclasses.replace(base, **{field: x}, **mine)
        return replay_time(trace, host, batch_size, perfmodel)

    lo, hi = lower, upper
    floor = at(lo)
    if floor > measured:
        raise ConfigError(
            "measured",
            measured,
            f"at least the trace's time with {field} {lower:g} ({floor:.6g} s): the GPU work alone "
            f"takes that long, so no {field} fits",
        )
    if host_bound and measured < floor * (1 + HOST_BOUND):
        raise ConfigError(
            "measured",
            measured,
            f"the time of a host-bound run: this one takes {floor:.6g} s with a free host and "
            f"the measurement is less than {HOST_BOUND:.0%} above that, so its GPU decides it "
            "and the fit would be at most an upper bound; fit on a run the host decides (a "
            "model of many small operators at a small batch: DenseNet, ResNet-152 at batch 32)",
        )
    if at(hi) < measured:
        raise ConfigError(
            "measured",
            measured,
            f"at most the replay with {field} {upper:g} s ({at(hi):.6g} s): is the "
            "measurement of this trace's model and batch?",
        )
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if at(mid) < measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_op_cost(
    trace: Trace,
    measured: float,
    host: HostOptions | None = None,
    batch_size: int | None = None,
    perfmodel: str = "trace",
) -> float:
    """The `op_cost` (seconds) at which the replay of `trace` (at `batch_size`, timed by
    `perfmodel`) takes `measured` seconds; the other host options as given."""
    launches = dataclasses.replace(host or HostOptions(), source="launches")
    return fit_option(
        trace, measured, "op_cost", launches, 1e-3, 1e-9, True, 0.0, batch_size, perfmodel
    )


def fit_spread(fit, trace: Trace, measured: float, rel: float = 0.01) -> tuple[float, float]:
    """The values `fit` gives for the measurement `rel` below and above (a run-to-run
    spread: the shared H100 timings vary by 0.2-8 %): a nearly GPU-bound trace pins its
    cost down loosely, and this says how loosely. A side that fits nothing (below the
    trace's GPU work, or GPU-bound) counts as 0."""
    out = []
    for m in (measured * (1 - rel), measured * (1 + rel)):
        try:
            out.append(fit(trace, m))
        except ConfigError:
            out.append(0.0)
    return out[0], out[1]


def fit_kernel_gap(trace: Trace, measured: float, host: HostOptions | None = None) -> float:
    """The `kernel_gap` (seconds) at which the replay of `trace` takes `measured` seconds."""
    launches = dataclasses.replace(host or HostOptions(), source="launches")
    return fit_option(trace, measured, "kernel_gap", launches, 1e-4, 1e-10, host_bound=False)
