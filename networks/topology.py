"""Topology builders: networkx DiGraphs with `bandwidth` (bytes/s) and `latency` (s) on every edge.

GPUs are the integer nodes 0..N-1 with kind='gpu'; switches are string nodes with
kind='switch'. Every builder adds links in both directions; `set_link` then changes
one direction or both, so asymmetric and heterogeneous systems are one call away.

What the hardware is, for models that care (the NCCL collective model): every edge has a
`kind` ('nvlink', 'pcie' or 'net' for the inter-node fabric); a switch that reduces data in
flight has `reduce` = 'nvls' (NVSwitch3 NVLink SHARP) or 'sharp' (InfiniBand SHARP); a
builder that knows a good ring through its GPUs records it as `graph.graph['ring']`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import networkx as nx

from networks.routing import LINK_KINDS
from triosim.common.errors import ConfigError, NetworkError
from triosim.common.registry import Registry
from triosim.common.schema import NoOptions, load, option

REDUCE_KINDS = ("nvls", "sharp")


def _check_count(n, field="num_gpus", minimum=1):
    if isinstance(n, bool) or not isinstance(n, int) or n < minimum:
        raise ConfigError(field, n, f"an integer >= {minimum}")
    return n


def _new(n_gpus: int) -> nx.DiGraph:
    g = nx.DiGraph()
    for i in range(n_gpus):
        g.add_node(i, kind="gpu")
    return g


def _switch(g, name, reduce: str | None = None):
    g.add_node(name, kind="switch")
    if reduce:
        if reduce not in REDUCE_KINDS:
            raise NetworkError(f"switch {name!r}: reduce must be one of {REDUCE_KINDS}")
        g.nodes[name]["reduce"] = reduce
    return name


def add_link(
    g: nx.DiGraph,
    u,
    v,
    bandwidth: float,
    latency: float = 0.0,
    both: bool = True,
    kind: str = "nvlink",
):
    """Add (or replace) a link; both directions unless `both=False`. `kind`: nvlink (any
    direct GPU-to-GPU or GPU-to-NVSwitch link), pcie, or net (the inter-node fabric)."""
    if not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
        raise NetworkError(f"link {u!r}->{v!r}: bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    if not (isinstance(latency, (int, float)) and 0 <= latency < math.inf):
        raise NetworkError(f"link {u!r}->{v!r}: latency must be finite and >= 0 s, got {latency!r}")
    if kind not in LINK_KINDS:
        raise NetworkError(f"link {u!r}->{v!r}: kind must be one of {LINK_KINDS}, got {kind!r}")
    g.add_edge(u, v, bandwidth=float(bandwidth), latency=float(latency), kind=kind)
    if both:
        g.add_edge(v, u, bandwidth=float(bandwidth), latency=float(latency), kind=kind)
    return g


def set_link(g: nx.DiGraph, u, v, bandwidth=None, latency=None, both: bool = False):
    """Change an existing link's bandwidth and/or latency (one direction unless both=True)."""
    for a, b in [(u, v), (v, u)] if both else [(u, v)]:
        if not g.has_edge(a, b):
            raise NetworkError(f"there is no link {a!r}->{b!r} to change")
        d = g.edges[a, b]
        add_link(
            g,
            a,
            b,
            d["bandwidth"] if bandwidth is None else bandwidth,
            d["latency"] if latency is None else latency,
            both=False,
            kind=d.get("kind", "nvlink"),
        )
    return g


def ring(n: int, bandwidth: float, latency: float = 0.0, bidirectional: bool = True):
    _check_count(n)
    g = _new(n)
    for i in range(n if n > 1 else 0):
        j = (i + 1) % n
        if j != i and not g.has_edge(i, j):
            add_link(g, i, j, bandwidth, latency, both=bidirectional)
    g.graph["ring"] = list(range(n))
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
    g.graph["ring"] = list(range(half)) + list(range(n - 1, half - 1, -1))
    return g


def fully_connected(n: int, bandwidth: float, latency: float = 0.0):
    _check_count(n)
    g = _new(n)
    for i in range(n):
        for j in range(i + 1, n):
            add_link(g, i, j, bandwidth, latency)
    g.graph["ring"] = list(range(n))
    return g


