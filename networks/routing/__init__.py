"""Routes through a topology: which links a transfer from one node to another crosses.

`routes.py` holds the rule (its docstring) and `Routes`, put together in layers, a module
each, each relying only on the ones below: `graph.py` (the topology as arrays, packed link
weights), `rows.py` (distance rows), `spreads.py` (a big switch's shared hops),
`reads.py` (which rows a batch of pairs reads), `walks.py` (the walk that picks the links);
`tuning.py` holds memory budgets and thresholds, none of which changes a result.
"""

from networks.routing.graph import link_weight
from networks.routing.routes import LINK_KINDS, Routes, path_latencies

__all__ = ["LINK_KINDS", "Routes", "link_weight", "path_latencies"]
