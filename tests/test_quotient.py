"""The packet network by orbits (networks.packet.quotient): a symmetric run's network moves one
flow per orbit of the copies, on one link per class of links with its capacity scaled, and
gives what the full network gives (every transfer's end, every link's bytes and busy time,
the bytes sent and delivered); where the copies do not see the same network it refuses
(QuotientBroken) before moving anything wrong."""

import networkx as nx
import numpy as np
import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from networks import PacketSwitchNetwork
from networks import topology as topo
from triosim.common.errors import QuotientBroken

GB = 1e9


class Copies:
    """K copies of the GPUs of node 0 (the representatives), copy k shifting every GPU by
    k nodes (and, with `inner`, by k // nodes GPUs within its node as well)."""

    def __init__(self, nodes: int, ppn: int, inner: bool = False):
        self.nodes, self.ppn, self.inner = nodes, ppn, inner
        self.copies = nodes * (ppn if inner else 1)
        self.reps = [0] if inner else list(range(ppn))

    def image(self, g: int, k: int) -> int:
        node, i = divmod(g, self.ppn)
        dn, di = (k % self.nodes, k // self.nodes) if self.inner else (k, 0)
        return ((node + dn) % self.nodes) * self.ppn + (i + di) % self.ppn

    def images(self, gpus) -> np.ndarray:
        return np.array([[self.image(int(g), k) for k in range(self.copies)] for g in gpus])


def _graph(kind: int, nodes: int, ppn: int) -> nx.DiGraph:
    if kind == 0:  # one switch: every GPU its own link
        return topo.switch_star(nodes * ppn, 40 * GB, 1e-6)
    if kind == 1:  # servers on one non-blocking fabric switch; NVLink inside
        return topo.multi_node(nodes, ppn, 200 * GB, 25 * GB, 1e-6, 3e-6, fabric="switch")
    return _one_uplink(nodes, ppn)


def _one_uplink(nodes: int, ppn: int) -> nx.DiGraph:
    """Servers whose GPUs share one uplink to a core switch: copies within a server put
    several flows of an orbit on that uplink (a class smaller than K)."""
    g = nx.DiGraph()
    g.add_node("core", kind="switch")
    for k in range(nodes):
        g.add_node(f"s{k}", kind="switch")
        topo.add_link(g, f"s{k}", "core", 30 * GB, 2e-6, kind="net")
        for i in range(ppn):
            g.add_node(k * ppn + i, kind="gpu")
            topo.add_link(g, k * ppn + i, f"s{k}", 100 * GB, 1e-6)
    return g


def _run(graph, actions, copies, by_orbits: bool):
    """Start every action (a start time, its transfers: all copies' flows, and whether it
    is a transfer_group) on a fresh network; returns the network after the run."""
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, graph)
    if by_orbits:
        assert net.by_orbits(copies)

    def act(delay, transfers, group):
        yield env.timeout(delay)
        if group:
            yield simpy.AllOf(env, net.transfer_group(transfers))
        else:
            records = yield net.transfer_all(transfers)
            assert len(records) == len(transfers)

    for delay, transfers, group in actions:
        env.process(act(delay, transfers, group))
    env.run()
    return net


