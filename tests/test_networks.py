import math

import networkx as nx
import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from networks import PacketSwitchNetwork, PhotonicNetwork
from networks import topology as topo
from triosim.common.errors import ConfigError, NetworkError

GB = 1e9


def run(net_cls, graph, transfers, **kw):
    env = simpy.Environment()
    net = net_cls(env, graph, **kw)
    evs = net.transfer_group(transfers) if transfers else []
    env.run()
    return net, [e.value for e in evs]


def test_lone_transfer_latency_plus_bytes_over_bandwidth():
    g = topo.ring(4, 10 * GB, 2e-6)
    _, [rec] = run(PacketSwitchNetwork, g, [(0, 1, 3e8)])
    assert rec.end == pytest.approx(2e-6 + 3e8 / (10 * GB), rel=1e-12)


def test_multi_hop_latency_adds_up():
    g = topo.ring(8, 10 * GB, 1e-6, bidirectional=False)
    _, [rec] = run(PacketSwitchNetwork, g, [(0, 3, 1e6)])
    assert rec.end == pytest.approx(3e-6 + 1e6 / (10 * GB), rel=1e-12)


@pytest.mark.parametrize("k", [2, 3, 7])
def test_k_equal_flows_finish_together_at_k_times(k):
    g = topo.ring(2, 5 * GB)
    _, recs = run(PacketSwitchNetwork, g, [(0, 1, 1e9)] * k)
    lone = 1e9 / (5 * GB)
    assert all(r.end == pytest.approx(k * lone, rel=1e-9) for r in recs)


@pytest.mark.parametrize("engine", ["fast", "reference"])
def test_textbook_max_min(engine):
    # links A (a->b) 10, B (b->c) 4, C (c->d) 10. flow 1 a->d crosses all three,
    # flow 2 b->c only B, flow 3 c->d only C. B is the bottleneck: flows 1 and 2 get 2
    # each; flow 3 takes the 8 that flow 1 leaves unused on C.
    g = nx.DiGraph()
    for u, v, bw in [("a", "b", 10), ("b", "c", 4), ("c", "d", 10)]:
        g.add_edge(u, v, bandwidth=bw, latency=0.0)
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, g, engine=engine)
    net.transfer_group([("a", "d", 1000.0), ("b", "c", 1000.0), ("c", "d", 1000.0)])
    rates = sorted(net.flow_rates())
    assert rates == pytest.approx([2.0, 2.0, 8.0])
    env.run()
    assert net.max_utilisation <= 1 + 1e-9


def test_zero_byte_transfer_takes_path_latency():
    _, [rec] = run(PacketSwitchNetwork, topo.ring(4, GB, 3e-6, bidirectional=False), [(0, 2, 0)])
    assert rec.end == pytest.approx(6e-6)


def test_bad_inputs():
    env = simpy.Environment()
    g = topo.ring(4, GB)
    with pytest.raises(NetworkError, match="disconnected"):
        bad = nx.DiGraph()
        bad.add_nodes_from([0, 1], kind="gpu")
        PacketSwitchNetwork(env, bad)
    net = PacketSwitchNetwork(env, g)
    with pytest.raises(NetworkError, match="not a GPU"):
        net.transfer(0, 9, 10)
    with pytest.raises(NetworkError, match=">= 0"):
        net.transfer(0, 1, -5)
    with pytest.raises(NetworkError, match="bandwidth"):
        topo.ring(4, 0)
    g2 = topo.ring(3, GB)
    g2.edges[0, 1]["bandwidth"] = -1
    with pytest.raises(NetworkError, match="bandwidth must be > 0"):
        PacketSwitchNetwork(env, g2)
    with pytest.raises(NetworkError, match="no GPUs"):
        PacketSwitchNetwork(env, nx.DiGraph())


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("bandwidth", 0, "bandwidth must be > 0"),
        ("bandwidth", float("nan"), "bandwidth must be > 0"),
        ("bandwidth", True, "bandwidth must be > 0"),
        ("bandwidth", "1 GB/s", "bandwidth must be > 0"),
        ("bandwidth", None, "bandwidth must be > 0"),
        ("latency", -1e-6, "latency must be finite"),
        ("latency", float("inf"), "latency must be finite"),
        ("latency", float("nan"), "latency must be finite"),
        ("latency", False, "latency must be finite"),
        ("bandwidth", np.float64(GB), None),  # numpy numbers are numbers
        ("latency", np.float64(1e-6), None),
        ("latency", 0, None),
    ],
)
def test_a_bad_link_is_named_whatever_its_type(field, value, message):
    # the checks run as arrays when every value is a plain number, else link by link: each
    # bad value is caught (and the first bad link named), whichever way it is found
    g = topo.ring(6, GB, 1e-6)
    g.edges[3, 4][field] = value
    env = simpy.Environment()
    if message is None:
        PacketSwitchNetwork(env, g)
        return
    with pytest.raises(NetworkError, match=f"link 3->4: {message}"):
        PacketSwitchNetwork(env, g)


