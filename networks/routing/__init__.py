"""Routes through a topology: which links a transfer from one node to another crosses.

`routes.py` holds the rule (its docstring) and `Routes`, put together from objects, a
module each, each owning one concern and its state: `graph.py` (`RouteGraph`: the topology
as arrays, packed link weights), `rows.py` (`RouteRows`: distance rows), `servers.py`
(`RouteServers`: what lies inside one server, searched there), `spreads.py`
(`RouteSpreads`: a big switch's shared hops), `reads.py` (`RouteReads`: which rows a batch
of pairs reads), `walks.py` (`RouteWalks`: the walk that picks the links); `tuning.py`
holds memory budgets and thresholds, none of which changes a result.
"""

from networks.routing.graph import link_weight
from networks.routing.routes import LINK_KINDS, Routes, path_latencies

__all__ = ["LINK_KINDS", "Routes", "link_weight", "path_latencies"]