def _orbit(copies, src, dst, nbytes, cap):
    """A flow from a representative and its images in every copy."""
    return [(copies.image(src, k), copies.image(dst, k), nbytes, cap) for k in range(copies.copies)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.integers(0, 2),
    shape=st.sampled_from([(4, 2, False), (2, 4, False), (4, 2, True), (3, 2, True)]),
    data=st.data(),
)
def test_by_orbits_moves_what_every_flow_moves(kind, shape, data):
    nodes, ppn, inner = shape
    copies = Copies(nodes, ppn, inner)
    n = nodes * ppn
    actions = []
    for _ in range(data.draw(st.integers(1, 6))):
        transfers = []
        for _ in range(data.draw(st.integers(1, 3))):
            src = data.draw(st.sampled_from(copies.reps))
            dst = data.draw(st.integers(0, n - 1).filter(lambda d, s=src: d != s))
            nbytes = float(data.draw(st.sampled_from([0, 1e3, 1e6, 3e6, 8e6])))
            cap = data.draw(st.sampled_from([np.inf, np.inf, 5 * GB]))
            transfers += _orbit(copies, src, dst, nbytes, cap)
        order = data.draw(st.permutations(range(len(transfers))))  # any order of transfers
        transfers = [transfers[i] for i in order]
        delay = data.draw(st.sampled_from([0.0, 0.0, 1e-5, 2e-4, 3.3e-4]))
        actions.append((delay, transfers, data.draw(st.booleans())))
    graph = _graph(kind, nodes, ppn)
    full = _run(graph, actions, copies, by_orbits=False)
    orb = _run(graph, actions, copies, by_orbits=True)
    key = ["src", "dst", "start", "nbytes", "end"]
    a = full.transfers().sort_values(key).reset_index(drop=True)
    b = orb.transfers().sort_values(key).reset_index(drop=True)
    assert len(a) == len(b) == sum(len(t) for _, t, _ in actions)
    assert list(a["src"]) == list(b["src"]) and list(a["dst"]) == list(b["dst"])
    for c in ("start", "nbytes", "end"):
        np.testing.assert_allclose(b[c].to_numpy(float), a[c].to_numpy(float), rtol=1e-9)
    la, lb = full.link_stats(), orb.link_stats()
    for c in ("bandwidth", "bytes", "busy_time"):
        np.testing.assert_allclose(lb[c].to_numpy(float), la[c].to_numpy(float), rtol=1e-9)
    assert orb.bytes_sent == pytest.approx(full.bytes_sent, rel=1e-12)
    assert orb.bytes_delivered == pytest.approx(full.bytes_delivered, rel=1e-12)
    assert orb.in_flight == full.in_flight == 0
    assert orb.max_utilisation == pytest.approx(full.max_utilisation, rel=1e-9)


def test_two_orbits_on_one_uplink_by_hand():
    # two servers of 2 GPUs on one fabric switch; copies: the servers (K = 2), the
    # representatives GPUs 0 and 1. Flows 0 -> 2 and 1 -> 3 with their images 2 -> 0 and
    # 3 -> 1: each GPU's NIC carries one flow each way, 25 GB/s each; 50 MB take 2 ms plus
    # the path latency (3 us). The kept links are one per class: 2 flows of 4 move.
    copies = Copies(2, 2)
    graph = topo.multi_node(2, 2, 200 * GB, 25 * GB, 1e-6, 3e-6, fabric="switch")
    transfers = _orbit(copies, 0, 2, 50e6, np.inf) + _orbit(copies, 1, 3, 50e6, np.inf)
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, graph)
    assert net.by_orbits(copies)
    b = net.batch(transfers)
    assert len(b) == 2 and b.expand.tolist() == [0, 0, 1, 1]
    done = net.transfer_all(b)
    env.run()
    ends = [r.end for r in done.value]
    assert ends == pytest.approx([50e6 / 25e9 + 3e-6] * 4, rel=1e-12)
    # the class of GPU 0's NIC uplink holds GPU 2's as well: capacity x |class| / K = C
    q = net.quotient
    assert (q.size[q.canon[q.canon >= 0]] == 2).all()
    stats = net.link_stats()
    nic = stats[(stats["src"] == 2) & (stats["dst"] != "nvswitch1")]
    assert nic["bytes"].sum() == pytest.approx(50e6)  # GPU 2's own flow, not its kept link's


