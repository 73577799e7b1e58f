"""The parallelism modes, registered by the name a config gives as `parallelism.mode`.

A mode is a subclass of `Extrapolator` (base.py) with a unique `name`; add one with
`register(cls)`. Each mode turns the trace and its plan into per-GPU task streams for the
runtime (extrapolators.execution) and asks the communication model for its collectives.
`mesh` (mesh/) is the general form: a device mesh of pp x dp_replicate x dp_shard x cp x
tp, with the expert mesh ep x etp folded out of it; single, dp, ddp, fsdp, tp, gpipe, 1f1b,
hybrid, 3d, interleaved, cp and ep are its presets (mesh/presets.py). hop and chakra are
their own.
"""

from extrapolators.modes.base import Extrapolator, gradient_ready
from extrapolators.modes.chakra import ChakraWorkload
from extrapolators.modes.hop import Hop
from extrapolators.modes.mesh import MeshMode
from extrapolators.modes.mesh.presets import (
    PRESETS,
    ContextParallel,
    DataParallel,
    DistributedDataParallel,
    ExpertParallel,
    GPipe,
    Hybrid,
    Interleaved,
    OneFOneB,
    Sharded,
    Single,
    TensorParallel,
    ThreeD,
)
from triosim.common.registry import Registry

EXTRAPOLATORS = Registry("parallelism.mode", "name", "parallelism mode")
for _cls in (*PRESETS, MeshMode, Hop, ChakraWorkload):
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
    "MeshMode",
    "OneFOneB",
    "Sharded",
    "Single",
    "TensorParallel",
    "ThreeD",
    "extrapolator_class",
    "gradient_ready",
    "register",
]
