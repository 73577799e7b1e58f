"""The batched route building (Routes.paths_links, path_latencies) and the NCCL model's
cached per-group path data give exactly what the straightforward per-pair code gave.

The references are written out here: a per-pair walk over a full (unbounded) Dijkstra row
with the documented rule and ECMP hash, the float sum of each path's latencies, and the
NCCL model's per-hop planning as it was before its path data were batched and cached.
Paths are also checked against the independent truth: a valid chain of links from source
to destination whose packed weight is the shortest distance networkx finds.
"""

import math
import zlib

import networkx as nx
import numpy as np
import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extrapolators.communication.nccl import streams as nccl_streams
from extrapolators.communication.nccl.groups import GroupAnalysis, _Group
from extrapolators.communication.nccl.model import Nccl, Plan, Terms
from extrapolators.communication.nccl.options import NcclOptions
from extrapolators.communication.nccl.streams import hops as _hops
from extrapolators.communication.nccl.system import System
from networks import PacketSwitchNetwork
from networks import topology as topo
from networks.routing import Routes, link_weight, path_latencies
from triosim.common.errors import ConfigError
from triosim.hardware import nccl_constants as P

GB = 1e9


# -- the reference route ------------------------------------------------------------------
def reference_paths(graph, pairs, mode="latency"):
    """Per pair: a full Dijkstra row from the source, then the walk back from the
    destination taking, among the in-links on a shortest path (the network ones only,
    where there are both kinds), the one the hash of (source, destination, node) picks,
    in the order the graph lists its edges."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import dijkstra

    links = list(graph.edges())
    nodes = list(graph.nodes)
    ix = {v: i for i, v in enumerate(nodes)}
    w = [link_weight(graph.edges[e], mode) for e in links]
    m = csr_matrix(
        (w, ([ix[a] for a, _ in links], [ix[b] for _, b in links])), shape=(len(nodes), len(nodes))
    )
    into = {v: [k for k, (_, b) in enumerate(links) if b == v] for v in nodes}
    out = []
    for src, dst in pairs:
        dist = dijkstra(m, indices=ix[src])
        if not np.isfinite(dist[ix[dst]]):
            out.append(None)
            continue
        path, v = [], dst
        while v != src:
            ok = [k for k in into[v] if dist[ix[links[k][0]]] + w[k] == dist[ix[v]]]
            net = [k for k in ok if graph.edges[links[k]].get("kind") == "net"]
            ok = net or ok  # network links as late as they can be: NVLink first (PXN)
            k = (
                ok[zlib.crc32(f"{src!r}|{dst!r}|{v!r}".encode()) % len(ok)]
                if len(ok) > 1
                else ok[0]
            )
            path.append(k)
            v = links[k][0]
        out.append(path[::-1])
    return out


def check_truth(graph, pairs, got, mode="latency"):
    """Each path is a chain of links from source to destination, as short (in packed
    weight) as any; None exactly where there is no path."""
    links = list(graph.edges())
    for (src, dst), p in zip(pairs, got, strict=True):
        reach = nx.has_path(graph, src, dst)
        assert (p is not None) == reach, (src, dst)
        if p is None:
            continue
        chain = [src] + [links[k][1] for k in p]
        assert all(links[k][0] == a for k, a in zip(p, chain, strict=False)), (src, dst)
        assert chain[-1] == dst
        length = sum(link_weight(graph.edges[links[k]], mode) for k in p)
        best = nx.dijkstra_path_length(graph, src, dst, weight=lambda u, v, d: link_weight(d, mode))
        assert length == best, (src, dst)


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return list(np.asarray(a)) == list(b)


def random_graph(seed: int):
    """Random heterogeneous directed graphs: GPUs and switches, links of a few speeds and
    latencies (so equal-cost paths are common), some one-way, some of kind 'net', and a
    GPU left unconnected now and then."""
    rng = np.random.default_rng(seed)
    n_gpu, n_sw = int(rng.integers(2, 9)), int(rng.integers(0, 5))
    g = nx.DiGraph()
    for i in range(n_gpu):
        g.add_node(i, kind="gpu")
    for s in range(n_sw):
        g.add_node(f"sw{s}", kind="switch")
    nodes = list(g.nodes)
    for _ in range(int(rng.integers(1, 3 * len(nodes)))):
        a, b = (nodes[int(i)] for i in rng.choice(len(nodes), 2, replace=False))
        bw = float(rng.choice([10, 25, 50, np.inf])) * GB
        lat = float(rng.choice([0.0, 1e-6, 2e-6]))
        kind = str(rng.choice(["nvlink", "pcie", "net"]))
        topo.add_link(g, a, b, bw, lat, both=bool(rng.random() < 0.7), kind=kind)
    return g


def builders():
    return {
        "ring": topo.ring(7, 10 * GB, 1e-6),
        "one-way ring": topo.ring(5, 10 * GB, 1e-6, bidirectional=False),
        "torus": topo.torus2d(4, 4, 20 * GB, 5e-7),
        "mesh": topo.mesh2d(3, 4, 15 * GB, 1e-6),
        "fat tree": topo.fat_tree(32, 25 * GB, 1e-6, radix=8),
        "fat tree, ragged": topo.fat_tree(13, 25 * GB, 1e-6, radix=8),
        "multi-node rail": topo.multi_node(4, 4, 450 * GB, 50 * GB, 1e-6, 2e-6),
        "multi-node switch": topo.multi_node(3, 4, 450 * GB, 50 * GB, 0.0, 0.0, fabric="switch"),
        "dgx1": topo.dgx1(25 * GB, 1e-6),
        "pcie": topo.pcie_tree(6, 16 * GB, 1e-6),
    }


@pytest.mark.no_cover
@pytest.mark.parametrize("mode", ["latency", "hops"])
@pytest.mark.parametrize("name", list(builders()))
def test_batched_routes_are_the_reference_routes(name, mode):
    g = builders()[name]
    nodes = list(g.nodes)
    pairs = [(a, b) for a in nodes for b in nodes]
    want = reference_paths(g, pairs, mode)
    got = Routes(g, mode).paths_links(pairs)
    assert [same(x, y) for x, y in zip(got, want, strict=True)] == [True] * len(pairs)
    check_truth(g, pairs, got, mode)
    # the per-pair walk (path_links) agrees, and so do pairs asked one by one, out of order
    r = Routes(g, mode)
    assert all(same(r.path_links(a, b), y) for (a, b), y in zip(pairs, want, strict=True))
    r = Routes(g, mode)
    rev = pairs[::-1]
    r.paths_links(rev[: len(rev) // 3])
    assert all(same(x, y) for x, y in zip(r.paths_links(pairs), want, strict=True))
    # candidates looked up by value (as at a big rail leaf) at every node with several
    # in-links, and at some
    _by_value(lambda: Routes(g, mode).paths_links(pairs), want)


def _by_value(walk, want):
    from networks.routing import tuning

    old = tuning.BIG_IN, tuning.SHARED_ASKS
    try:
        # every node with several in-links; those with three or more; those also asked by
        # two walkers with one row
        for tuning.BIG_IN, tuning.SHARED_ASKS in ((1, 1), (2, 1), (1, 2)):
            got = walk()
            assert [same(x, y) for x, y in zip(got, want, strict=True)] == [True] * len(want)
    finally:
        tuning.BIG_IN, tuning.SHARED_ASKS = old


@pytest.mark.no_cover
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), mode=st.sampled_from(["latency", "hops"]))
def test_batched_routes_on_random_graphs(seed, mode):
    g = random_graph(seed)
    nodes = list(g.nodes)
    pairs = [(a, b) for a in nodes for b in nodes]
    got = Routes(g, mode).paths_links(pairs)
    want = reference_paths(g, pairs, mode)
    assert [same(x, y) for x, y in zip(got, want, strict=True)] == [True] * len(pairs)
    check_truth(g, pairs, got, mode)
    _by_value(lambda: Routes(g, mode).paths_links(pairs), want)


def test_bounded_rows_and_chunks_give_the_same_routes(monkeypatch):
    # tiny row budgets: one source per chunk, so a chunk boundary falls between every pair
    from networks.routing import tuning

    g = topo.torus2d(5, 5, 20 * GB, 1e-6)
    topo.set_link(g, 0, 1, bandwidth=5 * GB, latency=3e-6)
    pairs = [(a, b) for a in range(25) for b in range(25)]
    want = reference_paths(g, pairs)
    monkeypatch.setattr(tuning, "HUB_ROWS_BYTES", 1)
    got = Routes(g).paths_links(pairs)
    assert all(same(x, y) for x, y in zip(got, want, strict=True))
    # and in-links weighed a few at a time (a slice boundary inside most nodes' in-links)
    monkeypatch.setattr(tuning, "HUB_ROWS_BYTES", 2**28)
    monkeypatch.setattr(tuning, "CANDIDATES", 3)
    got = Routes(g).paths_links(pairs)
    assert all(same(x, y) for x, y in zip(got, want, strict=True))
    g = _slow_links(topo.fat_tree(32, 25 * GB, 1e-6, radix=8), 9)
    pairs = [(a, b) for a in range(32) for b in range(32)]
    want = reference_paths(g, pairs)
    got = Routes(g).paths_links(pairs)
    assert all(same(x, y) for x, y in zip(got, want, strict=True))
    # GPUs that read their switches' rows (an NVSwitch and a rail leaf each): chunks of
    # one source, and of a few rows (sources whose rows are held share a chunk)
    monkeypatch.setattr(tuning, "CANDIDATES", 2**20)
    for fabric in ("rail", "switch"):
        g = topo.multi_node(4, 4, 450 * GB, 50 * GB, 1e-6, 2e-6, fabric=fabric)
        pairs = [(a, b) for a in g.nodes for b in g.nodes]
        want = reference_paths(g, pairs)
        for rows in (0, 3, 5):
            monkeypatch.setattr(tuning, "HUB_ROWS_BYTES", max(1, rows * 8 * len(g.nodes)))
            got = Routes(g).paths_links(pairs)
            assert all(same(x, y) for x, y in zip(got, want, strict=True)), (fabric, rows)
            _by_value(lambda g=g, pairs=pairs: Routes(g).paths_links(pairs), want)


def test_hub_rows_that_do_not_fit_are_searched_again(monkeypatch):
    """Leaves whose rows exceed the budget still serve their GPUs (each serves many): the
    rows that do not fit are searched again when asked, never kept under another key, and
    the paths are the reference's (at 131,072 GPUs on a fat tree, 512 leaves' rows are
    540 MB: without hubs every GPU kept a ball of the machine)."""
    from networks.routing import tuning

    g = _slow_links(topo.fat_tree(32, 25 * GB, 1e-6, radix=8), 9)
    leaf = next(iter(g.successors(31)))  # one leaf serves more: rows get replaced
    for extra in (32, 33):
        g.add_node(extra, kind="gpu")
        topo.add_link(g, extra, leaf, 25 * GB, 1e-6, kind="net")
    pairs = [(a, b) for a in range(34) for b in range(34)]
    want = reference_paths(g, pairs)
    n_nodes = len(g.nodes)
    monkeypatch.setattr(tuning, "HUB_SHARED", 4)  # 4 GPUs per leaf here (6 on one)
    for rows in (0, 1, 3):
        monkeypatch.setattr(tuning, "HUB_ROWS_BYTES", max(1, rows * 8 * n_nodes))
        r = Routes(g)
        assert r.arrays.hub, "the leaves serve 4 GPUs each: hubs stay on"
        got = r.paths_links(pairs)
        assert all(same(x, y) for x, y in zip(got, want, strict=True)), rows
        assert len(r.rows._hub_rows) <= rows
        # one pair at a time, through the rows that were (or were not) kept
        assert all(same(r.walk_links(*pairs[i]), want[i]) for i in range(0, len(pairs), 37))
    # few GPUs per hub: off, as before (each source searches its own ball)
    monkeypatch.setattr(tuning, "HUB_SHARED", 10**6)
    monkeypatch.setattr(tuning, "HUB_ROWS_BYTES", 1)
    r = Routes(g)
    assert not r.arrays.hub
    assert all(same(x, y) for x, y in zip(r.paths_links(pairs), want, strict=True))


@pytest.mark.parametrize("seed", range(40))
def test_rows_through_the_core_equal_a_search_of_the_whole_graph(seed):
    """A full row searched over the core (pendant GPUs, one link out and one in with one
    neighbour, filled in from it) is the whole graph's search, bit for bit: random graphs
    with pendant GPUs hung on their nodes by links slower one way than the other (an
    out-link's weight used for the in-link would differ), a pair of GPUs joined only to
    each other (neither pendant), and the builders."""
    from scipy.sparse.csgraph import dijkstra

    rng = np.random.default_rng(seed)
    g = random_graph(seed)
    hosts = list(g.nodes)
    for i in range(int(rng.integers(1, 6))):
        p = f"p{i}"
        g.add_node(p, kind="gpu")
        at = hosts[int(rng.integers(len(hosts)))]
        topo.add_link(g, p, at, 25 * GB, float(rng.choice([0.0, 1e-6])))
        topo.add_link(g, at, p, float(rng.choice([10, 25])) * GB, float(rng.choice([0.0, 3e-6])))
    g.add_node("q0", kind="gpu")
    g.add_node("q1", kind="gpu")
    topo.add_link(g, "q0", "q1", 10 * GB, 1e-6)
    graphs = [g] + ([] if seed else list(builders().values()))
    pendants = 0
    for h in graphs:
        for mode in ("latency", "hops"):
            r = Routes(h, mode)
            if h is g:
                assert not {"q0", "q1"} & {r.nodes[k] for k in r.arrays.pend}
            pendants += len(r.arrays.pend)
            for x in range(len(r.nodes)):
                assert np.array_equal(r.rows.search_row(x), dijkstra(r.arrays.csr, indices=x)), (
                    h,
                    x,
                )
    assert pendants > 0  # the core path was taken


def _dual_rail(n: int = 6):
    """Every GPU on two leaf switches by equal network links (dual-rail NICs)."""
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(i, kind="gpu")
    for sw in ("a", "b"):
        g.add_node(sw, kind="switch")
        for i in range(n):
            topo.add_link(g, i, sw, 50 * GB, 1e-6, kind="net")
    return g


def test_gpus_on_two_equal_rails_spread_over_both():
    """Dual-rail GPUs: between two GPUs both switches are on a shortest path, exactly as
    long as the lower bound that decides whether a switch's row is read, so neither may be
    dropped (ECMP picks)."""
    g = _dual_rail()
    pairs = [(i, j) for i in range(6) for j in range(6)]
    want = reference_paths(g, pairs)
    assert {tuple(want[k]) for k in range(len(pairs)) if len(want[k]) == 2} != set()
    assert {list(g.edges())[p[0]][1] for p in want if len(p) == 2} == {"a", "b"}
    r = Routes(g)
    assert all(same(r.path_links(a, b), y) for (a, b), y in zip(pairs, want, strict=True))
    assert all(same(x, y) for x, y in zip(Routes(g).paths_links(pairs), want, strict=True))


def test_unreachable_pairs_are_none_and_the_network_names_the_first():
    g = topo.ring(4, 10 * GB, 1e-6)
    g.add_node(9, kind="gpu")
    topo.add_link(g, 9, 0, 10 * GB, 1e-6, both=False)  # 9 sends, nothing reaches it
    pairs = [(a, b) for a in [0, 1, 2, 3, 9] for b in [0, 1, 2, 3, 9]]
    got = Routes(g).paths_links(pairs)
    assert [x is None for x in got] == [b == 9 and a != 9 for a, b in pairs]
    check_truth(g, pairs, got)
    net = PacketSwitchNetwork(simpy.Environment(), g)
    with pytest.raises(Exception, match="from GPU 2 to GPU 9"):
        net.transfer_group([(9, 1, 1e6), (2, 9, 1e6), (1, 9, 1e6)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0, 1e-3), min_size=0, max_size=40), min_size=1, max_size=30))
def test_path_latencies_are_each_paths_own_float_sum(lists):
    lat = np.array([x for xs in lists for x in xs] + [0.0])
    paths, k = [], 0
    for xs in lists:
        paths.append(np.arange(k, k + len(xs)))
        k += len(xs)
    want = [float(lat[p].sum()) if len(p) else 0.0 for p in paths]
    got = path_latencies(lat, paths)
    assert [x.hex() for x in got] == [float(x).hex() for x in want]


@pytest.mark.parametrize("name", ["fat tree", "torus", "multi-node rail", "one-way ring"])
def test_all_to_all_on_both_engines_ends_alike(name):
    # the reference engine routes pair by pair, the fast one in one batch
    ends = {}
    for engine in ("fast", "reference"):
        g = builders()[name]
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, g, engine=engine)
        gpus = list(net.gpus)
        events = net.transfer_group(
            [
                (a, b, 1e6 + 1e3 * i)
                for i, (a, b) in enumerate((a, b) for a in gpus for b in gpus if a != b)
            ]
        )
        env.run()
        ends[engine] = [e.value.end for e in events]
    assert ends["fast"] == ends["reference"]


# -- the NCCL model before its path data were batched and cached -----------------------------
class _OldAnalysis(GroupAnalysis):
    """The group analysis's path data as first written: one route and one numpy
    reduction per hop, per call."""

    def _analyse(self, group, s=None, rings=None) -> _Group:
        s = s or System(
            self.graph, group, self.routes, self.partition, self.capacity * self.efficiency
        )
        rings = rings if rings is not None else s.rings()
        info = _Group(
            s, None, rings, [1.0 / len(rings)] * len(rings), [self.both_ways(r) for r in rings]
        )
        fresh = super()._analyse(group, s, rings)  # the tuner graphs: compared through plans
        info.graphs = fresh.graphs
        return info

    def _path(self, a, b):
        return self.routes.walk_links(a, b)

    def both_ways(self, ring) -> bool:
        return all(len(self._path(b, a)) == len(self._path(a, b)) for a, b in _hops(ring))

    def unit_time(self, streams, effective=False) -> float:
        load = np.zeros(len(self.links))
        for a, b, x in streams:
            np.add.at(load, self._path(a, b), x)
        cap = self.capacity * (self.efficiency if effective else 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(np.max(np.where(load > 0, load / cap, 0.0), initial=0.0))


class _OldNccl(Nccl):
    """The planning code's path data as first written (`_OldAnalysis`), per call (the
    choice among layouts and pairs is the model's own)."""

    def __init__(self, env, net, options=None, **kwargs):
        super().__init__(env, net, options, **kwargs)
        self.analysis = _OldAnalysis(net, self.options, self.arch)

    def _p2p_terms(self, info, op, nbytes) -> Terms:
        a = self.analysis
        streams = a.structure(info, op, "p2p")
        unit = a.unit_time(streams, effective=True)
        hw = "net" if info.system.N > 1 else info.system.intra_hw
        lat_us = P.BASE_LAT["ring"][2] + P.HW_LAT[hw]["ring"][2]
        bw = 1 / unit / 1e9 if unit > 0 else math.inf
        raw = a.unit_time(streams)
        return Terms(op, "p2p", "Simple", float(nbytes), lat_us, bw, 0.0, 0, 0, streams, raw, info)

    def _pair_terms(self, info, op, group, algo, proto, nbytes, root) -> Terms | None:
        from extrapolators.communication.nccl import tuner
        from extrapolators.communication.nccl.model import PIPELINED, PROTO_WIRE

        g = info.graphs
        lat_us, bw = tuner.model(g, op, algo, proto)
        if bw <= 0:
            return None
        used, full = tuner.channels_used(g, op, algo, proto, nbytes, None)
        if used < full:
            bw = min(bw, tuner.model(g, op, algo, proto, ll_cap=False)[1] * used / full)
        bw *= tuner.tree_correction(op, algo, proto, nbytes)
        lat_us *= tuner.plateau(g, op, algo, proto, nbytes)
        root = root if root in group else group[0]
        streams = self.analysis.structure(
            info, op, algo, root if op in ("broadcast", "reduce") else None
        )
        extra = self._old_extra(info, op, algo, proto, streams)
        staged = algo in PIPELINED or op in ("broadcast", "reduce")
        depth = self._depth(info, op, algo) if staged else 0
        raw = self.analysis.unit_time(streams) * PROTO_WIRE[proto]
        return Terms(
            op, algo, proto, float(nbytes), lat_us, bw, extra, depth, used, streams, raw, info
        )

    def _plan(self, op, group, nbytes, root, algorithm) -> Plan:
        from extrapolators.communication.nccl.model import PROTO_WIRE

        terms = self.terms(op, group, nbytes, root, algorithm)
        latency, fill, bw_time = terms.parts(self.tuning)
        wire = PROTO_WIRE[terms.proto] * nbytes
        out = [(a, b, x * wire) for a, b, x in terms.streams if x * wire > 0]
        out = [(a, b, y, y / bw_time if bw_time > 0 else math.inf) for a, b, y in out]
        a = self.analysis
        path_lat = [float(a.link_latency[a._path(x, y)].sum()) for x, y, *_ in out]
        return Plan(
            op,
            terms.algo,
            terms.proto,
            nbytes,
            out,
            path_lat,
            latency,
            fill,
            bw_time,
            terms.channels,
        )

    def _old_extra(self, info, op, algo, proto, streams) -> float:
        s = info.system
        p = P.PROTOS.index(proto)
        kind_lat = {
            False: P.HW_LAT[s.intra_hw][algo][p] * 1e-6,
            True: P.HW_LAT["net"][algo][p] * 1e-6,
        }

        an = self.analysis

        def excess(a, b):
            links = an._path(a, b)
            is_net = bool((an.link_kind[links] == "net").any())
            return max(0.0, float(an.link_latency[links].sum()) - kind_lat[is_net])

        if algo == "ring" and op in ("allreduce", "all_gather", "reduce_scatter"):
            steps = 2 * (s.n - 1) if op == "allreduce" else s.n - 1
            worst = 0.0
            for ring in info.rings:
                for order in (ring, ring[::-1]) if an.both_ways(ring) else (ring,):
                    e = np.array([excess(a, b) for a, b in _hops(order)])
                    worst = max(worst, _old_window_max(e, steps))
            return worst
        ex = [excess(a, b) for a, b, _ in streams]
        if op in ("broadcast", "reduce"):
            return sum(sorted(ex)[-(s.n - 1) :]) if ex else 0.0
        return 2 * max(ex, default=0.0)


def _old_window_max(e, steps):
    n = len(e)
    if n == 0 or steps <= 0:
        return 0.0
    full, part = divmod(steps, n)
    c = np.concatenate([[0.0], np.cumsum(np.concatenate([e, e]))])
    partial = max(c[i + part] - c[i] for i in range(n)) if part else 0.0
    return full * float(e.sum()) + float(partial)


def _slow_links(g, seed):
    rng = np.random.default_rng(seed)
    for u, v in list(g.edges()):
        if rng.random() < 0.3:
            topo.set_link(
                g,
                u,
                v,
                bandwidth=float(rng.uniform(5, 60)) * GB,
                latency=float(rng.choice([0.0, 2e-6, 7e-6])),
            )
    return g


def nccl_cases():
    return {
        "fat tree": lambda: topo.fat_tree(32, 25 * GB, 1e-6, radix=8),
        "slow fat tree": lambda: _slow_links(topo.fat_tree(24, 25 * GB, 1e-6, radix=8), 1),
        "multi-node": lambda: topo.multi_node(
            4, 4, 450 * GB, 50 * GB, 1e-6, 2e-6, nvls=True, sharp=True
        ),
        "slow multi-node": lambda: _slow_links(
            topo.multi_node(3, 4, 450 * GB, 50 * GB, 1e-6, 8e-6), 2
        ),
        "ring": lambda: _slow_links(topo.ring(9, 20 * GB, 3e-6), 3),
        "one-way ring": lambda: topo.ring(6, 20 * GB, 3e-6, bidirectional=False),
        "dgx1": lambda: topo.dgx1(25 * GB, 1e-6),
        "torus": lambda: _slow_links(topo.torus2d(3, 4, 20 * GB, 5e-7), 4),
    }


@pytest.mark.parametrize("name", list(nccl_cases()))
def test_nccl_plans_are_those_of_the_per_hop_code(name):
    build = nccl_cases()[name]
    models = []
    for cls in (Nccl, _OldNccl):
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, build())
        m = cls(env, net, NcclOptions(), gpu="H100")
        if cls is _OldNccl:
            m.analysis.routes = Routes(net.graph)  # its own routes, walked pair by pair
        models.append(m)
    new, old = models
    gpus = list(new.net.gpus)
    groups = [tuple(gpus), tuple(gpus[::2]), tuple(gpus[1:5])]
    for group in groups:
        for op in (
            "allreduce",
            "all_gather",
            "reduce_scatter",
            "broadcast",
            "reduce",
            "all_to_all",
            "sendrecv",
        ):
            for nbytes in (0.0, 4e3, 3e6):  # (1 GB dropped: a quarter of the time, for the suite)
                for algo in (None, "ring", "tree", "nvls", "collnet"):
                    args = (op, group, nbytes, group[-1], algo)
                    try:
                        a = new.plan(*args)
                    except ConfigError:  # an algorithm the group lacks: refused by both
                        with pytest.raises(ConfigError):
                            old.plan(*args)
                        continue
                    b = old.plan(*args)
                    assert a == b, (group, args)
                    assert [x.hex() for x in a.path_latency] == [x.hex() for x in b.path_latency]
                    assert (a.latency.hex(), a.bandwidth_time.hex()) == (
                        b.latency.hex(),
                        b.bandwidth_time.hex(),
                    )


