"""Groups the NCCL model would analyse alike: a symmetric run's image groups whose analysis
repeats the representatives' GPU for GPU, found without analysing them, so that their plans
are the representatives' plan with the GPUs renamed.

`fingerprints(model, groups)` gives each group a key, equal for two groups of one size when
everything the model's analysis of a group (its groups.GroupAnalysis) reads (groups.py,
system.py, families.py, rings.py) is the same in positions of the group:
- the routes between every ordered pair of its GPUs, each link named by its first
  appearance among the group's routes, with its bandwidth, latency and kind: so the same
  path latencies, bottlenecks, hop counts, network crossings, and the same links shared
  between paths (what a ring's time per byte sums);
- each GPU's links out and in: the node at the other end (a member by position; another
  node by its first appearance among the group's neighbours, with its attributes, and a
  switch with the rank of its name among the group's switches, since NCCL's topology
  picks a rail switch and an NVLS or SHARP switch by name order), each link's bandwidth, latency and kind;
- the server each GPU is in (by first appearance), and the members' order in the graph's
  node index (extra rings over direct links follow it) and in the builder's ring hint (no
  group has a key where a GPU is in the hint twice);
- the bottleneck, latency and hops between the members as the ring search reads them
  (`rings.hop_rows`): where equal-cost paths differ in bandwidth its shortest-path trees
  need not take the routed paths (a review found two servers alike in routes but not in
  what the search saw).
A slower link on an image's route, a missing NVLink, another server layout: another key,
and that group is analysed on its own. What the key does not see (links off the group's
routes and neighbourhood) the analysis does not read; the symmetric runtime still checks
that every image's transfers end when the representatives' do.

`renamed(plan, rep, group)`: the representatives' plan with rep[i] renamed group[i], or
None where a stream touches a node outside the group (NVLS, CollNet), which stays analysed.
"""

from __future__ import annotations

import numpy as np

from extrapolators.communication.rings import _metrics

MAX_SIZE = 16  # groups up to this size are compared (n x (n - 1) routes each)


