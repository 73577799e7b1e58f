"""The host that issues a GPU's operators: how long the CPU takes to issue each one, and
what the GPU loses between kernels.

A training step's Python thread (and PyTorch's autograd thread in the backward) issues the
operators in order, asynchronously: each costs the host some time (the dispatcher, the
kernel launches), then its kernels queue on the stream. A GPU that finishes its queue
before the host issues the next operator idles: a model of many small operators is
host-bound, and cutting the work per GPU (a smaller batch, a TP shard, a micro-batch)
shrinks the kernels, not the host's work. The runtime (extrapolators.execution.runtime)
runs the schedule; this module says what each operator costs the host and the GPU:

- host time of an operator (`source: launches`, the default): `op_cost x (1 + kernels)`,
  one dispatch and one launch per kernel, each `op_cost` seconds. It does not depend on the
  batch or the TP degree: the same operators launch the same kernels.
  `source: trace`: the trace's own `host_time` column x `trace_scale` (for host columns a
  user trusts; the profiled ones are slowed by the profiler, see below).
- the GPU's gap per kernel (`kernel_gap`): consecutive queued kernels do not start back to
  back; each of an operator's kernels adds it to the operator's GPU time.
- `launch_latency`: from the end of the operator's issue to its first kernel's start on an
  idle GPU.
- an operator marked `sync` (item, a copy to the host) blocks the host until its GPU work
  ends.

Where the numbers come from (`python benchmarks/host_fit.py` prints them; docs/models.md,
"The host"):
`op_cost` is the host CPU's (perfmodel/host_cpus.py: `host.cpu` names one, `host.op_cost`
gives yours): 12.9 us on the H100 machine that recorded the traces (its host-bound runs:
ResNet-152 b32 11.70 us, DenseNet-121 b32 13.49 and b64 14.74; one cost per launch does not
hold across models, leave one model out misses the other's b32 run by 13-20 %), 19.2 us on
the machine that recorded the profiles. An operator that launches no kernel (an item() on
the optimizer's CPU step count, an AccumulateGrad that takes the gradient as it is, a view)
costs one dispatch: counted as a launch (tracers before wrote 1 kernel for it), ResNet-152's
934 item() calls alone cost 24 ms of a 57 ms host-bound step. `kernel_gap` 1.07 us is
fitted on a GPU-bound trace (ResNet-50 b128, 71.49 ms), whose time the host does not
decide. `launch_latency` 8 us is measured: in the host-bound imported profiles
(traces/h100/imported) the GPU idled 6.8 to 11.2 us per kernel after the launch call began
(median 8.0). Two measurements the profiles give are not used, because the profiler
inflates them: their kernel-to-kernel gap (1.6 us per kernel, where a plain ResNet-152 b64
leaves room for at most 0.83) and their host spans (the trace's host_time column: 2 to 4
times the plain loop's, and 35 % apart between two profiles of the same DenseNet-121);
`source: trace` uses the latter for host columns a user trusts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from perfmodel.host_cpus import DEFAULT_CPU, HOST_CPUS
from triosim.common.errors import ConfigError
from triosim.common.schema import option
from triosim.trace.model import Operator, Trace

# measured and fitted values: see the module docstring
OP_COST = HOST_CPUS[DEFAULT_CPU].op_cost
LAUNCH_LATENCY = 8.0e-6
KERNEL_GAP = 1.07e-6


@dataclass
class HostOptions:
    """The config's `host` section."""

    model: Literal["auto", "on", "off"] = option(
        "auto",
        help="auto: on for traces of a GPU (recorded on CUDA, imported from a GPU profile or "
        "modelled for a GPU), off for CPU and synthetic traces",
    )
    source: Literal["launches", "trace"] = option(
        "launches",
        help="launches: op_cost per operator and per kernel launch; trace: the trace's "
        "host_time column x trace_scale",
    )
    cpu: str | None = option(
        None,
        help="the host CPU, from the catalogue (perfmodel/host_cpus.py: "
        + ", ".join(HOST_CPUS)
        + f"); unset: op_cost, whose default is {DEFAULT_CPU}'s",
    )
    op_cost: float = option(
        OP_COST,
        unit="seconds",
        ge=0,
        help="host time per operator dispatch and per kernel launch (a CPU property; "
        "fit yours with triosim fit-host; or name a catalogued host with cpu)",
    )
    launch_latency: float = option(
        LAUNCH_LATENCY, unit="seconds", ge=0, help="from an issue to the kernel's start"
    )
    kernel_gap: float = option(
        KERNEL_GAP, unit="seconds", ge=0, help="GPU time lost per kernel between kernels"
    )
    trace_scale: float = option(1.0, gt=0, help="factor on the trace's host_time (source: trace)")


def check_fields(o: HostOptions, given=None) -> None:
    """Every field of a config's `host` section is read, or refused when set (off its
    default): with model off nothing reads the others, and trace_scale scales only source
    trace's times. `given`: the section as written, for the value as the user gave it."""
    given = given if isinstance(given, dict) else {}
    default = HostOptions()
    if o.model == "off":
        unused = ("source", "cpu", "op_cost", "launch_latency", "kernel_gap", "trace_scale")
    else:
        unused = () if o.source == "trace" else ("trace_scale",)
    op_cost(o, given)  # a catalogued name; not beside an op_cost of its own
    for name in unused:
        if getattr(o, name) != getattr(default, name):
            why = (
                "host.model off (nothing reads it): set model on or auto"
                if o.model == "off"
                else "host.source launches (it scales the trace's host times): set source trace"
            )
            raise ConfigError(
                f"host.{name}",
                given.get(name, getattr(o, name)),
                f"unset with {why}, or leave it out",
            )