def test_copies_that_share_a_link_unevenly_are_refused():
    # GPUs 0 and 1 under switch A, GPU 2 under B, both switches on a core with GPU 3: copies
    # rotating 0 -> 1 -> 2 (GPU 3 its own image). 0 -> 3 and 1 -> 3 cross A's uplink, 2 -> 3
    # B's: two of the orbit's three flows on one link, one on the other
    class Rotate:
        copies, reps = 3, [0]

        def images(self, gpus):
            return np.array([[g] * 3 if g == 3 else [g, (g + 1) % 3, (g + 2) % 3] for g in gpus])

    g = nx.DiGraph()
    for x in range(4):
        g.add_node(x, kind="gpu")
    for sw, gpus in (("A", (0, 1)), ("B", (2,)), ("core", (3,))):
        g.add_node(sw, kind="switch")
        for x in gpus:
            topo.add_link(g, x, sw, 10 * GB)
    topo.add_link(g, "A", "core", 10 * GB)
    topo.add_link(g, "B", "core", 10 * GB)
    net = PacketSwitchNetwork(simpy.Environment(), g)
    net.by_orbits(Rotate())
    with pytest.raises(QuotientBroken, match="unevenly"):
        net.batch([(0, 3, 1e6), (1, 3, 1e6), (2, 3, 1e6)])


def test_a_group_that_is_not_whole_orbits_is_refused():
    copies = Copies(2, 2)
    net = PacketSwitchNetwork(simpy.Environment(), _graph(1, 2, 2))
    net.by_orbits(copies)
    with pytest.raises(QuotientBroken, match="not 2 copies"):
        net.batch([(0, 2, 1e6), (1, 3, 1e6), (2, 0, 1e6)])  # 3 -> 1 missing
    with pytest.raises(QuotientBroken, match="in every copy"):
        net.batch([(0, 2, 1e6), (3, 0, 1e6)])  # an image with the wrong destination
    with pytest.raises(QuotientBroken, match="in every copy"):
        net.batch([(0, 2, 1e6), (2, 0, 2e6)])  # an image of another size


def test_a_slower_link_in_one_copy_is_refused():
    graph = _graph(1, 2, 2)
    topo.set_link(graph, 3, "ib", bandwidth=5 * GB)  # GPU 3's NIC, uplink
    copies = Copies(2, 2)
    net = PacketSwitchNetwork(simpy.Environment(), graph)
    net.by_orbits(copies)
    net.batch(_orbit(copies, 0, 2, 1e6, np.inf))  # its class: 0's and 2's uplinks
    with pytest.raises(QuotientBroken, match="different bandwidth"):
        net.batch(_orbit(copies, 1, 2, 1e6, np.inf))
    net.by_orbits(None)  # back to every flow: capacities as built
    assert (net.capacity == PacketSwitchNetwork(simpy.Environment(), graph).capacity).all()


def test_copies_that_are_no_symmetry_of_the_network_are_refused():
    # a 6-GPU ring and copies that swap GPUs 0 and 1, 2 and 3, 4 and 5: no automorphism of
    # the ring (link 1-2 would go to 0-3, no link). 0 -> 1 and its image 1 -> 0 put links
    # (0, 1) and (1, 0) in one class; 0 -> 2 (path 0-1-2) and its image 1 -> 3 (1-2-3)
    # would put (0, 1) with (1, 2) at their first hop: grouped otherwise, refused
    class Swap:
        copies, reps = 2, [0, 2, 4]

        def images(self, gpus):
            return np.array([[g, g ^ 1] for g in np.asarray(gpus).tolist()])

    net = PacketSwitchNetwork(simpy.Environment(), topo.ring(6, 10 * GB, 1e-6))
    net.by_orbits(Swap())
    net.batch([(0, 1, 1e6), (1, 0, 1e6)])
    with pytest.raises(QuotientBroken, match="group otherwise"):
        net.batch([(0, 2, 1e6), (1, 3, 1e6)])