def test_a_gpu_cut_off_is_named_whichever_way_its_links_go():
    g = topo.ring(4, GB)
    for i in (7, 8):
        g.add_node(i, kind="gpu")
    topo.add_link(g, 7, 8, GB)
    with pytest.raises(NetworkError, match=r"disconnected: GPU\(s\) 7, 8 cannot exchange"):
        PacketSwitchNetwork(simpy.Environment(), g)
    topo.add_link(g, 8, 0, GB, both=False)  # one way in: weakly connected, accepted
    PacketSwitchNetwork(simpy.Environment(), g)


def test_photonic_setup_once_then_reuse():
    g = topo.fully_connected(4, GB)
    env = simpy.Environment()
    net = PhotonicNetwork(env, g, total_bandwidth=8 * GB, links=8, setup_time=0.02)
    first = net.transfer(0, 1, 1e9)
    env.run()
    assert first.value.end == pytest.approx(0.02 + 1e9 / GB)
    t0 = env.now
    second = net.transfer(0, 1, 1e9)
    env.run()
    assert second.value.end - t0 == pytest.approx(1e9 / GB)
    assert net.setups == 1


def test_photonic_lru_teardown_when_ports_run_out():
    env = simpy.Environment()
    net = PhotonicNetwork(
        env, topo.fully_connected(4, GB), total_bandwidth=GB, links=1, ports=2, setup_time=0.01
    )
    order = []

    def user():
        for dst in (1, 2):
            yield net.transfer(0, dst, 1e6)
            order.append(dst)
            yield env.timeout(1)
        yield net.transfer(0, 1, 1e6)  # reuses the 0-1 circuit: 0-2 is now the LRU one
        yield env.timeout(1)
        yield net.transfer(0, 3, 1e6)  # no free port at 0: tear down the LRU circuit (0-2)

    env.process(user())
    env.run()
    assert net.setups == 3 and net.teardowns == 1
    assert frozenset((0, 2)) not in net.circuits and frozenset((0, 1)) in net.circuits


transfers = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 5), st.floats(0, 1e9), st.floats(0, 1e-3)),
    min_size=1,
    max_size=12,
)


def _timed(env, net, items):
    evs = []

    def go(s, d, b, t):
        yield env.timeout(t)
        evs.append((yield net.transfer(s, d, b)))

    for s, d, b, t in items:
        env.process(go(s, d, b, t))
    env.run()
    return evs


@settings(max_examples=40, deadline=None)
@given(items=transfers, bw=st.lists(st.floats(1e8, 1e11), min_size=8, max_size=8))
def test_conservation_and_capacity(items, bw):
    g = topo.torus2d(2, 3, GB, 1e-6)
    for (u, v), b in zip(list(g.edges())[:8], bw, strict=False):
        g.edges[u, v]["bandwidth"] = b
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, g)
    recs = _timed(env, net, items)
    assert len(recs) == len(items)
    assert (
        net.bytes_delivered
        == pytest.approx(net.bytes_sent)
        == pytest.approx(sum(i[2] for i in items))
    )
    assert net.in_flight == 0
    assert net.max_utilisation <= 1 + 1e-9