def op_cost(o: HostOptions, given=None) -> float:
    """The host's seconds per dispatch and launch: the catalogued host `cpu` names, else
    `op_cost` (its default the default host's). `given`: the section as written (an
    op_cost written beside cpu is refused even at the default's value; errors name the
    values as written)."""
    given = given if isinstance(given, dict) else {}
    if o.cpu is None:
        return o.op_cost
    if o.cpu not in HOST_CPUS:
        raise ConfigError(
            "host.cpu",
            given.get("cpu", o.cpu),
            "one of " + ", ".join(HOST_CPUS) + " (or give op_cost)",
        )
    if "op_cost" in given or o.op_cost != OP_COST:
        raise ConfigError(
            "host.op_cost",
            given.get("op_cost", o.op_cost),
            f"unset with host.cpu {o.cpu!r} (the catalogue gives its cost): one of the two",
        )
    return HOST_CPUS[o.cpu].op_cost


def runs_on_gpu(trace: Trace) -> bool:
    """Whether the trace's operators ran on (or were modelled for) a GPU, so that a host
    issued them: what `model: auto` turns the host model on for."""
    md = trace.metadata
    device = str(md.get("device") or "").lower()
    if device.startswith("cuda"):
        return True
    gpu = str(md.get("gpu") or "").lower()
    return bool(md.get("modelled")) and gpu not in ("", "cpu")


class HostModel:
    """`issue(op)`: seconds the host spends issuing `op`; `gap(op)`: GPU seconds its kernels
    lose between them (added to its GPU time); `launch_latency` and `sync(op)` for the
    runtime. Built only where the host model is on (`for_trace`)."""

    def __init__(self, trace: Trace, options: HostOptions | None = None):
        self.options = o = options or HostOptions()
        self.launch_latency = o.launch_latency
        self.op_cost = op_cost(o)
        self.comm_cost = self.op_cost  # a collective or a send: one NCCL kernel launch
        if o.source == "trace" and trace.metadata.get("shapes_only"):
            raise ConfigError(
                "host.source",
                "trace",
                "launches with a shape-only trace: its host times are what the tracer's CPU "
                "spent on the meta device, not a GPU run's issue times",
            )
        if o.source == "trace":
            missing = sum(op.host_time is None for op in trace.operators)
            if missing:
                raise ConfigError(
                    "host.source",
                    "trace",
                    f"a trace with host times ({missing} of {len(trace.operators)} operators "
                    "have none: a format-1 trace, or a CPU profile); use source: launches",
                )

    @classmethod
    def for_trace(cls, trace: Trace, options: HostOptions | None) -> HostModel | None:
        """The model when the options turn it on for this trace, else None."""
        o = options or HostOptions()
        if o.model == "off" or (o.model == "auto" and not runs_on_gpu(trace)):
            return None
        return cls(trace, o)

    def issue(self, op: Operator) -> float:
        o = self.options
        if o.source == "trace":
            return op.host_time * o.trace_scale
        return self.op_cost * (1 + op.kernels)

    def gap(self, op: Operator, gpu_time: float) -> float:
        """The kernels' gaps, for an operator that runs on the GPU (gpu_time > 0)."""
        return self.options.kernel_gap * op.kernels if gpu_time > 0 else 0.0

    def describe(self) -> str:
        o = self.options
        cost = (
            f"op_cost {self.op_cost * 1e6:.3g} us per operator and launch"
            if o.source == "launches"
            else f"the trace's host_time x {o.trace_scale:g}"
        )
        out = (
            f"on ({cost}, launch latency {o.launch_latency * 1e6:.3g} us, kernel gap "
            f"{o.kernel_gap * 1e6:.3g} us)"
        )
        if o.source == "launches" and (o.cpu is not None or o.op_cost == OP_COST):
            cpu = HOST_CPUS[o.cpu or DEFAULT_CPU]
            lo, hi = cpu.spread
            others = ", ".join(
                f"{c.name} {c.op_cost * 1e6:.3g}" for c in HOST_CPUS.values() if c is not cpu
            )
            named = f"host cpu {cpu.name}" if o.cpu else f"a default: host cpu {cpu.name}"
            fits = (
                f"its host-bound runs fit {lo * 1e6:.3g}-{hi * 1e6:.3g} us"
                if len(cpu.fits) > 1
                else f"its host-bound run fits {lo * 1e6:.3g} us"
            )
            out += f"; op_cost {named}, {fits} (other hosts: {others} us)"
        return out

    @staticmethod
    def off_reason(trace: Trace, options: HostOptions | None) -> str:
        """Why the model is off for this trace (for the summary)."""
        if (options or HostOptions()).model == "off":
            return "off (host.model: off)"
        return "off (not a GPU trace: host.model auto)"

    @staticmethod
    def sync(op: Operator) -> bool:
        return bool(op.sync)