def _two_copies_graph():
    """Switches A (GPUs 0, 1, 6) and B (2, 3, 7) on a core with GPUs 4 and 5; A and B's
    uplinks 10 GB/s, the rest 100 GB/s."""
    g = nx.DiGraph()
    for sw in ("A", "B", "core"):
        g.add_node(sw, kind="switch")
    for x in range(8):
        g.add_node(x, kind="gpu")
    for sw, gpus in (("A", (0, 1, 6)), ("B", (2, 3, 7)), ("core", (4, 5))):
        for x in gpus:
            topo.add_link(g, x, sw, 100 * GB)
    topo.add_link(g, "A", "core", 10 * GB)
    topo.add_link(g, "B", "core", 10 * GB)
    return g


class Table:
    """Copies given by a table: GPU -> its image in each copy."""

    def __init__(self, table, reps):
        self.table, self.reps = table, reps
        self.copies = len(next(iter(table.values())))

    def images(self, gpus):
        return np.array([self.table[int(x)] for x in gpus])


def test_a_class_met_again_as_part_of_itself_is_refused():
    # 6 -> 4 and its copy 7 -> 5 make the class {A -> core, B -> core}; then 1 -> 4 and its
    # copy 0 -> 5 cross A -> core both: that link alone, no class of its own. By orbits it
    # would give both 20 ms (50 % of 10 GB/s each); the full network gives 30, 30, 30, 10
    copies = Table({0: [0, 2], 1: [1, 0], 2: [2, 0], 3: [3, 2], 4: [4, 5], 5: [5, 4],
                    6: [6, 7], 7: [7, 6]}, [1, 6])  # fmt: skip
    net = PacketSwitchNetwork(simpy.Environment(), _two_copies_graph())
    net.by_orbits(copies)
    net.batch([(6, 4, 1e8), (7, 5, 1e8)])
    with pytest.raises(QuotientBroken, match="group otherwise"):
        net.batch([(1, 4, 1e8), (0, 5, 1e8)])


def test_a_copy_behind_a_longer_latency_is_refused():
    # by hops (latency does not pick the route): GPU 3's uplink 4 us instead of 3; the full
    # network lands 1 -> 2 and its copy 3 -> 0 1 us apart
    graph = _graph(1, 2, 2)
    topo.set_link(graph, 3, "ib", latency=4e-6)
    copies = Copies(2, 2)
    net = PacketSwitchNetwork(simpy.Environment(), graph, routing="hops")
    net.by_orbits(copies)
    with pytest.raises(QuotientBroken, match="latency"):
        net.batch(_orbit(copies, 1, 2, 1e6, np.inf))


def test_a_path_through_a_class_twice_is_refused():
    # a one-way ring of 4 and copies that rotate it by 2: 0 -> 3 crosses 0-1, 1-2, 2-3;
    # its copy 2 -> 1 crosses 2-3, 3-0, 0-1: hops one and three fall in one class
    ring = topo.ring(4, 10 * GB, 1e-6, bidirectional=False)
    copies = Table({g: [g, (g + 2) % 4] for g in range(4)}, [0, 1])
    net = PacketSwitchNetwork(simpy.Environment(), ring)
    net.by_orbits(copies)
    with pytest.raises(QuotientBroken, match="twice"):
        net.batch([(0, 3, 1e6), (2, 1, 1e6)])


def test_a_node_outside_the_copies_is_refused():
    # a reducing switch named by an int (4) is no GPU of the copies: refused, not an
    # IndexError from the copies' table
    g = nx.DiGraph()
    for x in range(4):
        g.add_node(x, kind="gpu")
    g.add_node(4, kind="switch", reduce="nvls")
    for x in range(4):
        topo.add_link(g, x, 4, 100 * GB)
    net = PacketSwitchNetwork(simpy.Environment(), g)
    net.by_orbits(Table({0: [0, 1], 1: [1, 0], 2: [2, 3], 3: [3, 2]}, [0, 2]))
    with pytest.raises(QuotientBroken, match="outside the copies"):
        net.batch([(0, 4, 1e6), (1, 4, 1e6), (2, 4, 1e6), (3, 4, 1e6)])
    nx.relabel_nodes(g, {4: "sw"}, copy=False)  # named otherwise: no GPU at all
    net = PacketSwitchNetwork(simpy.Environment(), g)
    net.by_orbits(Table({0: [0, 1], 1: [1, 0], 2: [2, 3], 3: [3, 2]}, [0, 2]))
    with pytest.raises(QuotientBroken, match="no GPU of the copies"):
        net.batch([(0, "sw", 1e6), (1, "sw", 1e6), (2, "sw", 1e6), (3, "sw", 1e6)])


