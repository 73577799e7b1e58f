"""The memory budgets and thresholds of the route search (networks.routing).

None of them changes a result: each decides only how an answer is found (which distance
rows stay in memory, how many in-links are weighed at once, when a big switch's spread or
a lookup by value is used), and the paths, trees and hop rows are the same, bit for bit,
whatever their values. The tests set them to extremes to take every way through the code
(tests/test_route_speedups.py). The route modules read them here at each call
(`tuning.HUB_ROWS_BYTES`, not a copy taken at import), so setting one here takes effect.
"""

# memory for shared rows of switches (see rows): a 16,384-GPU rail cluster's 2,056
# switch rows over its 18,448 nodes take 303 MB; at 256 MB a few hundred were searched again
# per walk
HUB_ROWS_BYTES = 2**29
# hubs (switches that are their GPUs' only way out) each serving at least this many nodes on
# average share their rows even when the rows do not all fit in HUB_ROWS_BYTES
HUB_SHARED = 16
CANDIDATES = 2**20  # in-links weighed at once when paths are walked in a batch
# a hub with more out-links than this serves its GPUs' hop metrics from one shared spread
# (a search from a GPU under a big switch relaxes every link of it: O(N) per GPU on a star)
SPREAD_DEGREE = 256
# hop metrics asked from this many sources at once take spreads of switches of any size
# (the sources under a switch share its spread, kept within HUB_ROWS_BYTES)
SPREAD_SOURCES = 8
SPREAD_LEVELS = 64  # a spread deeper than this (hops) is left to the per-source trees
# a walk looks a node's candidates up by value (not a scan of its in-links) when it has
# more than BIG_IN in-links and at least SHARED_ASKS walkers ask it with one row (a rail's
# leaf, asked by every GPU of the rail; a fat tree's hub rows are asked once each)
BIG_IN = 64
# a server (nodes joined without network links) of at most this many nodes answers its
# GPUs' hop metrics from a search of its own nodes (servers.py), not trees of the machine
SERVER_NODES = 256
SHARED_ASKS = 8