hops = st.lists(
    st.tuples(st.integers(0, 23), st.floats(0, 1e9), st.floats(0, 1e-3)), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None)
@given(items=hops, link=st.integers(0, 23), factor=st.floats(1.0, 100.0))
def test_more_bandwidth_never_delays_single_link_flows(items, link, factor):
    # flows of one link each, arriving at any times: raising a link's bandwidth never
    # delays any delivery (on each link, processor sharing at a higher rate)
    def ends(scale):
        g = topo.torus2d(2, 3, GB, 1e-6)
        edges = list(g.edges())
        u, v = edges[link % len(edges)]
        g.edges[u, v]["bandwidth"] *= scale
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, g)
        _timed(env, net, [(*edges[e % len(edges)], b, t) for e, b, t in items])
        return [r.end for r in net.records]

    slow, fast = ends(1.0), ends(factor)
    assert all(f <= s * (1 + 1e-9) + 1e-15 for f, s in zip(fast, slow, strict=True))


def test_max_min_is_not_monotone_per_flow_across_links():
    # why the property above is stated for single-link flows: a textbook counterexample.
    # A crosses link 1, B links 1 and 2, C link 2. Raising link 1 lets B take more of
    # link 2, so C is delivered later, although every link got at least as fast.
    def run(c1):
        g = nx.DiGraph()
        g.add_edge("a", "b", bandwidth=c1, latency=0.0)
        g.add_edge("b", "c", bandwidth=2.0, latency=0.0)
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, g)
        evs = net.transfer_group([("a", "b", 10.0), ("a", "c", 10.0), ("b", "c", 10.0)])
        env.run()
        return [e.value.end for e in evs]

    slow, fast = run(1.0), run(3.0)
    assert slow == pytest.approx([20.0, 20.0, 20 / 3])
    assert fast == pytest.approx([5.0, 10.0, 10.0])  # C: 6.67 -> 10, A and B much earlier
    assert max(fast) < max(slow)


@pytest.mark.parametrize(
    "builder,args,n",
    [
        (topo.ring, (8, GB), 8),
        (topo.ring_chord, (8, GB), 8),
        (topo.double_ring, (8, GB), 8),
        (topo.fully_connected, (5, GB), 5),
        (topo.switch_star, (6, GB), 6),
        (topo.mesh2d, (12, 7, GB), 84),
        (topo.torus2d, (4, 4, GB), 16),
        (topo.fat_tree, (64, GB, 0, 16), 64),
        (topo.pcie_tree, (8, GB), 8),
        (lambda *a: topo.dgx1(*a), (GB,), 8),
        (topo.multi_node, (2, 4, 4 * GB, GB), 8),
    ],
)
def test_builders_make_connected_graphs(builder, args, n):
    g = builder(*args)
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, g)
    assert len(net.gpus) == n
    _, [rec] = run(PacketSwitchNetwork, g, [(0, n - 1, 1e6)])
    assert math.isfinite(rec.end)


def test_ring_chord_links_most_distant_node():
    g = topo.ring_chord(8, GB)
    assert g.has_edge(0, 4) and g.has_edge(3, 7)


def test_asymmetric_link():
    g = topo.ring(2, 10 * GB)
    topo.set_link(g, 1, 0, bandwidth=1 * GB)
    _, recs = run(PacketSwitchNetwork, g, [(0, 1, 1e9), (1, 0, 1e9)])
    assert recs[0].end == pytest.approx(0.1) and recs[1].end == pytest.approx(1.0)


def test_yaml_edge_list():
    g = topo.from_edges(
        [
            {"src": 0, "dst": "sw", "bandwidth": "10 GB/s", "latency": "1 us"},
            {"src": 1, "dst": "sw", "bandwidth": "5 GB/s"},
        ]
    )
    _, [rec] = run(PacketSwitchNetwork, g, [(0, 1, 5e9)])
    assert rec.end == pytest.approx(1.0 + 1e-6)


