"""The Extrapolator interface: a single-GPU trace and a parallel plan become task streams.

`streams()` returns {(gpu, stream_name): iterator of tasks}; each iterator is a
generator that walks the shared trace, so nothing is copied per GPU.
"""

from __future__ import annotations

from perfmodel import OperatorModel, Target
from perfmodel.base import batch_ratio
from triosim.common import schema
from triosim.common.errors import ConfigError
from triosim.trace.model import Trace
from triosim.trace.precision import Precision, PrecisionOptions


class Extrapolator:
    """Turns the trace into task streams for `gpus`.

    A mode declares its config fields as an `Options` dataclass (triosim.common.schema);
    `options` is one of those or None for the defaults. `batch_size` is the global
    mini-batch (None: the traced one), `gpu` the target GPU (None: the traced one),
    `ring` the GPUs in ring order, `graph` the
    topology (None when unknown) for plans that weigh link speeds, `host` the host model
    (perfmodel.host; None: no host) that gives each Compute its host time and kernel gaps,
    `precision` the dtypes weights are gathered and gradients reduced in
    (triosim.trace.precision; None: the trace's), read by the modes that set
    `uses_precision`, refused by the others.
    Collectives leave the algorithm to the communication model (`collective = None`); a mode may name one to force it.
    """

    name = "abstract"
    Options = schema.NoOptions
    hybrid_inner = False  # can run inside the data-parallel replicas of `hybrid`
    owns_iterations = False  # streams(iterations=K) runs K iterations itself (no barrier)
    uses_trace = True  # False: the mode's workload carries its own times (a config may omit trace)
    collective: str | None = None  # algorithm its collectives ask for (None: the model's)
    # emit ComputeRuns (computes between two other tasks, shared by all GPUs) where the mode
    # supports them; False: one Compute per operator (the straightforward path, for tests)
    compute_runs = True
    uses_precision = False  # reads the precision section (the mesh and its presets)

    def __init__(
        self,
        trace: Trace,
        model: OperatorModel,
        gpus,
        options=None,
        *,
        batch_size: float | None = None,
        gpu: str | None = None,
        ring=None,
        graph=None,
        host=None,
        precision: PrecisionOptions | None = None,
    ):
        self.trace = trace
        if precision is not None and not precision.is_trace and not self.uses_precision:
            raise ConfigError(
                "precision",
                {"params": precision.params, "reduce": precision.reduce},
                f"trace with parallelism.mode {self.name}: it moves no weights or gradients "
                "of its own to gather or reduce in another dtype",
            )
        self.precision = Precision(trace, precision)
        self.host = host  # perfmodel.host.HostModel: what each operator costs its host
        self.graph = graph
        self.model = model
        self.options = schema.check(options, "parallelism") if options else self.Options()
        self.gpus = list(gpus)
        self.ring = tuple(ring) if ring is not None else tuple(self.gpus)
        self.batch_size, self.gpu = batch_size, gpu
        self.graph = graph  # the topology (networkx), for modes that follow its links
        self.batch = batch_size if batch_size is not None else trace.batch_size
        if batch_size is not None and not trace.batch_size and self.uses_trace:
            # (it surfaced later as a per-GPU `batch_size = 2.0`, a value never written)
            raise ConfigError(
                "batch_size",
                batch_size,
                "none, or a trace whose metadata gives its batch size: operator times scale "
                "from the traced batch, which this trace does not say (triosim import "
                "--batch-size N records it)",
            )
        self._times: dict = {}  # target -> {(op id, scale): seconds}, shared by all GPUs
        self.check()

    @classmethod
    def load_options(
        cls, data: dict, where: str, elsewhere: dict, also: tuple = (), owner: str | None = None
    ):
        """This mode's options from the config section's mode-specific fields (`also`: the
        section's common fields, `owner`: whose they are, for messages)."""
        return schema.load(
            cls.Options,
            data,
            where,
            elsewhere=elsewhere,
            owner=owner or f"parallelism mode '{cls.name}'",
            also=also,
        )

    def check(self) -> None:
        """Validate the plan against the trace; raise ConfigError naming the field."""

    def streams(self) -> dict:
        raise NotImplementedError

    def held_weight_bytes(self, gpu) -> float:
        """Bytes of weights (so of gradients) this GPU holds: what data parallelism across
        replicas of this plan must all-reduce for it."""
        w = self.__dict__.get("_weight_bytes")
        if w is None:  # asked once per GPU: sum the trace's weights once
            w = self._weight_bytes = self.trace.weight_bytes()
        return w

    # -- helpers shared by the schedules ----------------------------------------------------
    def target(self, batch=None, tp: int = 1) -> Target:
        return Target(gpu=self.gpu, batch_size=batch, tp=tp)

    def compute(self, op, target: Target, scale: float = 1.0, mb: int = 0, phase=None):
        """The task for `op` at `target`; `phase` overrides the trace's ("recompute")."""
        return self.timed(op, self.seconds(op, target, scale), mb, phase)

    def seconds(self, op, target: Target, scale: float = 1.0) -> float:
        """`op`'s GPU seconds at `target`, times `scale` (kept per target and op)."""
        # the per-target table is looked up by identity first: hashing a Target per task
        # was most of the cost of emitting DDP's streams
        last = getattr(self, "_last_target", None)
        if last is not None and last[0] is target:
            table = last[1]
        else:
            table = self._times.setdefault(target, {})
            self._last_target = (target, table)
        key = (op.id, scale)
        t = table.get(key)
        if t is None:
            t = self.model.time(op, target)
            if op.id in self.precision.fp8:
                t = self._fp8_time(op, target, t)
            t = table[key] = t * scale
        return t

    def _fp8_time(self, op, target: Target, t: float) -> float:
        """A linear's product in FP8 (triosim.trace.precision, `matmul: float8`): its
        bfloat16 time x the GPU's bfloat16 over float8 peak, plus its operand's cast at
        the GPU's memory bandwidth."""
        from perfmodel.features import fp8_cast_bytes
        from triosim.hardware import catalogue

        name = target.gpu or self.trace.metadata.get("gpu")
        g = catalogue.gpu(name) if name else None
        if g is None or "float8" not in g.peak_flops:
            raise ConfigError(
                "precision.matmul",
                "float8",
                f"trace on {name or 'an unnamed GPU'}: it has no float8 peak (Hopper or later)",
            )
        ratio = g.flops_for("bfloat16") / g.flops_for("float8")
        inputs = self.precision.fp8_inputs.get(op.id)
        cast = fp8_cast_bytes(self.trace, op, target, inputs)
        return t * ratio + cast / g.memory_bandwidth

    def timed(self, op, t: float, mb: int = 0, phase=None, part: float = 1.0):
        """The task for `op` taking `t` GPU seconds (from `compute`, or a mode that timed
        it itself); where the host model is on, its kernels' gaps added to its GPU time and
        its host's issue time (the same launches at any batch, TP degree or micro-batch).
        `part`: the share of the op's kernels this task runs (a split backward's B or W:
        its gaps and issue time that share, each part its own sync)."""
        from extrapolators.execution.tasks import Compute

        h = self.host
        if h is None:
            return Compute(op.name, op.layer, phase or op.phase, t, op.id, mb)
        t += h.gap(op, t) * part  # (x 1.0: the same double)
        issue = h.issue(op) * part
        return Compute(op.name, op.layer, phase or op.phase, t, op.id, mb, issue, h.sync(op))

    # -- what the memory model needs -----------------------------------------------------
    def op_batch(self) -> float | None:
        """The batch each GPU's operators process (per GPU, or per micro-batch)."""
        return self.per_gpu_batch(len(self.gpus))

    def activation_ratio(self, op) -> float:
        """Size of `op`'s batch-scaled tensors on a GPU relative to the trace's."""
        return batch_ratio(self.trace, Target(batch_size=self.op_batch()))

    def held_dtypes(self) -> tuple | None:
        """(weights, gradients): the dtypes this layout holds 16-bit weights whole in and
        their gradients ("trace": as the trace stores them) for the memory model's
        `precision: auto`; None where it keeps the weights as the trace stores them."""
        return None

    def buffer_bytes(self, gpu) -> float:
        """Communication buffers this GPU keeps for the whole iteration (DDP buckets)."""
        return 0.0

    def state_fractions(self) -> dict | None:
        """Shares of the held weights' gradients and optimizer states this GPU keeps, when
        they differ from its weights' (ZeRO shards them); None: the same as the weights."""
        return None

    def state_fractions_of(self, gpu) -> dict | None:
        """`state_fractions` for `gpu`: a mode whose shares differ between its GPUs (pipeline
        stages holding different weights) overrides this."""
        return self.state_fractions()

    def per_gpu_batch(self, parts: int, over: str | None = None) -> float | None:
        """The global batch over `parts` (`over`: what they are, for the message)."""
        if self.batch is None:
            if parts == 1:
                return None
            raise ConfigError(
                "batch_size", None, "a batch size (the trace's metadata has none) to split it"
            )
        if self.batch < parts or self.batch % parts:
            raise ConfigError(
                "batch_size",
                self.batch,
                f"a multiple of {parts}, to split it evenly over {over or f'{parts} parts'}",
            )
        return self.batch / parts

    def ops(self, *phases):
        return [op for op in self.trace.operators if op.phase in phases]


def gradient_ready(trace: Trace) -> dict[int, int]:
    """For each weight tensor id, the position (in the trace) of the backward op after which
    its gradient is ready. Uses fwd_id pairing where the trace has it, else the last backward
    op reading the weight; a weight with neither (a bias) is ready with its layer's siblings."""
    weights = {t.id for t in trace.weights()}
    fwd_weights: dict[int, list[int]] = {}
    for op in trace.operators:
        if op.phase == "forward":
            fwd_weights[op.id] = [t for t in op.inputs if t in weights]
    ready: dict[int, int] = {}
    last_bwd = None
    for i, op in enumerate(trace.operators):
        if op.phase != "backward":
            continue
        last_bwd = i
        touched = [t for t in op.inputs + op.outputs if t in weights]
        if op.fwd_id is not None:
            touched += fwd_weights.get(op.fwd_id, [])
        for t in touched:
            ready[t] = max(ready.get(t, -1), i)
    for ws in fwd_weights.values():
        known = [ready[w] for w in ws if w in ready]
        for w in ws:
            if w not in ready and known:
                ready[w] = max(known)
    end = last_bwd if last_bwd is not None else len(trace.operators) - 1
    return {w: ready.get(w, end) for w in weights}
