"""Roofline model: max(FLOPs / peak FLOP/s, bytes / memory bandwidth) / efficiency.

The peak is the one of the units that run the operator (perfmodel.units): for a matrix
product, convolution or attention, its math mode's (`op.math`: "tf32" for a float32
convolution that cuDNN ran on tensor cores, "float32" for a matrix product with TF32 off: the
CUDA cores), else of the trace's dtype; any other operator runs on the CUDA cores. The efficiency of
each operator kind (name) is fitted on a trace from one GPU as total roof time / total
measured time, so the kinds' traced totals are reproduced on the traced GPU and the same
trace predicts any GPU in the hardware catalogue. An efficiency above 1 (the measured time
beats the roof: a wrong math mode, FLOP count or peak) is kept, not capped, and listed in
`report["efficiency_above_peak"]`. On the traced GPU at the traced batch (unsharded) a real
trace's operators take their measured times (identity; `identity: false` turns it off), so
operators the per-kind totals smear (a view that took no time, a small kernel among large
ones of its name) are not moved there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfmodel.base import OperatorModel, Target, identity_time, op_features, register
from perfmodel.kinds import op_kind
from perfmodel.units import compute_peak
from triosim.common.errors import ConfigError
from triosim.common.schema import option
from triosim.hardware import catalogue as hardware


@dataclass(frozen=True)
class RooflineOptions:
    source_gpu: str | None = option(
        None, help="the GPU the trace was taken on (default: the trace's metadata)"
    )
    dtype: str | None = option(None, help="data type of the peak FLOP/s (default: the trace's)")
    identity: bool = option(
        True, help="on the traced GPU at the traced batch, the trace's measured times"
    )


@register("roofline")
class Roofline(OperatorModel):
    Options = RooflineOptions

    def __init__(
        self, trace, source_gpu: str | None = None, dtype: str | None = None, identity=True
    ):
        super().__init__(trace)
        self.identity = bool(identity)
        name = source_gpu or trace.metadata.get("gpu")
        if not name:
            raise ConfigError(
                "perfmodel.source_gpu",
                None,
                "the GPU the trace was taken on (the trace metadata has none)",
            )
        try:
            self.source = hardware.gpu(name)
        except ConfigError:
            whose = "perfmodel.source_gpu" if source_gpu else "the trace's gpu (metadata)"
            raise ConfigError(
                "perfmodel.source_gpu",
                name,
                f"a GPU of the catalogue "
                f"({', '.join(hardware.GPUS)}); {whose} names one it does not "
                "know: set perfmodel.source_gpu to the closest one",
            ) from None
        self.dtype = dtype or trace.metadata.get("dtype", "float32")
        sums: dict[str, np.ndarray] = {}
        for op in trace.operators:
            roof = self.roof(op, self.source, Target())
            if op.time > 0 and roof > 0:
                sums.setdefault(op.name, np.zeros(2))[:] += (roof, op.time)
        total = sum(sums.values(), np.zeros(2))
        self.default_efficiency = float(total[0] / total[1]) if total[1] > 0 else 1.0
        self.efficiency = {k: float(r / t) for k, (r, t) in sums.items()}
        self.report = self._report()

    def _report(self) -> dict:
        above = {k: e for k, e in self.efficiency.items() if e > 1.0}
        return {"efficiency_above_peak": above} if above else {}

    def math(self, op) -> str:
        return op.math or self.dtype

    def roof(self, op, gpu: hardware.GPU, target: Target) -> float:
        flops, nbytes = op_features(self.trace, op, target)
        peak = compute_peak(gpu, op_kind(op)[0], self.math(op))
        return max(flops / peak, nbytes / gpu.memory_bandwidth)

    def check_target(self, gpu) -> None:
        if gpu is not None:
            hardware.gpu(gpu)  # any catalogue GPU

    def time(self, op, target: Target = Target()) -> float:
        if self.identity:
            same = identity_time(self.trace, op, target, self.source.name)
            if same is not None:
                return same
        gpu = hardware.gpu(target.gpu) if target.gpu else self.source
        eff = self.efficiency.get(op.name, self.default_efficiency)
        return self.roof(op, gpu, target) / eff

    def save(self, path):
        import json
        from pathlib import Path

        doc = {
            "kind": "roofline",
            "source_gpu": self.source.name,
            "dtype": self.dtype,
            "identity": self.identity,
            "default_efficiency": self.default_efficiency,
            "efficiency": self.efficiency,
        }
        Path(path).write_text(json.dumps(doc))
        return Path(path)

    @classmethod
    def load(cls, path, trace) -> Roofline:
        import json
        from pathlib import Path

        doc = json.loads(Path(path).read_text())
        if doc.get("kind") != "roofline":
            raise ConfigError("perfmodel file", str(path), "a file written by Roofline.save")
        self = cls.__new__(cls)
        OperatorModel.__init__(self, trace)
        self.source = hardware.gpu(doc["source_gpu"])
        self.dtype = doc["dtype"]
        self.identity = bool(doc.get("identity", True))
        self.default_efficiency = float(doc["default_efficiency"])
        self.efficiency = {k: float(v) for k, v in doc["efficiency"].items()}
        self.report = self._report()
        return self