def test_window_max_is_the_loop_it_replaced():
    from extrapolators.communication.nccl.model import _window_max

    rng = np.random.default_rng(5)
    for n in range(1, 12):
        e = rng.choice([0.0, 1e-6, 3.3e-6, 7e-7], n)
        for steps in range(0, 3 * n + 2):
            assert _window_max(e, steps).hex() == _old_window_max(e, steps).hex()


def test_ring_streams_unit_time_is_the_per_stream_sum():
    g = _slow_links(topo.torus2d(3, 3, 20 * GB, 1e-6), 7)
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, g)
    new = Nccl(env, net, NcclOptions(), gpu="H100")
    old = _OldNccl(env, net, NcclOptions(), gpu="H100")
    rings = [list(range(9)), [0, 4, 8, 3, 7, 2, 6, 1, 5]]
    streams = nccl_streams.ring(rings, [0.3, 0.7], [True, False], 16 / 9)
    for eff in (False, True):
        assert (
            new.analysis.unit_time(streams, eff).hex() == old.analysis.unit_time(streams, eff).hex()
        )


def _hop_rows_both_ways(g, group, mode="latency"):
    """hop_rows from trees bounded to the group (or a server's search), from whole trees
    (targets=None) with no shared hub spread or server search, and with every hub's
    spread tried (SPREAD_DEGREE -1: any hub)."""
    from extrapolators.communication.rings import hop_rows
    from networks.routing import tuning

    r = Routes(g, mode)
    bounded = hop_rows(g, r, group, group)
    _SERVER_USED.append(r.server_hop_rows(group, group) is not None)
    r = Routes(g, mode)
    full_trees = r.trees
    r.trees = lambda sources, targets=None: full_trees(sources)  # the unbounded search
    r.hub_hop_rows = r.server_hop_rows = lambda sources, targets: None
    whole = hop_rows(g, r, group, group)
    old, tuning.SPREAD_DEGREE = tuning.SPREAD_DEGREE, -1
    try:
        r = Routes(g, mode)
        spread = hop_rows(g, r, group, group)
        used = r.hub_hop_rows(group, group) is not None
    finally:
        tuning.SPREAD_DEGREE = old
    assert _same_rows(spread, whole), ("hub spread", group)
    _SPREAD_USED.append(used)
    return bounded, whole


