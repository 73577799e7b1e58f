"""What a group of GPUs runs on, as NCCL's topology search sees it, and the rings and trees
NCCL builds over it.

`System(graph, group)` finds the group's nodes (GPUs joined without crossing the inter-node
fabric: the `node` attribute where a builder set it), the rails (GPU i of every node with
its own NIC), the kind of the intra-node links, and the switches that can reduce (NVLS on
each node's NVSwitch, SHARP on each rail's network switch).

The structures it builds are lists of (src, dst, share) hops, `share` the fraction of the
operation's bytes that hop carries:
* rings: on one node, the bandwidth-ordered ring (extrapolators.communication.rings) plus rings over
  links the first leaves unused (a fully connected or hybrid-cube-mesh system); on several
  nodes, one ring per rail: ring c enters and leaves every node on the same rail, so every
  NIC carries one ring per direction (NCCL's one channel per NIC). Every ring runs both ways.
* trees: on one node a chain (two, one each way); on several nodes, per rail, a chain in
  every node ending at the rail's GPU and a double binary tree between nodes (two
  complementary trees, each carrying half).
"""

from __future__ import annotations

import networkx as nx

from extrapolators.communication.rings import order_and_alike
from networks.routing import Routes

MAX_EXTRA_RINGS = 7  # rings beyond the first on direct-connect systems (NCCL: 16 channels)


def node_partition(graph) -> dict:
    """GPU -> node id: the builder's `node` attribute, else the components of the graph
    without its inter-node ('net') links."""
    gpus = [n for n, d in graph.nodes(data=True) if d.get("kind", "gpu") == "gpu"]
    if all("node" in graph.nodes[g] for g in gpus):
        return {g: graph.nodes[g]["node"] for g in gpus}
    local = nx.Graph()
    local.add_nodes_from(graph.nodes)
    local.add_edges_from((u, v) for u, v, d in graph.edges(data=True) if d.get("kind") != "net")
    out = {}
    for k, comp in enumerate(
        sorted(nx.connected_components(local), key=lambda c: min(map(str, c)))
    ):
        for g in comp:
            if g in graph.nodes and graph.nodes[g].get("kind", "gpu") == "gpu":
                out[g] = k
    return out


