"""Ring order: the slowest hop as fast as possible, then the least latency."""

import networkx as nx
import pytest

from extrapolators.communication.rings import ring_order
from networks import topology as topo

GB = 1e9


def hops_of(order):
    return list(zip(order, order[1:] + order[:1], strict=True))


@pytest.mark.parametrize("n,slow", [(4, (0, 1)), (8, (0, 1)), (8, (3, 6)), (12, (0, 11))])
def test_fully_connected_with_one_slow_pair_avoids_it(n, slow):
    g = topo.fully_connected(n, 100 * GB, 1e-6)
    topo.set_link(g, *slow, bandwidth=10 * GB, both=True)
    order = list(ring_order(g, range(n)))
    assert sorted(order) == list(range(n))
    assert not any({a, b} == set(slow) for a, b in hops_of(order)), order


def test_one_way_ring_keeps_its_direction():
    g = topo.ring(8, GB, 1e-6, bidirectional=False)
    assert ring_order(g, range(8)) == tuple(range(8))


def test_mesh_ring_uses_neighbours_only():
    g = topo.mesh2d(3, 4, GB)
    order = list(ring_order(g, range(12)))
    assert all(nx.shortest_path_length(g, a, b) == 1 for a, b in hops_of(order))


def test_multi_node_ring_crosses_each_boundary_once_on_one_rail():
    g = topo.multi_node(2, 8, 450 * GB, 50 * GB, 1e-6, 2e-6)
    order = list(ring_order(g, range(16)))
    crossings = [(a, b) for a, b in hops_of(order) if a // 8 != b // 8]
    assert len(crossings) == 2 and all(a % 8 == b % 8 for a, b in crossings), order


def test_slow_latency_hop_is_avoided_when_bandwidths_tie():
    g = topo.fully_connected(6, 100 * GB, 1e-6)
    topo.set_link(g, 2, 3, latency=50e-6, both=True)
    assert not any({a, b} == {2, 3} for a, b in hops_of(list(ring_order(g, range(6)))))


def test_large_groups_take_the_builders_ring_without_n_squared_work():
    g = topo.torus2d(32, 32, GB)
    order = ring_order(g, range(1024))
    assert sorted(order) == list(range(1024))
    assert all(g.has_edge(a, b) for a, b in hops_of(list(order)))


def test_hinted_order_is_the_hints_filtered_and_follows_a_changed_hint():
    """The group in the hint's order (the hint filtered to the group, written out here),
    None when a GPU is missing, and a hint edited in place is read afresh."""
    from extrapolators.communication.rings import _hinted

    hint = [5, 3, 9, 0, 7, 1]
    assert _hinted(hint, [0, 9, 1, 5]) == [5, 9, 0, 1]
    assert _hinted(hint, [9, 9, 3]) == [3, 9]  # a GPU named twice: once, as the filter does
    assert _hinted(hint, [0, 2]) is None  # 2 is not on the hinted ring
    hint[0], hint[5] = 1, 5  # edited in place: same list object, new order
    assert _hinted(hint, [0, 9, 1, 5]) == [1, 9, 0, 5]
    assert _hinted([4, 4, 2], [2, 4]) == [4, 4, 2]  # a GPU twice in the hint: every copy


def test_a_group_at_the_dense_limit_routes_only_the_hops_its_candidate_rings_use(monkeypatch):
    """Issue 47's cliff: a ring of 256 GPUs (the dense search's limit) routed all 65,536
    ordered pairs to weigh its few candidate rings (7.5 s of a 1.2 s run at 512); the loads
    are now those of the pairs the candidates' hops use, at most 2 x 256 per candidate, and
    the chosen ring is the builder's own."""
    from extrapolators.communication import rings
    from networks.routing import Routes

    routed = []
    real = Routes.paths_links

    def counting(self, pairs):
        routed.extend(pairs)
        return real(self, pairs)

    monkeypatch.setattr(Routes, "paths_links", counting)
    n = 256
    g = topo.ring(n, GB, 1e-6)
    g.graph.pop("ring", None)  # no builder's hint: the dense search runs
    group = list(range(n))
    order = rings.ring_order(g, group)
    assert sorted(order) == group and all(g.has_edge(a, b) for a, b in hops_of(list(order)))
    assert 0 < len(set(routed)) <= 2 * n * 6 < n * n