_SPREAD_USED: list = []  # whether each comparison above went through a hub's spread
_SERVER_USED: list = []  # whether a server's search answered it (when no spread did)


def _same_rows(a, b):
    return all(
        np.array_equal(x, y)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


@pytest.mark.parametrize("name", list(builders()))
def test_bounded_trees_give_the_hop_rows_of_whole_trees(name):
    g = builders()[name]
    gpus = [v for v, d in g.nodes(data=True) if d.get("kind", "gpu") == "gpu"]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for k in (2, 3, len(gpus)):
        group = [gpus[int(i)] for i in rng.choice(len(gpus), min(k, len(gpus)), replace=False)]
        assert _same_rows(*_hop_rows_both_ways(g, group)), (name, group)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), mode=st.sampled_from(["latency", "hops"]))
def test_bounded_trees_on_random_graphs(seed, mode):
    # unreachable targets, infinite links and one-way links included
    g = random_graph(seed)
    gpus = [v for v, d in g.nodes(data=True) if d.get("kind", "gpu") == "gpu"]
    group = gpus[: 2 + seed % max(1, len(gpus) - 1)]
    assert _same_rows(*_hop_rows_both_ways(g, group, mode))


def test_hub_spreads_were_compared():
    """The comparisons above went through hub spreads (fat trees, PCIe trees, GPUs behind
    an NVSwitch and a rail leaf, GPUs on two equal rails) and past them; run after them
    (file order)."""
    graphs = [builders()[name] for name in ("fat tree", "pcie", "multi-node rail")]
    graphs += [_dual_rail(), builders()["ring"]]
    for g in graphs:
        gpus = [v for v, d in g.nodes(data=True) if d.get("kind", "gpu") == "gpu"]
        _hop_rows_both_ways(g, gpus[:4])
        _hop_rows_both_ways(g, gpus[::3])
    # a ring's GPUs have links to GPUs
    assert _SPREAD_USED[-10:] == [True] * 8 + [False] * 2