@pytest.mark.parametrize(
    "buffer,ends", [(math.inf, [1.0, 1.0]), (2e9, [1.0, 1.0]), (1e9, [1.0, 2.0]), (4e8, None)]
)
def test_photonic_receiver_buffer_serialises_two_senders(buffer, ends):
    # 1 -> 0 and 2 -> 0, 1 GB each, on two circuits of 1 GB/s (no set-up time): 1 s each
    # side by side. A buffer at GPU 0 smaller than two messages holds one sender's bytes
    # until its delivery at 1 s: the other then sends in [1, 2]. A buffer smaller than one
    # message cannot receive it: an error naming the field, not a silent partial model.
    g = topo.fully_connected(3, GB)
    kw = dict(total_bandwidth=8 * GB, links=8, setup_time=0.0, buffer_bytes=buffer)
    if ends is None:
        with pytest.raises(ConfigError, match="network.buffer_bytes.*largest transfer"):
            run(PhotonicNetwork, g, [(1, 0, 1e9), (2, 0, 1e9)], **kw)
        return
    _, recs = run(PhotonicNetwork, g, [(1, 0, 1e9), (2, 0, 1e9)], **kw)
    assert sorted(r.end for r in recs) == pytest.approx(ends)


def test_photonic_circuit_has_a_lane_per_direction():
    # a <-> b at once on one circuit of 1 GB/s: each direction has its own lane, so both
    # 1 GB transfers end at 1 GB / 1 GB/s = 1 s (one shared lane: 1 s and 2 s)
    g = topo.fully_connected(2, GB)
    net, recs = run(
        PhotonicNetwork, g, [(0, 1, 1e9), (1, 0, 1e9)], total_bandwidth=GB, links=1, setup_time=0.0
    )
    assert [r.end for r in recs] == pytest.approx([1.0, 1.0])
    assert net.setups == 1


def test_packet_routing_by_hops_or_by_latency():
    # a -> b direct: 1 hop of 10 us; a -> c -> b: 2 hops of 1 us. Links 1 GB/s, 1 MB sent:
    # 1 ms of bytes plus the path latency, 10 us by hops, 2 us by latency: 8 us apart
    g = nx.DiGraph()
    for u, v, lat in [("a", "b", 10e-6), ("a", "c", 1e-6), ("c", "b", 1e-6)]:
        g.add_edge(u, v, bandwidth=GB, latency=lat)
    ends = {}
    for routing in ("hops", "latency"):
        net, [rec] = run(PacketSwitchNetwork, g, [("a", "b", 1e6)], routing=routing)
        ends[routing] = rec.end
    assert ends["hops"] == pytest.approx(1e-3 + 10e-6, rel=1e-12)
    assert ends["latency"] == pytest.approx(1e-3 + 2e-6, rel=1e-12)
    assert net.path("a", "b") == ["a", "c", "b"]


def test_max_rate_caps_a_transfer_and_frees_the_rest_for_others():
    # one 10 GB/s link: a transfer capped at 2 GB/s, one uncapped: 2 and 8 GB/s
    g = topo.ring(2, 10 * GB)
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, g)
    a, b = net.transfer_group([(0, 1, 4e9, 2 * GB), (0, 1, 8e9)])
    assert sorted(net.flow_rates()) == pytest.approx([2 * GB, 8 * GB])
    env.run()
    assert b.value.end == pytest.approx(1.0) and a.value.end == pytest.approx(2.0)
    # alone, a cap above the link's bandwidth changes nothing
    _, [rec] = run(PacketSwitchNetwork, g, [(0, 1, 1e9, 100 * GB)])
    assert rec.end == pytest.approx(0.1)
    with pytest.raises(NetworkError, match="max_rate"):
        net.transfer_group([(0, 1, 1.0, 0.0)])


