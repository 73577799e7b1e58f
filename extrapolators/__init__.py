"""Extrapolators: a single-GPU trace and a parallel plan become per-GPU task streams."""

from extrapolators.base import Extrapolator, Plan, gradient_ready
from extrapolators.data_parallel import DataParallel, DistributedDataParallel, Single
from extrapolators.pipeline import GPipe, OneFOneB
from extrapolators.runtime import Runtime
from extrapolators.tensor_parallel import TensorParallel
from triosim.errors import ConfigError

EXTRAPOLATORS: dict[str, type[Extrapolator]] = {
    cls.name: cls
    for cls in (Single, DataParallel, DistributedDataParallel, TensorParallel, GPipe, OneFOneB)
}


def register(cls: type[Extrapolator]) -> type[Extrapolator]:
    EXTRAPOLATORS[cls.name] = cls
    return cls


def extrapolator_class(mode: str) -> type[Extrapolator]:
    if mode not in EXTRAPOLATORS:
        raise ConfigError("parallelism.mode", mode, f"one of {', '.join(sorted(EXTRAPOLATORS))}")
    return EXTRAPOLATORS[mode]


__all__ = ["EXTRAPOLATORS", "Extrapolator", "Plan", "Runtime", "extrapolator_class",
           "gradient_ready", "register"]  # fmt: skip
