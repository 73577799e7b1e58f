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
                f"{self.trace.batch_size}, no tensor parallelism); got {target}. Use 'regression' "
                "or 'roofline' to scale operators",
            )
        return op.time