@pytest.mark.parametrize("names", ["int", "str", "tuple"])
def test_transfer_table_is_the_same_on_both_engines(names):
    # the fast engine builds its table from group entries and ring jobs; the reference from
    # one record per transfer: the same rows in the same order, with the same dtypes
    import pandas as pd

    from extrapolators.communication import collectives

    rename = {"int": lambda i: i, "str": lambda i: f"g{i}", "tuple": lambda i: ("node", i)}
    g = nx.relabel_nodes(topo.ring(4, 10 * GB, 1e-6), rename[names])
    gpus = [rename[names](i) for i in range(4)]

    def table(engine):
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, g, engine=engine)
        env.process(collectives.ring_allreduce(env, net, tuple(gpus), 4e6, tag="ar"))
        net.transfer_group([(gpus[0], gpus[2], 1e6), (gpus[3], gpus[1], 0.0)], tag="p2p")
        env.run()
        return net.transfers(), net.records

    (ref, ref_recs), (fast, fast_recs) = table("reference"), table("fast")
    pd.testing.assert_frame_equal(fast, ref)
    assert len(fast) == 6 * 4 + 2 and fast_recs == ref_recs


def test_a_prepared_batch_runs_as_its_transfers_each_time():
    """`batch` checks and routes once; starting it twice gives what the transfer list
    gives (records, ends, link bytes), and another network takes it as its transfers."""
    transfers = [(0, 1, 4e6), (0, 2, 1e6, 2 * GB), (3, 1, 0.0)]

    def run(use_batch, other=False):
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, topo.ring(4, 10 * GB, 1e-6))
        src = (
            PacketSwitchNetwork(simpy.Environment(), topo.ring(4, 10 * GB, 1e-6)) if other else net
        )
        b = src.batch(transfers) if use_batch else transfers
        ends = []

        def go():
            for _ in range(2):
                recs = yield net.transfer_all(b, tag="x")
                ends.append([(r.src, r.dst, r.nbytes, r.start, r.end) for r in recs])

        env.process(go())
        env.run()
        return ends, net.link_stats()["bytes"].tolist()

    plain = run(False)
    assert plain[0][0] != plain[0][1] and plain[0][1][0][3] > 0  # the second starts later
    took = {(s, d): end - start for s, d, _, start, end in plain[0][0]}
    assert took[(0, 2)] >= 1e6 / (2 * GB) and took[(0, 1)] < 4e6 / (5 * GB)  # cap honoured
    assert run(True) == plain
    assert run(True, other=True) == plain
    with pytest.raises(NetworkError):
        PacketSwitchNetwork(simpy.Environment(), topo.ring(4, 10 * GB)).batch([(0, 9, 1.0)])


def test_batches_with_a_link_twice_count_it_twice():
    """Link bytes and flows per link of batches whose routes share links (hand counts on a
    one-way ring 0 -> 1 -> 2 -> 3 -> 0 of 10 GB/s: 0 -> 2 and 1 -> 2 share link 1 -> 2)
    and of a one-flow batch; two equal flows on one link take 5 GB/s each."""
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.ring(4, 10 * GB, bidirectional=False))
    shared = net.batch([(0, 2, 4e6), (1, 2, 1e6)])
    alone = net.batch([(2, 3, 2e6)])
    assert not shared.distinct and alone.distinct
    net.transfer_all(shared)
    net.transfer_all(alone)
    rates = net.flow_rates()
    occ = net._engine.table.occ  # flows per link
    assert list(occ[net.path_links(0, 2)]) == [1, 2] and occ[net.path_links(2, 3)][0] == 1
    assert rates.tolist() == [5 * GB, 5 * GB, 10 * GB]
    env.run()
    ls = net.link_stats()
    got = {(a, b): x for a, b, x in zip(ls["src"], ls["dst"], ls["bytes"], strict=True)}
    assert (got[(0, 1)], got[(1, 2)], got[(2, 3)], got[(3, 0)]) == (4e6, 5e6, 2e6, 0.0)
