"""Routing prefers the intended path; topologies declare what their hardware is."""

import networkx as nx
import pytest
import simpy

from networks import PacketSwitchNetwork
from networks import topology as topo

GB = 1e9


def net_of(g):
    return PacketSwitchNetwork(simpy.Environment(), g)


@pytest.mark.parametrize("intra_lat,inter_lat", [(1e-6, 1e-6), (0.0, 0.0), (5e-6, 1e-6)])
def test_intra_node_traffic_never_crosses_the_inter_node_fabric(intra_lat, inter_lat):
    # the reported defect: equal latencies sent half of the intra-node pairs through the
    # InfiniBand switch; even a slower NVSwitch path must win inside a node
    for fabric in ("rail", "switch"):
        g = topo.multi_node(2, 8, 450 * GB, 50 * GB, intra_lat, inter_lat, fabric=fabric)
        net = net_of(g)
        for a in range(16):
            for b in range(16):
                if a != b and a // 8 == b // 8:
                    path = net.path(a, b)
                    assert path == [a, f"nvswitch{a // 8}", b], (fabric, a, b, path)


def test_reported_reproduction_routes_through_the_nvswitch():
    net = net_of(topo.multi_node(2, 8, 450e9, 50e9, 1e-6, 1e-6))
    assert net.path(0, 1) == [0, "nvswitch0", 1]


def test_inter_node_traffic_stays_on_its_rail_where_it_can():
    # GPU i of node 0 to GPU i of node 1: its own NIC and rail leaf, no spine
    net = net_of(topo.multi_node(4, 8, 450 * GB, 50 * GB, 1e-6, 2e-6))
    for i in range(8):
        assert net.path(i, 8 + i) == [i, f"rail{i}", 8 + i]
    # across rails: one network leaf only, reached over NVLink (PXN), never via a spine
    for a, b in [(0, 9), (3, 30)]:
        path = net.path(a, b)
        assert not any(str(x).startswith("spine") for x in path), path
        assert sum(1 for x in path if str(x).startswith("rail")) == 1


@pytest.mark.parametrize("fabric", ["rail", "switch"])
def test_across_rails_the_relay_is_at_the_sender_as_pxn(fabric):
    """NCCL's PXN: GPU i of node a sends to GPU j of node b (i != j) over NVLink to GPU j
    of node a, whose NIC is on b's rail; the NIC never writes into a relay GPU at the
    receiver. Both ways are equally long, so this is the tie-break, for every pair, walked
    one by one and in one batch. On one InfiniBand switch every NIC reaches every other:
    the direct way is shorter and no relay is taken."""
    net = net_of(topo.multi_node(4, 8, 450 * GB, 50 * GB, 1e-6, 2e-6, fabric=fabric))
    pairs = [(a, b) for a in range(32) for b in range(32) if a // 8 != b // 8]
    if fabric == "rail":  # the same rail: its own NIC; another: a relay on its node
        want = {
            (a, b): [a, f"rail{a % 8}", b]
            if a % 8 == b % 8
            else [a, f"nvswitch{a // 8}", a - a % 8 + b % 8, f"rail{b % 8}", b]
            for a, b in pairs
        }
    else:
        want = {(a, b): [a, "ib", b] for a, b in pairs}
    assert {p: net.path(*p) for p in pairs[:40]} == {p: want[p] for p in pairs[:40]}
    fresh = net_of(topo.multi_node(4, 8, 450 * GB, 50 * GB, 1e-6, 2e-6, fabric=fabric))
    links = fresh.links
    got = {}
    for (a, _), path in zip(pairs, fresh.routes.paths_links(pairs), strict=True):
        got[a, links[path[-1]][1]] = [a] + [links[k][1] for k in path]
    assert got == want


def test_latency_then_hops_and_never_bandwidth():
    """Two equal-latency paths a->b, through x or through y: which one ECMP's hash picks
    does not depend on the links' bandwidths (a slower link moves no route), a lower
    latency wins, and so does a shorter path."""
    g = nx.DiGraph()
    for n in "ab":
        g.add_node(n, kind="gpu")
    for u, v in [("a", "x"), ("x", "b"), ("a", "y"), ("y", "b")]:
        topo.add_link(g, u, v, 100 * GB, 1e-6)
    first = net_of(g).path("a", "b")
    assert first in (["a", "x", "b"], ["a", "y", "b"])
    for bw in (10 * GB, 99.9 * GB, 1000 * GB):  # the way taken made slower or faster
        h = g.copy()
        topo.set_link(h, first[0], first[1], bandwidth=bw)
        assert net_of(h).path("a", "b") == first
    # a lower-latency path wins whatever its bandwidth
    topo.set_link(g, "a", "y", bandwidth=GB, latency=0.1e-6)
    assert net_of(g).path("a", "b") == ["a", "y", "b"]
    # and at equal latency, fewer hops: a direct link of the same summed latency
    topo.add_link(g, "a", "b", GB, 1.1e-6)
    assert net_of(g).path("a", "b") == ["a", "b"]


def test_builders_declare_link_kinds_and_reducing_switches():
    g = topo.multi_node(2, 4, 450 * GB, 50 * GB, nvls=True, sharp=True)
    kinds = {d["kind"] for u, v, d in g.edges(data=True) if "nvswitch0" in (u, v)}
    assert kinds == {"nvlink"}
    assert g.edges[0, "rail0"]["kind"] == "net"
    assert g.nodes["nvswitch0"]["reduce"] == "nvls" and g.nodes["rail0"]["reduce"] == "sharp"
    assert topo.pcie_tree(4, GB).edges[0, "pcie0"]["kind"] == "pcie"
    assert "reduce" not in topo.switch_star(4, GB).nodes["nvswitch"]
    assert topo.switch_star(4, GB, nvls=True).nodes["nvswitch"]["reduce"] == "nvls"
    # the edge list a saved config records keeps kinds and reducing switches
    again = topo.from_edges(**{k: v for k, v in topo.to_edges(g).items()})
    assert again.edges[0, "rail0"]["kind"] == "net" and again.nodes["rail0"]["reduce"] == "sharp"


def test_rail_fabric_oversubscription_sets_leaf_uplinks():
    g = topo.multi_node(4, 8, 450 * GB, 50 * GB, oversubscription=2.0)
    up = sum(g.edges["rail0", f"spine{s}"]["bandwidth"] for s in range(8))
    assert up == pytest.approx(4 * 50 * GB / 2)


@pytest.mark.parametrize("rows,cols", [(3, 4), (4, 3), (2, 2), (12, 7), (4, 4)])
def test_grid_builders_know_a_ring(rows, cols):
    g = topo.mesh2d(rows, cols, GB)
    ring = g.graph["ring"]
    assert sorted(ring) == list(range(rows * cols))
    assert all(g.has_edge(a, b) for a, b in zip(ring, ring[1:] + ring[:1], strict=True))
    assert "ring" not in topo.mesh2d(3, 3, GB).graph  # odd x odd: no Hamiltonian cycle