def _diamond(inv_a: tuple, inv_b: tuple):
    """GPU 0 -> hub x -> two ways (x-a-y, x-b-y) -> y -> GPU 1, links given in units of
    2**-10 ns per byte of 1/bandwidth, no latency: the two ways are equally long."""
    g = nx.DiGraph()
    g.add_node(0, kind="gpu")
    g.add_node(1, kind="gpu")
    for v in "xaby":
        g.add_node(v, kind="switch")

    def bw(inv):
        return 2**10 * 1e9 / inv

    topo.add_link(g, 0, "x", bw(10), 0.0)
    topo.add_link(g, "x", "a", bw(inv_a[0]), 0.0)
    topo.add_link(g, "a", "y", bw(inv_a[1]), 0.0)
    topo.add_link(g, "x", "b", bw(inv_b[0]), 0.0)
    topo.add_link(g, "b", "y", bw(inv_b[1]), 0.0)
    topo.add_link(g, "y", 1, bw(10), 0.0)
    return g, bw


def test_hub_spread_declines_when_equal_cost_paths_differ_in_bottleneck(monkeypatch):
    from extrapolators.communication.rings import hop_rows
    from networks.routing import tuning

    monkeypatch.setattr(tuning, "SPREAD_DEGREE", -1)
    # 100 + 300 = 200 + 200 units: two equal-cost ways, bottlenecks 1/300 and 1/200
    g, bw = _diamond((100, 300), (200, 200))
    assert Routes(g).hub_hop_rows([0], [1]) is None
    ((b, _, hops),) = hop_rows(g, Routes(g), [0], [1])  # a tree's own choice
    assert b[0] in (bw(300), bw(200)) and hops[0] == 4
    # the b way 1 ns longer: one shortest way, bottleneck 1/300 (hand-worked)
    g, bw = _diamond((100, 300), (150, 260))
    topo.set_link(g, "x", "b", latency=1e-9)
    ((b, lat, hops),) = Routes(g).hub_hop_rows([0], [0, 1])
    assert b[1] == bw(300) and hops.tolist() == [0.0, 4.0] and b[0] == np.inf
    # equal costs and equal bottlenecks (1/300 on both): the spread answers
    g, bw = _diamond((100, 300), (300, 100))
    ((b, _, hops),) = Routes(g).hub_hop_rows([0], [1])
    assert b[0] == bw(300) and hops[0] == 4


