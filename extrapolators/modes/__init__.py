"""The parallelism modes, registered by the name a config gives as `parallelism.mode`.

A mode is a subclass of `Extrapolator` (base.py) with a unique `name`; add one with
`register(cls)`. Each mode turns the trace and its plan into per-GPU task streams for the
runtime (extrapolators.execution) and asks the communication model for its collectives.
"""

from extrapolators.modes.base import Extrapolator, gradient_ready
from extrapolators.modes.chakra import ChakraWorkload
from extrapolators.modes.context_parallel import ContextParallel
from extrapolators.modes.data_parallel import DataParallel, DistributedDataParallel, Single
from extrapolators.modes.expert_parallel import ExpertParallel
from extrapolators.modes.hop import Hop
from extrapolators.modes.hybrid import Hybrid
from extrapolators.modes.pipeline import GPipe, OneFOneB
from extrapolators.modes.sharded import Sharded
from extrapolators.modes.tensor_parallel import TensorParallel
from extrapolators.modes.threed import Interleaved, ThreeD
from triosim.common.registry import Registry

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
    ChakraWorkload,
    ContextParallel,
    ExpertParallel,
):
    EXTRAPOLATORS.register(_cls.name)(_cls)


def register(cls: type[Extrapolator], *, replace: bool = False) -> type[Extrapolator]:
    """Add a parallelism mode: a subclass of Extrapolator with a unique `name`."""
    return EXTRAPOLATORS.register(cls.name, cls, replace=replace)


extrapolator_class = EXTRAPOLATORS.get

__all__ = [
    "EXTRAPOLATORS",
    "ChakraWorkload",
    "ContextParallel",
    "DataParallel",
    "DistributedDataParallel",
    "ExpertParallel",
    "Extrapolator",
    "GPipe",
    "Hop",
    "Hybrid",
    "Interleaved",
    "OneFOneB",
    "Sharded",
    "Single",
    "TensorParallel",
    "ThreeD",
    "extrapolator_class",
    "gradient_ready",
    "register",
]
