"""What the NCCL model (model.py) knows of a group of GPUs, worked out once per group: its
candidate ring layouts (families.py), the graphs NCCL's tuner would see on each, its
streams' routes, latencies and bottlenecks. `GroupAnalysis` is an object the model holds
(`Nccl.analysis`); its class docstring is the contract.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

from extrapolators.communication.nccl import families, tuner
from extrapolators.communication.nccl import streams as nccl_streams
from extrapolators.communication.nccl.streams import hops as _hops
from extrapolators.communication.nccl.system import System, node_partition
from networks.routing import Routes, path_latencies
from triosim.common.errors import ConfigError
from triosim.hardware import nccl_constants as P


@dataclass
class _Group:
    """What a group of GPUs runs on, worked out once."""

    system: System
    graphs: tuner.Graphs
    rings: list
    ring_weights: list
    both: list  # each ring runs both ways
    structures: dict = field(default_factory=dict)  # (op, algo, root) -> streams
    # per structure key: the streams' path latencies, whether each crosses the network,
    # and their unit times (raw, effective); per ring: the same for its hops, each way
    stream_paths: dict = field(default_factory=dict)
    units: dict = field(default_factory=dict)
    ring_paths: list = field(default_factory=list)


class GroupAnalysis:
    """The groups of GPUs an NCCL model has met, analysed once each.

    Gives: the network's links as arrays (`links`, `capacity`, `link_latency`,
    `link_kind`, `efficiency`: what NCCL believes each link kind carries), `graph`,
    `routes` and `partition` (each GPU's node); `family(group)` and `group_info(group)` (a
    group's candidate layouts, and its default one analysed), `layout(family, k)` (layout
    k analysed: a `_Group`), `prepare(groups)` (many groups' routes found in one walk: the
    same results as one by one), `structure(...)` (a schedule's streams on a layout), and
    the per-pair and per-structure data a plan reads, each worked out once: `pair_arrays`,
    `stream_paths`, `stream_unit`, `unit_time`, `paths`, `both_ways` (families.py and
    alike.py read these too). Nothing here depends on the tuning or on a call's size.

    Needs: the network (its graph, and its `routes` where it has them, else its own), the
    model's options (nvls, sharp, cpu) and `arch` (the GPU architecture for NCCL's tables).
    """

    def __init__(self, net, options, arch: int) -> None:
        self.options, self.arch = options, arch
        graph = net.graph
        self.graph = graph
        self.routes = getattr(net, "routes", None) or Routes(graph)
        self.links = self.routes.links
        data = self.routes.link_data
        self.capacity = np.array([d["bandwidth"] for d in data], float)
        self.link_latency = np.array([d.get("latency", 0.0) for d in data])
        kinds = [d.get("kind", "nvlink") for d in data]
        self.link_kind = np.array(kinds)
        self.efficiency = np.array([P.LINK_EFFICIENCY[k] for k in kinds])
        # what NCCL believes each link carries, one array for every group's System (one
        # product of every link per group was 20 s of 32,768 groups at 131,072 GPUs)
        self._believed = self.capacity * self.efficiency
        self.switch_ends = bool(getattr(net, "reducing_endpoints", False))
        self.partition = node_partition(graph)
        self._families: dict = {}
        self._p2p: dict = {}  # group -> its send/receive layout (p2p_layout)
        # per (a, b) pair met so far: its number, then by number its path latency, whether
        # it crosses the network, its smallest link capacity and its hop count
        self._pair: dict = {}
        self._pair_cols = (np.zeros(0), np.zeros(0, bool), np.zeros(0), np.zeros(0, np.int64))

    def group_info(self, group) -> _Group:
        """The group's default layout: its least loaded ring set (see `family`)."""
        fam = self.family(group)
        return self.layout(fam, fam.default)

    def family(self, group) -> families.Family:
        group = tuple(group)
        fam = self._families.get(group)
        if fam is None:
            fam = self._families[group] = families.make(self, group, self._system(group))
        return fam

    def prepare(self, groups) -> None:
        """Analyse the groups not seen yet together: their rings' hops, both ways, are
        routed in one walk (`Routes.paths_links`) before each group is analysed as
        `group_info` would. A symmetric run's images (2,048 tensor-parallel groups at
        16,384 GPUs) otherwise walked a handful of pairs per group, milliseconds each of
        numpy set-up. A pair's route is the same in any batch, so nothing else changes."""
        new = [g for g in dict.fromkeys(map(tuple, groups)) if g not in self._families]
        if len(new) < 2:
            return
        systems = [self._system(g) for g in new]
        rings = [s.rings() for s in systems]
        hops = [h for rs in rings for r in rs for h in _hops(r)]
        self.pair_arrays(hops + [(b, a) for a, b in hops])
        for g, s, rs in zip(new, systems, rings, strict=True):
            self._families[g] = families.make(self, g, s, rs)

    def p2p_layout(self, group) -> _Group:
        """What a send/receive schedule (all-to-all, sendrecv) runs on: the group's system
        without rings (its streams are pairs of GPUs, each on its own path: NCCL's ring
        search, the family's layouts and their rings' analysis are left undone)."""
        group = tuple(group)
        info = self._p2p.get(group)
        if info is None:
            info = self._p2p[group] = _Group(self._system(group), None, [], [], [])
        return info

    def _system(self, group) -> System:
        # small groups' orders are searched by the family (`_exhaustive`), not the system
        return System(
            self.graph,
            group,
            self.routes,
            self.partition,
            self._believed,
            exact=False,
        )

    def layout(self, fam: families.Family, k: int) -> _Group:
        """Layout k of a family, analysed (once)."""
        info = fam.infos.get(k)
        if info is None:
            rings, _, *own = fam.layouts[k]
            s = own[0] if own else fam.system
            if fam.positions:  # the layouts of an exhaustive family name positions
                rings = [[s.group[i] for i in r] for r in rings]
            if rings and s.N == 1 and tuple(rings[0]) != tuple(s.order):
                s = copy.copy(s)
                s.order = tuple(rings[0])
            info = fam.infos[k] = self._analyse(s.group, s, rings)
        return info

    def _analyse(self, group, s: System | None = None, rings=None) -> _Group:
        s = s or self._system(group)
        rings = rings if rings is not None else s.rings()
        # equal shares, as NCCL splits a call's bytes over its channels (shares by each
        # ring's slowest hop could move load onto a link that a slower one relieved)
        weights = [1.0 / len(rings)] * len(rings)
        info = _Group(s, None, rings, weights, [self.both_ways(r) for r in rings])
        for ring, two in zip(rings, info.both, strict=True):
            info.ring_paths.append(
                [self.pair_arrays(_hops(o))[:2] for o in ((ring, ring[::-1]) if two else (ring,))]
            )
        n = s.n
        # the ring graph's bus bandwidth NCCL would find: the ring streams' bottleneck
        # with what NCCL believes each link kind carries
        ring_bw = 0.0
        if n > 1:
            t = self.unit_time(
                nccl_streams.ring(rings, weights, info.both, 2 * (n - 1) / n), effective=True
            )
            ring_bw = 2 * (n - 1) / n / t / 1e9 if t > 0 else math.inf
        nvls_bw = 0.0
        if s.nvls and self.options.nvls and self.switch_ends and self.arch >= P.NVLS_MIN_ARCH:
            t = self.unit_time(nccl_streams.nvls(s), effective=True)
            nvls_bw = 1 / t / 1e9 if t > 0 else math.inf
        net_bw = 0.0
        if s.N > 1:
            succ = self.graph.adj  # out-links in out_edges' order, without a view per GPU
            nic = min(
                (
                    d["bandwidth"]
                    for g in s.group
                    for d in succ[g].values()
                    if d.get("kind") == "net"
                ),
                default=0.0,
            )
            net_bw = s.rails * nic * P.LINK_EFFICIENCY["net"] / 1e9
        # NCCL's search ends on a whole number of channels at one of its fixed per-channel
        # speeds: a step function of the links' bandwidths whose steps made a slightly
        # slower link give a faster call (fewer channels, each faster). The count here is
        # continuous: NCCL's own where the ring's bandwidth is a whole number of channel
        # speeds (12 x 30 GB/s on an H100 NVSwitch node, 12 x 20 on an A100's)
        if s.N == 1:
            channels = min(16.0, max(1.0, ring_bw / P.INTRA_CHANNEL_SPEED.get(self.arch, 20.0)))
        else:
            # one per NIC; else the ring's bandwidth at 24 GB/s a channel (a 200 Gb/s NIC's
            # speedArrayInter step): the count and the bus bandwidth then move together, so
            # a slower link never gives a small call more bandwidth per channel
            channels = float(s.rails) if s.rails > 1 else max(1.0, ring_bw / 24.0)
        collnet = bool(s.sharp) and self.options.sharp and self.switch_ends and s.nvls is not None
        info.graphs = tuner.Graphs(
            n=n,
            N=s.N,
            arch=self.arch,
            intra_hw=s.intra_hw,
            ring_bw=ring_bw,
            channels=channels,
            nvls_bw=nvls_bw,
            net_bw=net_bw,
            rails=s.rails,
            collnet=collnet,
            cpu=self.options.cpu,
        )
        return info

    def paths(self, pairs) -> list:
        """The routes of (a, b) pairs, found together (Routes.paths_links)."""
        paths = self.routes.paths_links(pairs)
        for (a, b), links in zip(pairs, paths, strict=True):
            if links is None:
                raise ConfigError(
                    "topology",
                    f"{a!r} -> {b!r}",
                    "a topology with a path between every two GPUs of a collective",
                )
        return paths

    def pair_arrays(self, pairs):
        """Arrays over (a, b) pairs of: path latency (the float sum of its links'), whether
        the path crosses a network link, its smallest link capacity, and its hop count.
        Worked out once per pair: collectives of a group reuse their hops."""
        pairs = list(pairs)
        cache = self._pair
        new = [k for k in dict.fromkeys(pairs) if k not in cache]
        if new:
            paths = self.paths(new)
            lats = path_latencies(self.link_latency, paths)
            nh = np.array([len(x) for x in paths], np.int64)
            net = np.zeros(len(paths), bool)
            cap = np.full(len(paths), np.inf)
            has = np.flatnonzero(nh)
            if len(has):  # per path: any network link, smallest capacity (exact reductions)
                flat = np.concatenate(paths)
                starts = (np.cumsum(nh) - nh)[has]
                net[has] = np.logical_or.reduceat(self.link_kind[flat] == "net", starts)
                cap[has] = np.minimum.reduceat(self.capacity[flat], starts)
            n0 = len(cache)
            cache.update(zip(new, range(n0, n0 + len(new)), strict=True))
            cols = self._pair_cols
            if len(cache) > len(cols[0]):  # grow by doubling: thousands of TP groups each
                # add a few pairs, and copying every column each time was quadratic
                size = max(len(cache), 2 * len(cols[0]), 64)
                cols = self._pair_cols = tuple(
                    np.concatenate([c, np.zeros(size - len(c), c.dtype)]) for c in cols
                )
            for c, x in zip(cols, (np.array(lats, float), net, cap, nh), strict=True):
                c[n0 : n0 + len(new)] = x
        ids = np.fromiter((cache[k] for k in pairs), np.int64, count=len(pairs))
        return tuple(col[ids] for col in self._pair_cols)

    def both_ways(self, ring) -> bool:
        """Run the ring both ways when every hop's way back is as short as the way there
        (not on a one-way ring, where it would go all the way round)."""
        hops = _hops(ring)
        there = self.pair_arrays(hops)[3]
        back = self.pair_arrays([(b, a) for a, b in hops])[3]
        return bool((there == back).all())

    def structure(self, info: _Group, op: str, algo: str, root=None) -> list:
        """The schedule's streams (src, dst, share of the bytes), built once per group."""
        key = (op, algo, root)
        if key not in info.structures:
            info.structures[key] = nccl_streams.structure(
                info.system, info.rings, info.ring_weights, info.both, op, algo, root
            )
        return info.structures[key]

    def stream_unit(self, info: _Group, key, streams, effective=False) -> float:
        """`unit_time` of a group's structure, worked out once."""
        k = (key, effective)
        if k not in info.units:
            info.units[k] = self.unit_time(streams, effective)
        return info.units[k]

    def stream_paths(self, info: _Group, key, streams):
        """(path latency, crosses the network) arrays of a group's structure's streams."""
        if key not in info.stream_paths:
            info.stream_paths[key] = self.pair_arrays((a, b) for a, b, _ in streams)[:2]
        return info.stream_paths[key]

    def unit_time(self, streams, effective=False) -> float:
        """Seconds per byte of the operation for the streams on the free network: the most
        loaded link's load / capacity (x what NCCL believes the link carries)."""
        paths = self.paths([(a, b) for a, b, _ in streams])
        if not paths:
            return 0.0
        # only the links the streams cross (a zeroed array of every link per group was
        # most of a 131,072-GPU run's NCCL analysis); one unbuffered add in stream order:
        # the same sums as one per stream
        nh = [len(x) for x in paths]
        used, at = np.unique(np.concatenate(paths), return_inverse=True)
        load = np.zeros(len(used))
        np.add.at(load, at.reshape(-1), np.repeat([x for *_, x in streams], nh))
        cap = self.capacity[used] * (self.efficiency[used] if effective else 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(np.max(np.where(load > 0, load / cap, 0.0), initial=0.0))
