"""The operator-model interface and the sizes of an operator at a target setting.

`OperatorModel.time(op, target) -> seconds`. A Target names the GPU, the batch size
(per GPU, or per micro-batch) and the tensor-parallel degree applied to this operator.
Weights, their gradients, optimizer states and buffers keep their size when the batch
changes; inputs and activations scale with it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from triosim.common import schema
from triosim.common.errors import ConfigError
from triosim.common.registry import Registry
from triosim.trace.model import Operator, Trace


@dataclass(frozen=True)
class Target:
    gpu: str | None = None  # None: the GPU the trace was taken on
    batch_size: float | None = None  # None: the traced batch size
    tp: int = 1  # tensor-parallel degree for a splittable operator


def batch_ratio(trace: Trace, target: Target) -> float:
    if target.batch_size is None:
        return 1.0
    if not trace.batch_size:
        raise ConfigError(
            "batch_size",
            target.batch_size,
            "the trace's metadata must give its batch_size to scale it",
        )
    return float(target.batch_size) / float(trace.batch_size)


def scales_with_batch(trace: Trace, op: Operator) -> bool:
    return any(trace.tensors[t].scales_with_batch for t in op.inputs + op.outputs)


def op_features(trace: Trace, op: Operator, target: Target = Target()) -> tuple[float, float]:
    """(FLOPs, bytes moved) of `op` at the target; FLOPs are 0 when the trace does not know them."""
    r = batch_ratio(trace, target)
    shard = target.tp if op.tp_split else 1
    nbytes = 0.0
    for tid in set(op.inputs) | set(op.outputs):
        t = trace.tensors[tid]
        nbytes += t.nbytes * (r if t.scales_with_batch else 1.0 / shard)
    flops = op.flops or 0.0
    if flops and scales_with_batch(trace, op):
        flops *= r
    return flops / shard, nbytes


def is_traced_setting(trace: Trace, target: Target, gpu: str | None = None) -> bool:
    """Whether `target` is the setting the trace was taken at: its GPU (`gpu`, else the
    trace's; a catalogue alias counts as the same GPU), its batch size, no TP sharding."""
    traced = gpu or trace.metadata.get("gpu")
    on_it = target.gpu is None or target.gpu == traced or same_gpu(target.gpu, traced or "")
    same_batch = target.batch_size is None or target.batch_size == trace.batch_size
    return on_it and same_batch and target.tp == 1


def has_measured_times(trace: Trace) -> bool:
    """Whether the operators' times were measured (a real trace), not modelled (a shape-only
    trace, or one timed by a performance model)."""
    m = trace.metadata
    return not (m.get("modelled") or m.get("shapes_only"))


def identity_time(trace: Trace, op: Operator, target: Target, gpu: str | None = None):
    """The operator's measured time where a fitted model must give it back (a real trace, on
    its own GPU, at its own batch, unsharded); None elsewhere."""
    if has_measured_times(trace) and is_traced_setting(trace, target, gpu):
        return op.time
    return None


class OperatorModel:
    """Base class: the time of one operator on the target GPU at the target size."""

    name = "abstract"
    Options = schema.NoOptions  # config fields (triosim.common.schema); the constructor's keywords

    def __init__(self, trace: Trace):
        self.trace = trace

    @classmethod
    def from_config(cls, trace: Trace, options, load_trace) -> OperatorModel:
        """Build from validated options; `load_trace(path)` reads a trace a config names."""
        return cls(trace, **schema.dump(options))

    def time(self, op: Operator, target: Target = Target()) -> float:
        raise NotImplementedError

    def view(self, trace: Trace) -> OperatorModel:
        """This model with its settings timing `trace`, a view of its own (the same
        operators over other tensors: one GPU's shard of some weights). A view is not the
        traced run, so no operator keeps its measured time (identity off), and nothing
        timed on this model's trace carries over (a model that caches times per operator
        clears them in `_fresh`)."""
        m = copy.copy(self)
        m.trace = trace
        if getattr(m, "identity", False):
            m.identity = False
        m._fresh()
        return m

    def _fresh(self) -> None:
        """Drop what was computed from the trace (view); nothing by default."""

    def check_target(self, gpu: str | None) -> None:
        """Raise ConfigError, before a run, if this model cannot time operators on `gpu`."""
        traced = self.trace.metadata.get("gpu")
        if gpu is None or (traced and same_gpu(gpu, traced)):
            return
        if not traced:
            raise ConfigError(
                "gpu",
                gpu,
                f"the traced GPU for perfmodel '{self.name}': this "
                "trace does not say which GPU it was taken on (record it with "
                "`triosim import --gpu NAME`, or use perfmodel 'roofline' with "
                "source_gpu)",
            )
        raise ConfigError(
            "gpu",
            gpu,
            f"the traced GPU ({traced}) for perfmodel '{self.name}'; "
            "use 'learned' or 'roofline' to predict another GPU",
        )

    def iteration_time(self, target: Target = Target()) -> float:
        """Sum of operator times: a single-GPU iteration at the target."""
        return sum(self.time(op, target) for op in self.trace.operators)


class CatalogueGPUModel(OperatorModel):
    """A model that times operators on a catalogue GPU: the target's, else the one the trace
    was taken on; a CPU or unnamed GPU is a ConfigError naming `gpu` and `gpu_needed`."""

    gpu_needed = "a catalogue GPU to time the operators on"

    def _gpu(self, name: str | None):
        from triosim.hardware import catalogue as hardware

        name = name or self.trace.metadata.get("gpu")
        if not name or name == "cpu":
            raise ConfigError("gpu", name, self.gpu_needed)
        return hardware.gpu(name)

    def check_target(self, gpu) -> None:
        self._gpu(gpu)


def same_gpu(a: str, b: str) -> bool:
    from triosim.hardware import catalogue as hardware

    try:
        return hardware.gpu(a).name == hardware.gpu(b).name
    except ConfigError:
        return a == b


MODELS = Registry("perfmodel.kind", "name", "performance model")
register = MODELS.register
model_class = MODELS.get
