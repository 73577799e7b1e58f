"""The communication model: how a collective becomes transfers on the network.

`base.py` holds the contract (`CommModel`) and the registry keyed by the name a config
gives as `communication.kind`; `collectives.py` the textbook algorithms, `rings.py` ring
orders, `nccl/` NCCL's own choices (its tuner, system analysis, layouts and streams).
"""

from extrapolators.communication.base import COMM_MODELS, CommModel, comm_class
from extrapolators.communication.nccl import model as _nccl  # noqa: F401  (registers 'nccl')

__all__ = ["COMM_MODELS", "CommModel", "comm_class"]
