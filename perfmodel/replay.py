"""Trace replay: the measured time, valid only at the traced setting."""

from __future__ import annotations

from perfmodel.base import OperatorModel, Target, is_traced_setting, register
from triosim.common.errors import ConfigError


@register("trace")
class TraceTime(OperatorModel):
    def time(self, op, target: Target = Target()) -> float:
        if not is_traced_setting(self.trace, target):
            raise ConfigError(
                "perfmodel.kind",
                "trace",
                f"the traced setting only (gpu {self.trace.metadata.get('gpu')!r}, batch "
                f"{self.trace.batch_size}, no tensor parallelism); the plan asks for "
                f"{_setting(target)}. Use 'calibrated', 'roofline' or 'regression' to scale "
                "operators",
            )
        return op.time


def _setting(target: Target) -> str:
    """A target in the config's words: `batch 4 per GPU on H100-SXM, tp 2`."""
    parts = []
    if target.batch_size is not None:
        parts.append(f"batch {target.batch_size:g} per GPU")
    if target.gpu is not None:
        parts.append(f"gpu {target.gpu!r}")
    if target.tp > 1:
        parts.append(f"tensor parallelism {target.tp}")
    return ", ".join(parts) or "another setting"
