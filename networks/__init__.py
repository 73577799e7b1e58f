"""Moving bytes between GPUs inside a simpy.Environment, and the topologies they cross."""

from networks.base import LINK_COLUMNS, NETWORKS, Network, TransferRecord, network_class, register
from networks.packet import PacketSwitchNetwork
from networks.photonic import PhotonicNetwork

__all__ = [
    "LINK_COLUMNS",
    "NETWORKS",
    "Network",
    "PacketSwitchNetwork",
    "PhotonicNetwork",
    "TransferRecord",
    "network_class",
    "register",
]