def switch_star(
    n: int,
    bandwidth: float,
    latency: float = 0.0,
    switch: str = "nvswitch",
    nvls: bool = False,
    kind: str = "nvlink",
):
    """Every GPU on one switch (NVSwitch): each GPU's link carries bandwidth each way.
    `nvls`: the switch reduces in flight (NVSwitch3 with NVLink SHARP, H100/H200 HGX)."""
    _check_count(n)
    g = _new(n)
    _switch(g, switch, "nvls" if nvls else None)
    for i in range(n):
        add_link(g, i, switch, bandwidth, latency / 2, kind=kind)
    g.graph["ring"] = list(range(n))
    return g


def _grid_cycle(rows: int, cols: int) -> list | None:
    """A Hamiltonian cycle of a rows x cols grid (one exists iff rows*cols is even): snake
    through columns 1.. row by row, come back up column 0."""
    if rows * cols < 4 or (rows % 2 and cols % 2) or min(rows, cols) < 2:
        return None
    if rows % 2:  # snake along the even side
        t = _grid_cycle(cols, rows)
        return [(i % rows) * cols + i // rows for i in t] if t else None
    order = []
    for r in range(rows):
        cs = range(1, cols) if r % 2 == 0 else range(cols - 1, 0, -1)
        order += [r * cols + c for c in cs]
    return order + [r * cols for r in range(rows - 1, -1, -1)]


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
    cycle = _grid_cycle(rows, cols)
    if cycle:
        g.graph["ring"] = cycle
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
    if radix % 2:  # half the ports down, half up: an odd one would be dropped without a word
        raise ConfigError("topology.radix", radix, "an even number of switch ports")
    down = radix // 2
    leaves = math.ceil(n / down)
    if leaves > radix:
        raise ConfigError("num_gpus", n, f"at most {radix * down} GPUs for radix {radix}")
    g = _new(n)
    spines = [_switch(g, f"spine{s}") for s in range(down if leaves > 1 else 0)]
    for leaf in range(leaves):
        name = _switch(g, f"leaf{leaf}")
        for i in range(leaf * down, min(n, (leaf + 1) * down)):
            add_link(g, i, name, bandwidth, latency, kind="net")
        for s in spines:
            add_link(g, name, s, bandwidth, latency, kind="net")
    g.graph["ring"] = list(range(n))
    return g


def pcie_tree(
    n: int,
    bandwidth: float,
    latency: float = 0.0,
    per_switch: int = 2,
    host_bandwidth: float | None = None,
):
    """GPUs under PCIe switches (per_switch each) under one root complex (CPU)."""
    _check_count(n)
    _check_count(per_switch, "per_switch")
    g = _new(n)
    root = _switch(g, "root")
    for s in range(math.ceil(n / per_switch)):
        sw = _switch(g, f"pcie{s}")
        add_link(g, sw, root, host_bandwidth or bandwidth, latency, kind="pcie")
        for i in range(s * per_switch, min(n, (s + 1) * per_switch)):
            add_link(g, i, sw, bandwidth, latency, kind="pcie")
    g.graph["ring"] = list(range(n))
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
    g.graph["ring"] = [0, 1, 2, 3, 7, 6, 5, 4]
    return g


def multi_node(
    nodes: int,
    gpus_per_node: int,
    intra_bandwidth: float,
    inter_bandwidth: float,
    intra_latency: float = 0.0,
    inter_latency: float = 0.0,
    *,
    fabric: str = "rail",
    oversubscription: float = 1.0,
    spines: int | None = None,
    nvls: bool = False,
    sharp: bool = False,
):
    """Servers of `gpus_per_node` GPUs on an NVSwitch ('nvswitch{k}', NVLink links of
    intra_bandwidth), every GPU with its own NIC (inter_bandwidth each way), as in DGX/HGX
    systems. GPU k*gpus_per_node + i is GPU i of node k (node attribute `node` = k).

    fabric 'rail' (rail-optimised two-tier fat tree): GPU i of every node on leaf switch
    'rail{i}'; every leaf linked to each of `spines` spine switches (default gpus_per_node),
    its uplinks together carrying nodes x inter_bandwidth / oversubscription each way.
    fabric 'switch': every NIC on one non-blocking switch 'ib'.
    Latencies: intra_latency GPU to GPU through the NVSwitch; inter_latency GPU to GPU
    through one switch (a leaf-spine hop adds inter_latency / 2 each way).
    `nvls`: the NVSwitches reduce (NVSwitch3, H100/H200); `sharp`: the fabric's switches do
    (InfiniBand SHARP).
    """
    _check_count(nodes, "nodes")
    _check_count(gpus_per_node, "gpus_per_node")
    if fabric not in ("rail", "switch"):
        raise ConfigError("topology.fabric", fabric, "rail or switch")
    if not oversubscription >= 1:
        raise ConfigError("topology.oversubscription", oversubscription, "a number >= 1")
    ppn = gpus_per_node
    g = _new(nodes * ppn)
    red = "sharp" if sharp else None
    for k in range(nodes):
        sw = _switch(g, f"nvswitch{k}", "nvls" if nvls else None)
        for i in range(ppn):
            g.nodes[k * ppn + i]["node"] = k
            add_link(g, k * ppn + i, sw, intra_bandwidth, intra_latency / 2)
    if nodes > 1 and fabric == "switch":
        ib = _switch(g, "ib", red)
        for gpu in range(nodes * ppn):
            add_link(g, gpu, ib, inter_bandwidth, inter_latency / 2, kind="net")
    elif nodes > 1:
        n_spines = ppn if spines is None else _check_count(spines, "topology.spines")
        up = nodes * inter_bandwidth / oversubscription / n_spines
        spine = [_switch(g, f"spine{s}", red) for s in range(n_spines if ppn > 1 else 0)]
        for i in range(ppn):
            leaf = _switch(g, f"rail{i}", red)
            for k in range(nodes):
                add_link(g, k * ppn + i, leaf, inter_bandwidth, inter_latency / 2, kind="net")
            for s in spine:
                add_link(g, leaf, s, up, inter_latency / 2, kind="net")
    g.graph["ring"] = list(range(nodes * ppn))
    return g


@dataclass(frozen=True)
class LinkSpec:
    """One link of an `edges` topology, or one override in `topology.links`."""

    src: int | str = option(help="one end (a GPU number or a switch name)")
    dst: int | str = option(help="the other end")
    bandwidth: float | None = option(None, unit="bandwidth", gt=0, help="bytes/s per direction")
    latency: float | None = option(None, unit="seconds", ge=0, lt=math.inf, help="seconds")
    both: bool | None = option(None, help="both directions (edges: true; overrides: false)")
    kind: Literal["nvlink", "pcie", "net"] | None = option(
        None, help="edges: nvlink (default), pcie, or net (inter-node fabric)"
    )


def from_edges(
    edges, default_bandwidth=None, default_latency: float = 0.0, gpus=None, reducing=None
):
    """Build from a list of {src, dst, bandwidth, latency, both, kind} dicts (a YAML edge list).

    Nodes named in `gpus` (default: every integer node) are GPUs; others are switches;
    `reducing` maps switches that reduce in flight to 'nvls' or 'sharp'.
    """
    if not isinstance(edges, list) or not edges:
        raise ConfigError("topology.edges", edges, "a non-empty list of {src, dst, bandwidth}")
    g = nx.DiGraph()
    for k, e in enumerate(edges):
        spec = e if isinstance(e, LinkSpec) else load(LinkSpec, e, f"topology.edges[{k}]")
        bw = spec.bandwidth if spec.bandwidth is not None else default_bandwidth
        if bw is None:
            raise ConfigError(
                f"topology.edges[{k}].bandwidth", None, "a bandwidth such as '50 GB/s'"
            )
        lat = spec.latency if spec.latency is not None else default_latency
        add_link(
            g, spec.src, spec.dst, bw, lat, both=spec.both is not False, kind=spec.kind or "nvlink"
        )
    gpu_set = set(gpus) if gpus is not None else {n for n in g if isinstance(n, int)}
    missing = [x for x in gpu_set if x not in g]
    if missing:
        raise ConfigError("topology.gpus", sorted(missing, key=repr), "nodes that appear in edges")
    for n in g.nodes:
        g.nodes[n]["kind"] = "gpu" if n in gpu_set else "switch"
    for name, how in (reducing or {}).items():
        if name not in g or name in gpu_set:
            raise ConfigError("topology.reducing", name, "a switch that appears in edges")
        if how not in REDUCE_KINDS:
            raise ConfigError(f"topology.reducing.{name}", how, " or ".join(REDUCE_KINDS))
        g.nodes[name]["reduce"] = how
    return g


def apply_overrides(g: nx.DiGraph, links) -> nx.DiGraph:
    """`topology.links`: change existing links (one direction unless `both`)."""
    for k, spec in enumerate(links):
        where = f"topology.links[{k}]"
        if spec.bandwidth is None and spec.latency is None:
            raise ConfigError(
                where, dataclasses.asdict(spec), "a bandwidth and/or a latency to set"
            )
        for a, b in (
            [(spec.src, spec.dst), (spec.dst, spec.src)] if spec.both else [(spec.src, spec.dst)]
        ):
            if not g.has_edge(a, b):
                raise ConfigError(
                    where,
                    {"src": spec.src, "dst": spec.dst},
                    f"a link of this topology; there is no link {a!r}->{b!r}",
                )
        set_link(g, spec.src, spec.dst, spec.bandwidth, spec.latency, both=bool(spec.both))
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


# -- the builders as configurable parts ------------------------------------------------------
# Each registered topology takes (num_gpus, bandwidth, latency, options) and declares its
# own config fields; a config names it by `topology.kind`.

TOPOLOGIES = Registry("topology.kind", "kind", "topology")


def register(name: str, options=NoOptions, *, replace: bool = False):
    """Register `build(n, bandwidth, latency, options) -> DiGraph` under a topology name."""

    def deco(fn):
        fn.Options = options
        return TOPOLOGIES.register(name, fn, replace=replace)

    return deco


@dataclass(frozen=True)
class RingOptions:
    bidirectional: bool = option(True, help="links in both directions (false: one-way ring)")


@dataclass(frozen=True)
class GridOptions:
    rows: int | None = option(None, ge=1, help="rows (default: the most square grid)")
    cols: int | None = option(None, ge=1, help="columns (default: num_gpus / rows)")


@dataclass(frozen=True)
class FatTreeOptions:
    radix: int = option(64, ge=2, help="switch ports: radix/2 GPUs per leaf, radix/2 spines")


@dataclass(frozen=True)
class PcieOptions:
    per_switch: int = option(2, ge=1, help="GPUs under each PCIe switch")
    host_bandwidth: float | None = option(
        None, unit="bandwidth", gt=0, help="switch-to-root link (default: bandwidth)"
    )


@dataclass(frozen=True)
class SwitchOptions:
    nvls: bool = option(False, help="the switch reduces in flight (NVSwitch3 NVLink SHARP: H100)")


@dataclass(frozen=True)
class MultiNodeOptions:
    gpus_per_node: int = option(8, ge=1, help="GPUs per node (on one NVSwitch)")
    inter_bandwidth: float = option(
        50e9, unit="bandwidth", gt=0, help="each GPU's NIC, per direction (50 GB/s: IB NDR)"
    )
    inter_latency: float = option(
        2e-6, unit="seconds", ge=0, lt=math.inf, help="GPU to GPU through the inter-node switch"
    )
    fabric: Literal["rail", "switch"] = option(
        "rail",
        help="rail: rail-optimised two-tier fat tree (GPU i of every node on leaf i); "
        "switch: one non-blocking switch",
    )
    oversubscription: float = option(
        1.0, ge=1, plausible="factor", help="rail fabric: leaf down/up bandwidth ratio"
    )
    spines: int | None = option(
        None, ge=1, help="rail fabric: spine switches (default: gpus_per_node)"
    )
    nvls: bool = option(False, help="the NVSwitches reduce in flight (NVSwitch3: H100/H200)")
    sharp: bool = option(False, help="the inter-node switches reduce in flight (IB SHARP)")


@dataclass(frozen=True)
class EdgesOptions:
    edges: list[LinkSpec] = option(
        factory=list, help="[{src, dst, bandwidth, latency, both, kind}, ...]"
    )
    gpus: list | None = option(None, help="nodes that are GPUs (default: the integer nodes)")
    reducing: dict | None = option(None, help="switches that reduce in flight: {name: nvls|sharp}")


register("ring", RingOptions)(lambda n, bw, lat, o: ring(n, bw, lat, o.bidirectional))
register("ring_chord")(lambda n, bw, lat, o: ring_chord(n, bw, lat))
register("double_ring")(lambda n, bw, lat, o: double_ring(n, bw, lat))
register("fully_connected")(lambda n, bw, lat, o: fully_connected(n, bw, lat))
register("switch", SwitchOptions)(lambda n, bw, lat, o: switch_star(n, bw, lat, nvls=o.nvls))
register("fat_tree", FatTreeOptions)(lambda n, bw, lat, o: fat_tree(n, bw, lat, o.radix))
register("pcie_tree", PcieOptions)(
    lambda n, bw, lat, o: pcie_tree(n, bw, lat, o.per_switch, o.host_bandwidth)
)


def _grid(n, o) -> tuple[int, int]:
    rows, cols = o.rows, o.cols
    if rows is None and cols is None:
        rows = next(r for r in range(math.isqrt(n), 0, -1) if n % r == 0)
    elif (rows is None) != (cols is None):  # one given: the other is num_gpus / it (was "3 x 0")
        name, given = ("rows", rows) if cols is None else ("cols", cols)
        if n % given:
            raise ConfigError(f"topology.{name}", given, f"a divisor of num_gpus ({n})")
    rows = rows or n // cols
    cols = cols or n // rows
    if rows * cols != n:
        raise ConfigError(
            "topology.rows", rows, f"rows x cols = num_gpus ({n}); got {rows} x {cols}"
        )
    return rows, cols


register("mesh2d", GridOptions)(lambda n, bw, lat, o: mesh2d(*_grid(n, o), bw, lat))
register("torus2d", GridOptions)(lambda n, bw, lat, o: torus2d(*_grid(n, o), bw, lat))


@register("dgx1")
def _dgx1(n, bw, lat, o):
    if n != 8:
        raise ConfigError("num_gpus", n, "8 for the dgx1 topology")
    return dgx1(bw, lat)


@register("multi_node", MultiNodeOptions)
def _multi_node(n, bw, lat, o):
    if n % o.gpus_per_node:
        raise ConfigError("topology.gpus_per_node", o.gpus_per_node, f"a divisor of num_gpus ({n})")
    return multi_node(
        n // o.gpus_per_node,
        o.gpus_per_node,
        bw,
        o.inter_bandwidth,
        lat,
        o.inter_latency,
        fabric=o.fabric,
        oversubscription=o.oversubscription,
        spines=o.spines,
        nvls=o.nvls,
        sharp=o.sharp,
    )


@register("edges", EdgesOptions)
def _edges(n, bw, lat, o):
    return from_edges(o.edges, bw, lat, gpus=o.gpus, reducing=o.reducing)


def to_edges(graph: nx.DiGraph) -> dict:
    """A graph as `edges` topology options (one entry per direction), so a topology a
    Python caller built is written into the saved config and re-runs as it stands."""
    edges = [
        {
            "src": u,
            "dst": v,
            "bandwidth": float(d["bandwidth"]),
            "latency": float(d.get("latency", 0.0)),
            "both": False,
            "kind": d.get("kind", "nvlink"),
        }
        for u, v, d in graph.edges(data=True)
    ]
    gpus = [n for n, d in graph.nodes(data=True) if d.get("kind", "gpu") == "gpu"]
    reducing = {n: d["reduce"] for n, d in graph.nodes(data=True) if d.get("reduce")}
    return {"edges": edges, "gpus": gpus, "reducing": reducing or None}