def test_spread_declines_when_two_rails_tie_with_other_bottlenecks(monkeypatch):
    """GPUs on two rails whose ways are equally long (100 + 300 = 200 + 200 units of 1/bw)
    but with other bottlenecks: which a tree takes decides the answer, so no spread; with
    the same bottleneck on both rails it answers (hand-worked: 1/300)."""
    from networks.routing import tuning

    monkeypatch.setattr(tuning, "SPREAD_DEGREE", -1)

    def bw(inv):
        return 2**10 * 1e9 / inv

    def rails(a: tuple, b: tuple):
        g = nx.DiGraph()
        for i in range(3):
            g.add_node(i, kind="gpu")
        for sw, (up, down) in (("a", a), ("b", b)):
            g.add_node(sw, kind="switch")
            for i in range(3):
                topo.add_link(g, i, sw, bw(up), 0.0, kind="net", both=False)
                topo.add_link(g, sw, i, bw(down), 0.0, kind="net", both=False)
        return g

    assert Routes(rails((100, 300), (200, 200))).hub_hop_rows([0], [1, 2]) is None
    assert Routes(rails((200, 200), (100, 300))).hub_hop_rows([0], [1, 2]) is None
    ((b, _, hops),) = Routes(rails((100, 300), (300, 100))).hub_hop_rows([0], [0, 1, 2])
    assert b.tolist() == [np.inf, bw(300), bw(300)] and hops.tolist() == [0, 2, 2]


