"""The flow-based packet-switched network (`PacketSwitchNetwork`, network kind 'packet').

`network.py` holds the network and its fast engine's clock and says how the pieces fit;
the pieces are mixins, one concern each: `reference.py` (the reference engine), `table.py`
(the flow table), `solve.py` and `above.py` (the incremental max-min solve), `checks.py`,
`landing.py` (delivery on arrival), `ringjobs.py` and `ringjob.py` (a ring collective on
free links as one reserved job).
"""

from networks.packet.network import PacketOptions, PacketSwitchNetwork

__all__ = ["PacketOptions", "PacketSwitchNetwork"]