class System:
    def __init__(
        self,
        graph,
        group,
        routes: Routes | None = None,
        partition=None,
        capacity=None,
        exact: bool = True,
    ):
        self.graph = graph
        self.group = tuple(group)
        self.n = len(self.group)
        self.routes = routes or Routes(graph)
        self._switches: dict = {}  # GPU -> [(switch it links to, over a network link)]
        part = partition if partition is not None else node_partition(graph)
        by_node: dict = {}
        for g in self.group:
            by_node.setdefault(part[g], []).append(g)
        # the ring as NCCL's search weighs it (`order`, `alike`, `orders`): searched when
        # first read (`__getattr__`), with `capacity` per link of `routes.links`, what NCCL
        # believes each link carries (default: the links' bandwidths); a send/receive
        # schedule never reads them (an all-to-all's pairs take no ring)
        self._search = (capacity, exact)
        # a node's GPUs by the network switch they hang on, so local GPU i of every node
        # is on rail i, then in the group's order; nodes in the group's order. Neither
        # follows the links' bandwidths (the NCCL model times every node order where
        # they are few: extrapolators.communication.nccl.model)
        at = {g: i for i, g in enumerate(self.group)}
        self.nodes = [
            sorted(v, key=lambda g: (self._rail_switch(g), at[g])) for v in by_node.values()
        ]
        self.N = len(self.nodes)
        self.ppn = max(len(v) for v in self.nodes)
        self.uniform = all(len(v) == self.ppn for v in self.nodes)
        # the kinds of the links touching the group (its GPUs' in- and out-links, not a
        # scan of every link: O(groups x links) with thousands of TP groups)
        pred = graph.pred if graph.is_directed() else graph.adj
        kinds = {
            d.get("kind", "nvlink")
            for g in self.group
            for adj in (graph.adj, pred)
            for d in adj[g].values()
            if d.get("kind") != "net"
        }
        self.intra_hw = "pcie" if "pcie" in kinds else "nvlink"
        self.nvls = self._nvls_switches()
        self.sharp = self._sharp_switches()
        # rails: on several nodes, local GPU i of every node with its own NIC
        self.rails = self.ppn if self.N > 1 and self.uniform and self._all_have_nics() else 1

    def __getattr__(self, name):
        """`order`, `alike` and `orders` (__init__), searched on first read."""
        if name in ("order", "alike", "orders") and "_search" in self.__dict__:
            capacity, exact = self._search
            found = order_and_alike(self.graph, self.group, self.routes, capacity, exact)
            for k, v in zip(("order", "alike", "orders"), found, strict=True):
                self.__dict__.setdefault(k, v)  # (an order set by hand stays: layouts')
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- hardware ---------------------------------------------------------------------
    def _neighbours(self, g, kind_net: bool):
        """The switches g links to over network (or other) links, in the graph's order;
        each GPU's list found once (asked several times a GPU, costly at 16k GPUs)."""
        found = self._switches.get(g)
        if found is None:
            nodes = self.graph.nodes
            found = self._switches[g] = [
                (s, d.get("kind") == "net")
                for s, d in self.graph.adj[g].items()
                if nodes[s].get("kind") == "switch"
            ]
        return (s for s, net in found if net == kind_net)

    def _rail_switch(self, g) -> str:
        return min((str(s) for s in self._neighbours(g, True)), default="")

    def _nvls_switches(self):
        """node index -> its NVLS switch, when every GPU of every node is on one."""
        out = []
        for members in self.nodes:
            common = None
            for g in members:
                sw = {
                    s
                    for s in self._neighbours(g, False)
                    if self.graph.nodes[s].get("reduce") == "nvls"
                }
                common = sw if common is None else common & sw
            if not common or len(members) < 2:
                return None
            out.append(sorted(common, key=str)[0])
        return out

    def _sharp_switches(self):
        """rail -> the SHARP switch every node's GPU of that rail is on (several nodes)."""
        if self.N < 2 or not self.uniform:
            return None
        out = []
        for i in range(self.ppn):
            common = None
            for members in self.nodes:
                sw = {
                    s
                    for s in self._neighbours(members[i], True)
                    if self.graph.nodes[s].get("reduce") == "sharp"
                }
                common = sw if common is None else common & sw
            if not common:
                return None
            out.append(sorted(common, key=str)[0])
        return out

    def _all_have_nics(self):
        return all(any(True for _ in self._neighbours(g, True)) for g in self.group)

    # -- structures -------------------------------------------------------------------
    def rings(self) -> list[list]:
        """Ring orders (each used both ways), one per channel group."""
        if self.n < 2:
            return []
        if self.N == 1:
            return [list(self.order)] + self._extra_rings(list(self.order))
        if self.rails == 1 or not self.uniform:
            return [list(self.order)]
        return [self._rail_ring(c) for c in range(self.rails)]

    def _rail_ring(self, c: int) -> list:
        """Ring c: enters and leaves each node on one rail, rails alternating so every
        inter-node hop joins GPUs of the same rail."""
        N, ppn = self.N, self.ppn
        if ppn == 1:
            return [m[0] for m in self.nodes]
        a, b, third = c % ppn, (c + 1) % ppn, (c + 2) % ppn
        if N % 2 == 0 or ppn < 3:
            enter = [a if k % 2 == 0 else b for k in range(N)]
            leave = [b if k % 2 == 0 else a for k in range(N)]
            if N % 2:  # odd N with 2 GPUs a node: the last node enters and leaves on a
                leave[-1] = a if enter[-1] == b else b
        else:
            enter = [a if k % 2 == 0 else b for k in range(N - 3)] + [a, b, third]
            leave = [b if k % 2 == 0 else a for k in range(N - 3)] + [b, third, a]
        ring = []
        for k, members in enumerate(self.nodes):
            e, x = enter[k], leave[k]
            rest = [members[(e + j) % ppn] for j in range(1, ppn) if (e + j) % ppn != x]
            ring += [members[e]] + rest + ([members[x]] if x != e else [])
        return ring

    def _extra_rings(self, first: list) -> list[list]:
        """More rings over direct GPU-to-GPU links the first ring leaves unused."""
        if self.n > 64 or self.n < 3:
            return []
        direct = nx.Graph()
        members = set(self.group)
        # the group's out-links in the graph's edge order (members by node order, then
        # each one's links): what a scan of every edge finds, without the scan
        at = self.routes.node_index
        for u in sorted(members, key=at.__getitem__):
            for v in self.graph.adj[u]:
                if v in members and self.graph.has_edge(v, u):
                    direct.add_edge(u, v)
        hops = list(zip(first, first[1:] + first[:1], strict=True))
        if not all(direct.has_edge(a, b) for a, b in hops):
            return []  # rings through switches share the same GPU links: one is enough
        direct.remove_edges_from(hops)
        out = []
        while len(out) < MAX_EXTRA_RINGS:
            ring = _hamiltonian_cycle(direct, first)
            if ring is None:
                break
            out.append(ring)
            direct.remove_edges_from(zip(ring, ring[1:] + ring[:1], strict=True))
        return out

    def node_chain(self, k: int, head_local: int) -> list:
        """Node k's GPUs as a chain ending at its GPU of rail `head_local`."""
        members = self.nodes[k]
        h = head_local % len(members)
        return [members[(h + 1 + j) % len(members)] for j in range(len(members))]


def _hamiltonian_cycle(g: nx.Graph, prefer: list, tries: int = 8):
    """A Hamiltonian cycle of g by greedy walks (fewest remaining options first)."""
    nodes = list(prefer)
    for t in range(min(tries, len(nodes))):
        start = nodes[t]
        path, seen = [start], {start}
        while len(path) < len(nodes):
            options = [v for v in g.neighbors(path[-1]) if v not in seen] if path[-1] in g else []
            if not options:
                break
            nxt = min(
                options,
                key=lambda v: (sum(1 for w in g.neighbors(v) if w not in seen), nodes.index(v)),
            )
            path.append(nxt)
            seen.add(nxt)
        if len(path) == len(nodes) and g.has_edge(path[-1], path[0]):
            return path
    return None


def double_binary_trees(N: int) -> list[list[tuple[int, int]]]:
    """Two complementary binary trees over nodes 0..N-1 as (child, parent) edges: the
    second mirrors the first, so a leaf of one is inside the other (NCCL's double tree)."""
    t1 = [(k, (k - 1) // 2) for k in range(1, N)]
    t2 = [(N - 1 - c, N - 1 - p) for c, p in t1]
    return [t1, t2]


def tree_depth(N: int) -> int:
    """Edges from the deepest leaf to the root of the binary tree above."""
    return max(((k + 1).bit_length() - 1 for k in range(N)), default=0)