def test_server_searches_were_compared():
    """The comparisons above went through servers' searches (random graphs without
    network links are one server; groups inside a rail cluster's server) and past them
    (groups across servers); run after them (file order)."""
    assert True in _SERVER_USED and False in _SERVER_USED
    g = builders()["multi-node rail"]
    r = Routes(g)
    assert r.server_hop_rows([0, 1, 2, 3], [0, 1, 2, 3]) is not None
    assert r.server_hop_rows([0, 1], [0, 4]) is None  # GPU 4 is in the next server


def _two_switch_servers(n: int = 3):
    """n alike servers of 4 GPUs, each GPU on two equal NVSwitches (every pair inside a
    server ties: ECMP hashes the names, so alike servers walk differently), joined by a
    network switch."""
    g = nx.DiGraph()
    for k in range(n):
        for i in range(4):
            g.add_node(4 * k + i, kind="gpu")
        for sw in (f"x{k}", f"y{k}"):
            g.add_node(sw, kind="switch")
            for i in range(4):
                for a, b in ((4 * k + i, sw), (sw, 4 * k + i)):
                    g.add_edge(a, b, bandwidth=300 * GB, latency=0.5e-6, kind="nvlink")
    g.add_node("ib", kind="switch")
    for v in range(4 * n):
        for a, b in ((v, "ib"), ("ib", v)):
            g.add_edge(a, b, bandwidth=50 * GB, latency=1e-6, kind="net")
    return g


