"""Topology builders: networkx DiGraphs with `bandwidth` (bytes/s) and `latency` (s) on every edge.

GPUs are the integer nodes 0..N-1 with kind='gpu'; switches are string nodes with
kind='switch'. Every builder adds links in both directions; `set_link` then changes
one direction or both, so asymmetric and heterogeneous systems are one call away.
"""

from __future__ import annotations

import math

import networkx as nx

from triosim.errors import ConfigError, NetworkError


def _check_count(n, field="num_gpus", minimum=1):
    if isinstance(n, bool) or not isinstance(n, int) or n < minimum:
        raise ConfigError(field, n, f"an integer >= {minimum}")
    return n


def _new(n_gpus: int) -> nx.DiGraph:
    g = nx.DiGraph()
    for i in range(n_gpus):
        g.add_node(i, kind="gpu")
    return g


def _switch(g, name):
    g.add_node(name, kind="switch")
    return name


def add_link(g: nx.DiGraph, u, v, bandwidth: float, latency: float = 0.0, both: bool = True):
    """Add (or replace) a link; both directions unless `both=False`."""
    if not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
        raise NetworkError(f"link {u!r}->{v!r}: bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    if not (isinstance(latency, (int, float)) and 0 <= latency < math.inf):
        raise NetworkError(f"link {u!r}->{v!r}: latency must be finite and >= 0 s, got {latency!r}")
    g.add_edge(u, v, bandwidth=float(bandwidth), latency=float(latency))
    if both:
        g.add_edge(v, u, bandwidth=float(bandwidth), latency=float(latency))
    return g


def set_link(g: nx.DiGraph, u, v, bandwidth=None, latency=None, both: bool = False):
    """Change an existing link's bandwidth and/or latency (one direction unless both=True)."""
    for a, b in [(u, v), (v, u)] if both else [(u, v)]:
        if not g.has_edge(a, b):
            raise NetworkError(f"there is no link {a!r}->{b!r} to change")
        d = g.edges[a, b]
        add_link(g, a, b, d["bandwidth"] if bandwidth is None else bandwidth,
                 d["latency"] if latency is None else latency, both=False)  # fmt: skip
    return g


def ring(n: int, bandwidth: float, latency: float = 0.0, bidirectional: bool = True):
    _check_count(n)
    g = _new(n)
    for i in range(n if n > 1 else 0):
        j = (i + 1) % n
        if j != i and not g.has_edge(i, j):
            add_link(g, i, j, bandwidth, latency, both=bidirectional)
    return g


def ring_chord(n: int, bandwidth: float, latency: float = 0.0):
    """The paper's "ring-based" graph: a ring plus a chord from each node to its most distant one."""
    g = ring(n, bandwidth, latency)
    for i in range(n):
        j = (i + n // 2) % n
        if j != i and not g.has_edge(i, j):
            add_link(g, i, j, bandwidth, latency)
    return g


def double_ring(n: int, bandwidth: float, latency: float = 0.0):
    """Two ring-based graphs of n/2 GPUs each, joined node to node (paper Figure 16)."""
    _check_count(n, minimum=2)
    if n % 2:
        raise ConfigError("num_gpus", n, "an even number for a double ring")
    half = n // 2
    g = _new(n)
    for offset in (0, half):
        sub = ring_chord(half, bandwidth, latency)
        for u, v, d in sub.edges(data=True):
            add_link(g, u + offset, v + offset, d["bandwidth"], d["latency"], both=False)
    for i in range(half):
        add_link(g, i, i + half, bandwidth, latency)
    return g


def fully_connected(n: int, bandwidth: float, latency: float = 0.0):
    _check_count(n)
    g = _new(n)
    for i in range(n):
        for j in range(i + 1, n):
            add_link(g, i, j, bandwidth, latency)
    return g


def switch_star(n: int, bandwidth: float, latency: float = 0.0, switch: str = "nvswitch"):
    """Every GPU on one switch (NVSwitch): each GPU's link carries bandwidth each way."""
    _check_count(n)
    g = _new(n)
    _switch(g, switch)
    for i in range(n):
        add_link(g, i, switch, bandwidth, latency / 2)
    return g


def mesh2d(rows: int, cols: int, bandwidth: float, latency: float = 0.0, torus: bool = False):
    """A rows x cols mesh (or torus); GPU r*cols + c sits at (r, c). The wafer is 12 x 7."""
    _check_count(rows, "rows")
    _check_count(cols, "cols")
    g = _new(rows * cols)
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            if c + 1 < cols or (torus and cols > 2):
                add_link(g, i, r * cols + (c + 1) % cols, bandwidth, latency)
            if r + 1 < rows or (torus and rows > 2):
                add_link(g, i, ((r + 1) % rows) * cols + c, bandwidth, latency)
    return g


def torus2d(rows: int, cols: int, bandwidth: float, latency: float = 0.0):
    return mesh2d(rows, cols, bandwidth, latency, torus=True)


def fat_tree(n: int, bandwidth: float, latency: float = 0.0, radix: int = 64):
    """A two-level non-blocking fat tree (leaf-spine folded Clos) of switches with `radix` ports.

    Each leaf holds radix/2 GPUs and has one uplink to each of radix/2 spines, so
    any permutation of GPU pairs can run at full link bandwidth (with ECMP routing).
    """
    _check_count(n)
    _check_count(radix, "radix", 2)
    down = radix // 2
    leaves = math.ceil(n / down)
    if leaves > radix:
        raise ConfigError("num_gpus", n, f"at most {radix * down} GPUs for radix {radix}")
    g = _new(n)
    spines = [_switch(g, f"spine{s}") for s in range(down if leaves > 1 else 0)]
    for leaf in range(leaves):
        name = _switch(g, f"leaf{leaf}")
        for i in range(leaf * down, min(n, (leaf + 1) * down)):
            add_link(g, i, name, bandwidth, latency)
        for s in spines:
            add_link(g, name, s, bandwidth, latency)
    return g


def pcie_tree(n: int, bandwidth: float, latency: float = 0.0, per_switch: int = 2,
              host_bandwidth: float | None = None):  # fmt: skip
    """GPUs under PCIe switches (per_switch each) under one root complex (CPU)."""
    _check_count(n)
    _check_count(per_switch, "per_switch")
    g = _new(n)
    root = _switch(g, "root")
    for s in range(math.ceil(n / per_switch)):
        sw = _switch(g, f"pcie{s}")
        add_link(g, sw, root, host_bandwidth or bandwidth, latency)
        for i in range(s * per_switch, min(n, (s + 1) * per_switch)):
            add_link(g, i, sw, bandwidth, latency)
    return g


def dgx1(bandwidth: float, latency: float = 0.0):
    """The DGX-1 hybrid cube-mesh: GPUs 0-3 and 4-7 each fully linked, plus i <-> i+4.

    Every connection gets `bandwidth`; give the doubled NVLink pairs of your machine
    twice the bandwidth with `set_link(g, u, v, bandwidth=..., both=True)`.
    """
    g = _new(8)
    for base in (0, 4):
        for i in range(4):
            for j in range(i + 1, 4):
                add_link(g, base + i, base + j, bandwidth, latency)
    for i in range(4):
        add_link(g, i, i + 4, bandwidth, latency)
    return g


def multi_node(nodes: int, gpus_per_node: int, intra_bandwidth: float, inter_bandwidth: float,
               intra_latency: float = 0.0, inter_latency: float = 0.0):  # fmt: skip
    """NVSwitch inside each node, one NIC per GPU to an InfiniBand switch between nodes."""
    _check_count(nodes, "nodes")
    _check_count(gpus_per_node, "gpus_per_node")
    g = _new(nodes * gpus_per_node)
    ib = _switch(g, "ib") if nodes > 1 else None
    for n in range(nodes):
        sw = _switch(g, f"nvswitch{n}")
        for k in range(gpus_per_node):
            i = n * gpus_per_node + k
            add_link(g, i, sw, intra_bandwidth, intra_latency / 2)
            if ib is not None:
                add_link(g, i, ib, inter_bandwidth, inter_latency / 2)
    return g


def from_edges(edges, default_bandwidth=None, default_latency: float = 0.0, gpus=None):
    """Build from a list of {src, dst, bandwidth, latency, both} dicts (a YAML edge list).

    Nodes named in `gpus` (default: every integer node) are GPUs; others are switches.
    """
    from triosim.units import parse_bandwidth, parse_seconds

    if not isinstance(edges, list) or not edges:
        raise ConfigError("topology.edges", edges, "a non-empty list of {src, dst, bandwidth}")
    g = nx.DiGraph()
    for k, e in enumerate(edges):
        if not isinstance(e, dict) or "src" not in e or "dst" not in e:
            raise ConfigError(f"topology.edges[{k}]", e, "a mapping with src and dst")
        bw = e.get("bandwidth", default_bandwidth)
        if bw is None:
            raise ConfigError(
                f"topology.edges[{k}].bandwidth", None, "a bandwidth such as '50 GB/s'"
            )
        bw = parse_bandwidth(bw, f"topology.edges[{k}].bandwidth")
        lat = parse_seconds(e.get("latency", default_latency), f"topology.edges[{k}].latency")
        if not bw > 0:
            raise ConfigError(f"topology.edges[{k}].bandwidth", e.get("bandwidth"), "> 0")
        if lat < 0:
            raise ConfigError(f"topology.edges[{k}].latency", e.get("latency"), ">= 0 s")
        add_link(g, e["src"], e["dst"], bw, lat, both=e.get("both", True))
    gpu_set = set(gpus) if gpus is not None else {n for n in g if isinstance(n, int)}
    for n in g.nodes:
        g.nodes[n]["kind"] = "gpu" if n in gpu_set else "switch"
    return g


def from_networkx(graph: nx.Graph, bandwidth: float | None = None, latency: float = 0.0):
    """Adopt a user graph, filling in missing bandwidth/latency with the defaults given."""
    g = graph.to_directed() if not graph.is_directed() else graph.copy()
    for u, v, d in g.edges(data=True):
        if "bandwidth" not in d:
            if bandwidth is None:
                raise NetworkError(f"link {u!r}->{v!r} has no bandwidth and no default was given")
            d["bandwidth"] = float(bandwidth)
        d.setdefault("latency", float(latency))
    return g


BUILDERS = {
    "ring": ring,
    "ring_chord": ring_chord,
    "double_ring": double_ring,
    "fully_connected": fully_connected,
    "switch": switch_star,
    "mesh2d": mesh2d,
    "torus2d": torus2d,
    "fat_tree": fat_tree,
    "pcie_tree": pcie_tree,
    "dgx1": dgx1,
    "multi_node": multi_node,
    "edges": from_edges,
}
