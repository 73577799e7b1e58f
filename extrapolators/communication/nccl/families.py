"""A group's candidate layouts for the NCCL model (extrapolators.communication.nccl.model), built and ranked.

`make(analysis, group, system)` gives the group's Family: for a group of up to
layouts.EXACT_LIMIT GPUs whose hops differ (in one node, or across nodes without a NIC
per GPU), every ring order and every prefix of its extra rings, ranked by their features
(extrapolators.communication.nccl.layouts); across nodes with a NIC per GPU, every order of up to
MAX_NODE_ORDERS nodes; otherwise the system's rings and their prefixes (in one node) from
the few orders the system weighed. None of these sets depends on the links' bandwidths.
`candidates(fam, op, root, pairs)` are the layouts that can give a call its least time,
which the model then times with its own code (its analysis of a layout is the contract:
a layout is (rings, both-ways flags[, a System of its own]), in GPUs or, where
`positions`, in positions of the group).

`analysis` is the model's groups.GroupAnalysis: its pair data (`pair_arrays`, `paths`,
`both_ways`), the links' capacities as they are and as NCCL believes them, and the graph.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from itertools import permutations

import numpy as np

from extrapolators.communication.nccl import layouts
from extrapolators.communication.nccl.system import MAX_EXTRA_RINGS, System
from triosim.hardware import nccl_constants as P

MAX_NODE_ORDERS = 5  # groups on up to this many nodes time every order of their nodes


@dataclass
class Family:
    """A group's candidate layouts (extrapolators.communication.nccl.layouts): each as (rings, both-ways
    flags[, its own System]), the features that rank them, and those analysed so far
    (layout -> _Group)."""

    system: System
    layouts: list
    feats: layouts.Features | None
    default: int = 0
    positions: bool = False  # layouts name positions in the group, not GPUs
    infos: dict = field(default_factory=dict)
    fronts: dict = field(default_factory=dict)


def make(analysis, group, s: System, rings=None) -> Family:
    """Candidate layouts: every ring order (and prefixes of its extra rings) where the
    group is small, in one node and its hops differ; else the system's rings and, in
    one node, their prefixes."""
    n = s.n
    one_ring = s.N == 1 or s.rails == 1 or not s.uniform  # System.rings: [order]
    if one_ring and 3 <= n <= layouts.EXACT_LIMIT and s.alike is False:
        return _exhaustive(analysis, group, s)
    rings = rings if rings is not None else s.rings()
    if s.N > 1:  # rails: every order of the nodes, where they are few
        systems = [s] + (_node_orders(s) if s.N <= MAX_NODE_ORDERS else [])
        cands = []
        for x in systems:
            r = rings if x is s else x.rings()
            cands.append((r, [analysis.both_ways(y) for y in r], x))
        return Family(s, cands, None)
    cands = []
    for order in s.orders:  # the system's order first: the default
        more = [list(order)] + s._extra_rings(list(order)) if order != s.order else rings
        both = [analysis.both_ways(r) for r in more]
        cands += [(more[:k], both[:k]) for k in range(len(more), 0, -1)]
    return Family(s, cands, None)


def _node_orders(s: System) -> list:
    """The system with its nodes in every other order (the first node first)."""
    out = []
    for perm in permutations(range(1, s.N)):
        if list(perm) == sorted(perm):
            continue  # the system's own order
        x = copy.copy(s)
        order = [0, *perm]
        x.nodes = [s.nodes[i] for i in order]
        x.nvls = [s.nvls[i] for i in order] if s.nvls else s.nvls
        out.append(x)
    return out


def _exhaustive(analysis, group, s: System) -> Family:
    n = s.n
    pairs = [(a, b) for a in group for b in group if a != b]
    lat, net, _cap, nh = analysis.pair_arrays(pairs)
    paths = analysis.paths(pairs)
    full = np.full((n, n), -1, np.int64)
    full[~np.eye(n, dtype=bool)] = np.arange(len(pairs))
    used = np.unique(np.concatenate(paths)) if pairs else np.zeros(0, np.int64)
    col = np.searchsorted(used, np.concatenate(paths))
    rows = np.zeros((n * n, len(used)))
    at = np.repeat(np.flatnonzero(full.ravel() >= 0), [len(p) for p in paths])
    np.add.at(rows, (at, col), 1.0)
    hops = np.zeros((n, n), np.int64)
    hops[full >= 0] = nh
    pair_lat = np.zeros(n * n)
    pair_net = np.zeros(n * n, bool)
    pair_lat[full.ravel() >= 0] = lat
    pair_net[full.ravel() >= 0] = net

    adj = [set() for _ in range(n)]
    if n <= 64:  # direct links both ways between the group's GPUs (extra rings)
        pos = {g: i for i, g in enumerate(group)}
        for i, u in enumerate(group):
            for v in analysis.graph.adj[u]:
                if v in pos and v != u and analysis.graph.has_edge(v, u):
                    adj[i].add(pos[v])
    shares = layouts.structure(hops, adj, MAX_EXTRA_RINGS)
    cands = shares.layouts
    feats = layouts.Features(
        shares,
        rows,
        analysis.capacity[used],
        (analysis.capacity * analysis.efficiency)[used],
        pair_lat,
        pair_net,
    )
    # the default: least loaded, then least latency and fewest hops on the first ring
    first = shares.first
    nxt = np.roll(first, -1, axis=1)
    lat_sum = pair_lat[first * n + nxt].sum(axis=1)
    hop_sum = hops[first, nxt].sum(axis=1)
    default = int(np.lexsort((np.arange(len(cands)), hop_sum, lat_sum, feats.eff))[0])
    return Family(s, cands, feats, default, positions=True)


def candidates(fam: Family, op, root, pairs) -> list:
    """The layouts that can give a call its least time: all of a small family, else
    for each pair the Pareto front of the features its time grows with."""
    if fam.feats is None or len(fam.layouts) <= 4:
        return list(range(len(fam.layouts)))
    out: dict = {}
    for algo, proto in pairs:
        key = _front_key(fam, op, algo, proto, root)
        if key is None:
            out[fam.default] = None  # the layouts do not differ for this pair
            continue
        front = fam.fronts.get(key)
        if front is None:
            front = fam.fronts[key] = _front(fam, *key)
        out.update(dict.fromkeys(front))
    return list(out)


def _front_key(fam: Family, op, algo, proto, root):
    """(structure, algorithm whose per-hop latency counts, protocol, ring steps)."""
    n = fam.system.n
    if algo == "ring" and op in ("allreduce", "all_gather", "reduce_scatter"):
        return ("ring", "ring", proto, 2 * (n - 1) if op == "allreduce" else n - 1)
    if op in ("broadcast", "reduce"):
        group = fam.system.group
        pos = group.index(root) if root in group else 0
        return ((("bcast" if op == "broadcast" else "reduce"), pos), "ring", proto, 0)
    if algo == "tree" and fam.system.N == 1:
        return ("tree", "tree", proto, 0)
    return None


def _front(fam: Family, struct, algo, proto, steps) -> list:
    f = fam.feats
    p = P.PROTOS.index(proto)
    hw = fam.system.intra_hw
    ex = f.excess(P.HW_LAT[hw][algo][p] * 1e-6, P.HW_LAT["net"][algo][p] * 1e-6)
    extra = f.ring_extra(ex, steps) if struct == "ring" else f.stream_extra(struct, ex)
    return layouts.pareto(f.eff, f.raw(struct), extra)