@pytest.mark.parametrize(
    "name", ["multi-node rail", "multi-node switch", "dgx1", "torus", "two-switch servers"]
)
def test_server_walks_are_the_reference_routes(name):
    """Pairs inside one server are walked there (a rail cluster's servers; a DGX-1 or a
    torus without network links is one server), the same links as the reference walk;
    pairs across servers are left to the machine's walk. Alike servers share their
    walks where no tie is met (the rail cluster's); where ties are (two switches per
    server) each pair is walked with its own hash."""
    g = _two_switch_servers() if name == "two-switch servers" else builders()[name]
    gpus = [v for v, d in g.nodes(data=True) if d.get("kind", "gpu") == "gpu"]
    pairs = [(a, b) for a in gpus for b in gpus if a != b]
    got = Routes(g).server_walks(pairs)
    want = dict(zip(pairs, reference_paths(g, pairs), strict=True))
    local = Routes(g).arrays.local
    idx = Routes(g).node_index
    inside = {p for p in pairs if local[idx[p[0]]] == local[idx[p[1]]]}
    assert set(got) == inside and inside
    assert all(got[p].tolist() == want[p] for p in inside)


def test_alike_servers_share_hop_rows_only_where_their_bandwidths_agree():
    """Three servers of one shape; the third with one NVLink at a third of the speed:
    the first two share one answer, the third gets its own, each the whole trees'."""
    from extrapolators.communication.rings import hop_rows

    g = topo.multi_node(3, 4, 450 * GB, 50 * GB, 1e-6, 2e-6)
    g.edges[9, "nvswitch2"]["bandwidth"] = 150 * GB
    r = Routes(g)
    groups = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    got = [hop_rows(g, r, grp, grp) for grp in groups]
    assert got[0][0][0] is got[1][0][0]  # shared, not searched again
    for grp, rows in zip(groups, got, strict=True):
        whole = Routes(g)
        whole.hub_hop_rows = whole.server_hop_rows = lambda sources, targets: None
        assert _same_rows(rows, hop_rows(g, whole, grp, grp)), grp
    assert got[2][1][0].tolist() == [150 * GB, np.inf, 150 * GB, 150 * GB]


def test_server_search_declines_when_equal_paths_have_other_bottlenecks():
    """One server: GPU 0 reaches GPU 1 through switch x or switch y, both 2 hops and 1 us;
    through x the slowest link carries 100 GB/s, through y 300: a tree's tie-break would
    pick the bottleneck, so the search gives no answer. With both at 300 it answers, and
    its answer is the tree's (hand-worked: 300 GB/s, 2 hops, 1 us)."""
    import networkx as nx

    from extrapolators.communication.rings import hop_rows

    def server(bw_x):
        g = nx.DiGraph()
        g.add_nodes_from([0, 1], kind="gpu")
        g.add_nodes_from(["x", "y"], kind="switch")
        for sw, bw in (("x", bw_x), ("y", 300 * GB)):
            for a, b in ((0, sw), (sw, 0), (1, sw), (sw, 1)):
                g.add_edge(a, b, bandwidth=bw, latency=0.5e-6, kind="nvlink")
        return g

    assert Routes(server(100 * GB)).server_hop_rows([0], [1]) is None
    ((b, d, hops),) = Routes(server(300 * GB)).server_hop_rows([0], [0, 1])
    assert b.tolist() == [np.inf, 300 * GB] and hops.tolist() == [0, 2]
    ((b2, lat, h2),) = hop_rows(server(300 * GB), Routes(server(300 * GB)), [0], [0, 1])
    assert lat == pytest.approx([0.0, 1e-6], rel=1e-12) and b2.tolist() == b.tolist()


def test_gpus_under_a_big_switch_share_its_spread():
    """A star bigger than SPREAD_DEGREE: the default threshold takes the spread, and its
    rows are the bounded trees'."""
    from extrapolators.communication.rings import hop_rows
    from networks.routing import tuning

    g = topo.switch_star(tuning.SPREAD_DEGREE + 4, 25 * GB, 1e-6)
    group = list(range(0, 40, 5))
    r = Routes(g)
    assert r.hub_hop_rows(group, group) is not None
    r.hub_hop_rows = lambda sources, targets: None
    assert _same_rows(hop_rows(g, Routes(g), group, group), hop_rows(g, r, group, group))


def test_many_sources_under_small_switches_share_their_spreads():
    """An FSDP group of 16 GPUs, GPU 0 of 16 servers (one rail leaf of 20 ports, far below
    SPREAD_DEGREE): 16 sources take the rail's spread (16 trees before), with the rows of
    whole trees; a group of fewer than SPREAD_SOURCES sources keeps its trees."""
    from extrapolators.communication.rings import hop_rows
    from networks.routing import tuning

    g = topo.multi_node(16, 4, 300 * GB, 50 * GB, 1e-6, 2e-6)
    group = [4 * k for k in range(16)]
    assert tuning.SPREAD_SOURCES <= len(group) and g.out_degree("rail0") < tuning.SPREAD_DEGREE
    assert Routes(g).hub_hop_rows(group, group) is not None
    few = group[: tuning.SPREAD_SOURCES - 1]
    assert Routes(g).hub_hop_rows(few, few) is None
    r = Routes(g)
    full_trees = r.trees
    r.trees = lambda sources, targets=None: full_trees(sources)  # the unbounded search
    r.hub_hop_rows = r.server_hop_rows = lambda sources, targets: None
    assert _same_rows(hop_rows(g, Routes(g), group, group), hop_rows(g, r, group, group))


