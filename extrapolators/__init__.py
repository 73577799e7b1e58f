"""Extrapolators: a single-GPU trace and a parallel plan become per-GPU task streams."""

from extrapolators import nccl  # noqa: F401  (registers the 'nccl' communication model)
from extrapolators.base import Extrapolator, gradient_ready
from extrapolators.communication import COMM_MODELS, CommModel, comm_class
from extrapolators.data_parallel import DataParallel, DistributedDataParallel, Single
from extrapolators.hop import Hop
from extrapolators.hybrid import Hybrid
from extrapolators.pipeline import GPipe, OneFOneB
from extrapolators.runtime import Runtime
from extrapolators.sharded import Sharded
from extrapolators.tensor_parallel import TensorParallel
from extrapolators.threed import Interleaved, ThreeD
from triosim.registry import Registry

EXTRAPOLATORS = Registry("parallelism.mode", "name", "parallelism mode")
for _cls in (
    Single,
    DataParallel,
    DistributedDataParallel,
    TensorParallel,
    GPipe,
    OneFOneB,
    Hybrid,
    Hop,
    Sharded,
    ThreeD,
    Interleaved,
):
    EXTRAPOLATORS.register(_cls.name)(_cls)


def register(cls: type[Extrapolator], *, replace: bool = False) -> type[Extrapolator]:
    """Add a parallelism mode: a subclass of Extrapolator with a unique `name`."""
    return EXTRAPOLATORS.register(cls.name, cls, replace=replace)


extrapolator_class = EXTRAPOLATORS.get

__all__ = ["COMM_MODELS", "CommModel", "EXTRAPOLATORS", "Extrapolator", "Runtime", "Sharded",
           "comm_class", "extrapolator_class", "gradient_ready", "register"]  # fmt: skip