def test_kept_groups_and_the_order_of_events_are_the_full_networks():
    # the same group again (kept) and one of other sizes (not mixed up with it); process A
    # resumes after its transfer_all at the instant process B's transfer_group lands: the
    # order in which A and B go on is the full network's
    copies = Copies(2, 2)
    graph = _graph(1, 2, 2)
    x = _orbit(copies, 0, 2, 4e6, np.inf)
    y = _orbit(copies, 0, 2, 8e6, np.inf)

    def run(by_orbits):
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, graph)
        if by_orbits:
            net.by_orbits(copies)
        order = []

        def a():
            yield net.transfer_all(x)
            order.append("a")
            yield net.transfer_all(y)
            yield net.transfer_all(x)
            order.append("a2")

        def b():
            yield net.transfer_group(_orbit(copies, 1, 3, 4e6, np.inf))[0]
            order.append("b")

        env.process(a())
        env.process(b())
        env.run()
        return order, net.transfers().sort_values(["start", "src", "end"])

    (o1, t1), (o2, t2) = run(False), run(True)
    assert o1 == o2
    assert list(t1["src"]) == list(t2["src"]) and list(t1["nbytes"]) == list(t2["nbytes"])
    np.testing.assert_allclose(t2["end"].to_numpy(float), t1["end"].to_numpy(float), rtol=1e-9)


def test_a_group_started_again_from_its_batch_is_the_group_started_from_its_transfers():
    """transfer_group of a prepared batch (a symmetric run's send and its images, routed
    once and started at every send) moves what every flow moves: the same records and
    events' instants as the transfers' list on a network moving every flow; by orbits an
    image's event is its kept flow's."""
    copies = Copies(4, 2)
    a, b = _orbit(copies, 0, 3, 2e6, np.inf), _orbit(copies, 1, 2, 1e6, np.inf)
    group = [t for pair in zip(a, b, strict=True) for t in pair]  # the orbits interleaved
    got = {}
    for how, by_orbits in (("list", False), ("list", True), ("batch", False), ("batch", True)):
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, _graph(1, 4, 2))
        if by_orbits:
            assert net.by_orbits(copies)
        batch = net.batch(group)
        seen = []

        def start(delay, how=how, by_orbits=by_orbits, batch=batch, net=net, env=env, seen=seen):
            yield env.timeout(delay)
            events = net.transfer_group(group if how == "list" else batch)
            if by_orbits:  # each copy's event is its orbit's kept flow's
                assert events[2] is events[0] and events[1] is not events[0]
            yield simpy.AllOf(env, events)
            seen.append([e.value.end for e in events])

        for delay in (0.0, 1e-5, 3e-4):
            env.process(start(delay))
        env.run()
        key = ["start", "src", "dst", "end"]
        table = net.transfers().sort_values(key).reset_index(drop=True)
        got[how, by_orbits] = (seen, table[key].to_dict("list"), net.bytes_delivered)
    want = got["list", False]
    assert len(want[1]["src"]) == 3 * len(group)
    assert len(set(want[1]["end"])) > 3  # (the orbits land apart)
    for k, v in got.items():
        assert v[0] == want[0], k  # every event's value: its (kept) record's instant
        assert v[1] == want[1], k
        assert v[2] == pytest.approx(want[2], rel=1e-12), k