@pytest.mark.parametrize("name", ["fat tree", "multi-node switch", "ring", "dgx1", "pcie"])
def test_ring_order_shortcut_for_alike_hops_is_the_search(name, monkeypatch):
    """Groups whose hops are all alike take a shortcut: the same order as the search."""
    from extrapolators.communication import rings

    g = builders()[name]
    gpus = [v for v, d in g.nodes(data=True) if d.get("kind", "gpu") == "gpu"]
    groups = [gpus[:k] for k in (3, 4, 8)] + [gpus[1::2][:4], gpus[::-1][:5]]
    fast = [rings.ring_order(g, grp) for grp in groups]
    monkeypatch.setattr(rings, "_uniform", lambda m: False)
    assert fast == [rings.ring_order(g, grp) for grp in groups]


def _extra_rings_by_scan(s: System, first: list) -> list:
    """The extra rings as first written: direct links found by a scan of every edge."""
    import networkx as nx

    from extrapolators.communication.nccl.system import MAX_EXTRA_RINGS, _hamiltonian_cycle

    direct = nx.Graph()
    members = set(s.group)
    for u, v in s.graph.edges():
        if u in members and v in members and s.graph.has_edge(v, u):
            direct.add_edge(u, v)
    hops = list(zip(first, first[1:] + first[:1], strict=True))
    if not all(direct.has_edge(a, b) for a, b in hops):
        return []
    direct.remove_edges_from(hops)
    out = []
    while len(out) < MAX_EXTRA_RINGS:
        ring = _hamiltonian_cycle(direct, first)
        if ring is None:
            break
        out.append(ring)
        direct.remove_edges_from(zip(ring, ring[1:] + ring[:1], strict=True))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_extra_rings_from_the_groups_links_are_those_of_the_edge_scan(seed):
    rng = np.random.default_rng(seed)
    n = 8
    g = nx.DiGraph()
    order = rng.permutation(n).tolist()  # nodes added out of id order
    for i in order:
        g.add_node(i, kind="gpu")
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.7]
    pairs += [(i, (i + 1) % n) for i in range(n)]  # a ring, so that there is a first ring
    for k in rng.permutation(len(pairs)).tolist():
        topo.add_link(g, *pairs[k], 25 * GB, 1e-6)
    for group in (tuple(range(n)), tuple(order[:5]), (0, 2, 4, 6)):
        s = System(g, group)
        first = list(s.order)
        assert s._extra_rings(first) == _extra_rings_by_scan(s, first), (seed, group)


def _net_bound_both_ways(g, seed: int) -> None:
    """RouteGraph.net_bound with the neighbour rule (a few neighbours: 1 + their least
    count) equals each component's own search (`NEIGHBOUR_RULE` 0), on every pair of
    components and on random (a, b) arrays with repeats."""
    from networks.routing.graph import RouteGraph

    rng = np.random.default_rng(seed)
    n = int(RouteGraph(g).local.max()) + 1
    a = np.repeat(np.arange(n), n)
    b = np.tile(np.arange(n), n)
    extra = rng.integers(0, n, (2, 50))
    a, b = np.concatenate([a, extra[0]]), np.concatenate([b, extra[1]])
    rule, plain = RouteGraph(g), RouteGraph(g)
    plain.NEIGHBOUR_RULE = 0
    got, want = rule.net_bound(a, b), plain.net_bound(a, b)
    assert np.array_equal(got, want), np.flatnonzero(got != want)
    assert len(plain._comp_hops) >= len(rule._comp_hops)  # (no more searches than before)


@pytest.mark.parametrize("name", list(builders()))
def test_net_bound_via_neighbours_is_each_components_search(name):
    _net_bound_both_ways(builders()[name], 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31))
def test_net_bound_via_neighbours_on_random_graphs(seed):
    _net_bound_both_ways(random_graph(seed), seed)


def test_net_bound_neighbour_rule_without_the_own_component_fails(monkeypatch):
    """The rule needs its 0 to the component itself: without it a server's bound to its
    own GPUs would be 2 network links (out and back), and the check above says so."""
    from networks.routing.graph import RouteGraph

    real = RouteGraph._comp_hops_to

    def no_zero(self, c, targets):
        out = real(self, c, targets)
        if self.NEIGHBOUR_RULE and self._comp_hops.get(c) is None:
            out = out.copy()
            g = self._comp_graph
            nbrs = g.indices[g.indptr[c] : g.indptr[c + 1]]
            nbrs = nbrs[nbrs != c]
            if 0 < len(nbrs) <= self.NEIGHBOUR_RULE:
                own = targets == c
                out[own] = 1.0 + min(self._comp_search(w)[c] for w in nbrs.tolist())
        return out

    monkeypatch.setattr(RouteGraph, "_comp_hops_to", no_zero)
    with pytest.raises(AssertionError):
        _net_bound_both_ways(builders()["multi-node rail"], 0)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(0, 40),
    cols=st.integers(1, 5),
    scale=st.sampled_from([1, 3, 2**20, 2**40]),
    seed=st.integers(0, 2**31),
)
def test_reader_classes_are_equal_exactly_for_equal_rows(rows, cols, scale, seed):
    # a route walk's pairs that read the same rows at the same offsets share their
    # equal-cost candidates: a class per distinct row of the matrix, whatever its spread
    # (a small one is coded as one int per row, a wide one compared row by row)
    from networks.routing.walks import _row_classes

    rng = np.random.default_rng(seed)
    m = rng.integers(-scale, scale + 1, size=(rows, cols))
    m[rng.random(rows) < 0.5] = m[0] if rows else m  # (repeats)
    got = _row_classes(m)
    assert len(got) == rows
    for i in range(rows):
        for j in range(rows):
            assert (got[i] == got[j]) == bool((m[i] == m[j]).all())