def fingerprints(model, groups) -> list:
    """One hashable key per group (module docstring); None for a group too large."""
    analysis = model.analysis
    groups = [tuple(g) for g in groups]
    keys: list = [None] * len(groups)
    hint = _hint_positions(analysis.graph)
    todo = [i for i, g in enumerate(groups) if 2 <= len(g) <= MAX_SIZE and len(set(g)) == len(g)]
    if not todo or hint is False:
        return keys
    routes = analysis.routes
    pairs, owner = [], []
    for i in todo:
        g = groups[i]
        pairs += [(a, b) for a in g for b in g if a != b]
        owner.append(len(g) * (len(g) - 1))
    paths = analysis.paths(pairs)
    lens = np.fromiter((len(p) for p in paths), np.int64, count=len(paths))
    flat = np.concatenate(paths).astype(np.int64) if len(paths) else np.zeros(0, np.int64)
    pair_group = np.repeat(np.arange(len(todo)), owner)
    occ_group = np.repeat(pair_group, lens)
    # each link named by its first appearance within its group's routes
    m = len(routes.links) + 1
    uk, first, inv = np.unique(occ_group * m + flat, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(uk), np.int64)
    rank[order] = np.arange(len(uk))
    per = np.bincount(uk // m, minlength=len(todo))
    start = np.cumsum(per) - per
    canon = rank[inv.reshape(-1)] - start[occ_group]
    attr = _link_attr_ids(analysis)[uk[order] % m]  # the links' attributes, in naming order
    pair_end = np.cumsum(owner)
    occ_end = np.cumsum(lens)
    link_end = np.cumsum(per)
    index = routes.node_index
    part = analysis.partition
    rows = getattr(analysis, "_alike_rows", None)
    if rows is None or rows.graph is not analysis.graph:
        rows = analysis._alike_rows = _Rows(analysis.graph)
    for j, i in enumerate(todo):
        g = groups[i]
        p0, p1 = pair_end[j] - owner[j], pair_end[j]
        o0 = occ_end[p0 - 1] if p0 else 0
        o1 = occ_end[p1 - 1] if p1 else 0
        keys[i] = (
            len(g),
            lens[p0:p1].tobytes(),
            canon[o0:o1].tobytes(),
            attr[link_end[j] - per[j] : link_end[j]].tobytes(),
            _neighbourhood(rows, g, part, index, hint),
            _hop_metrics(analysis, g),
        )
    return keys


def renamed(plan, rep: tuple, group: tuple):
    """`plan` (over `rep`) with rep[i] renamed group[i]; None where a stream leaves the group."""
    pos = {g: i for i, g in enumerate(rep)}
    try:
        streams = [(group[pos[a]], group[pos[b]], *rest) for a, b, *rest in plan.streams]
    except KeyError:
        return None
    return type(plan)(
        plan.op,
        plan.algo,
        plan.proto,
        plan.nbytes,
        streams,
        list(plan.path_latency),
        plan.latency,
        plan.fill,
        plan.bandwidth_time,
        plan.channels,
    )


def _link_attr_ids(analysis) -> np.ndarray:
    """Per link of `routes.links`: one integer per distinct (bandwidth, latency, kind)."""
    cached = getattr(analysis, "_alike_attr", None)
    if cached is None:
        seen: dict = {}
        ids = [
            seen.setdefault((d["bandwidth"], d.get("latency", 0.0), d.get("kind")), len(seen))
            for d in analysis.routes.link_data
        ]
        cached = analysis._alike_attr = np.array(ids, np.int64)
    return cached


def _hop_metrics(analysis, group) -> bytes:
    """The bottleneck, latency and hops between the members as NCCL's ring search reads
    them (`rings.hop_rows`: shortest-path trees, a server's or a switch's rows), which
    where equal-cost paths differ in bandwidth need not follow the routed paths."""
    if len(group) < 3:  # two GPUs: one ring, nothing searched
        return b""
    bw, lat, hops = _metrics(analysis.graph, group, analysis.routes)
    return bw.tobytes() + lat.tobytes() + hops.tobytes()


def _hint_positions(graph):
    """Each GPU's place in the builder's ring hint; False where a GPU is in it twice
    (the hinted order then keeps every copy: no group is keyed)."""
    hint = graph.graph.get("ring")
    if not hint:
        return None
    pos = {g: k for k, g in enumerate(hint)}
    return pos if len(pos) == len(hint) else False


class _Rows:
    """Per node, its links out and in as (neighbour, (bandwidth, latency, kind), the
    neighbour's attributes as an id), sorted by what the links are (not by how the graph
    was built), with whether a link ties with another on that; worked out once a model."""

    def __init__(self, graph):
        self.graph = graph
        self.pred = graph.pred if graph.is_directed() else graph.adj
        self.attr_ids: dict = {}  # attributes (a node's server aside) -> id
        self.node_attr: dict = {}  # node -> (id, attributes)
        self.rows: dict = {}

    def attr(self, v) -> tuple:
        got = self.node_attr.get(v)
        if got is None:
            a = tuple(sorted((k, repr(x)) for k, x in self.graph.nodes[v].items() if k != "node"))
            got = self.node_attr[v] = (self.attr_ids.setdefault(a, len(self.attr_ids)), a)
        return got

    def of(self, g) -> tuple:
        got = self.rows.get(g)
        if got is None:
            got = self.rows[g] = tuple(self._row(adj[g]) for adj in (self.graph.adj, self.pred))
        return got

    def _row(self, adj) -> tuple:
        row = sorted(
            ((d.get("bandwidth"), d.get("latency", 0.0), d.get("kind")), self.attr(v)[0], k, v)
            for k, (v, d) in enumerate(adj.items())
        )
        keys = [(e, a) for e, a, _k, _v in row]
        ties = len(set(keys)) < len(keys)
        return tuple((v, e, a) for e, a, _k, v in row), ties


def _neighbourhood(rows: _Rows, group, part, index, hint) -> tuple:
    """The members' links in and out, servers and orders, in positions (module docstring)."""
    at = {g: i for i, g in enumerate(group)}
    others: dict = {}  # a non-member neighbour -> its first appearance
    links = []
    for g in group:
        for way, (row, ties) in enumerate(rows.of(g)):
            if ties:  # links alike: members first, by position, then the others as listed
                row = sorted(row, key=lambda x: (x[1], x[2], x[0] not in at, at.get(x[0], -1)))
            links.append(
                tuple(
                    (way, ("m", at[v]) if v in at else ("o", others.setdefault(v, len(others)))) + e
                    for v, e, _a in row
                )
            )
    # switches by name: NCCL's topology picks a rail, NVLS or SHARP switch by name order
    nodes = rows.graph.nodes
    names = sorted((v for v in others if nodes[v].get("kind") == "switch"), key=str)
    rank = {v: k for k, v in enumerate(names)}
    node_data = tuple((others[v], rank.get(v), rows.attr(v)[0]) for v in others)
    servers: dict = {}
    server = tuple(servers.setdefault(part.get(g), len(servers)) for g in group)
    by_index = tuple(sorted(range(len(group)), key=lambda i: index[group[i]]))
    in_hint = None
    if hint is not None:
        if all(g in hint for g in group):
            in_hint = tuple(sorted(range(len(group)), key=lambda i: hint[group[i]]))
    return (tuple(links), node_data, server, by_index, in_hint)
