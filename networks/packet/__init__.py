"""The flow-based packet-switched network (`PacketSwitchNetwork`, network kind 'packet').

`network.py` holds the network (its links, routes and counters) and says how the pieces
fit; the pieces are objects, one concern each, a module each: `reference.py` (the
reference engine), `engine.py` (the fast engine's clock, holding the rest), `table.py`
(the flow table), `landing.py` (delivery on arrival), `solve.py` and `above.py` (the
incremental max-min solve), `checks.py` (whole-table checks of it), `ringjobs.py` and
`ringjob.py` (a ring collective on free links as one reserved job), `groupjobs.py` (a
transfer group alone on its links as one reserved job).
"""

from networks.packet.network import PacketOptions, PacketSwitchNetwork

__all__ = ["PacketOptions", "PacketSwitchNetwork"]
