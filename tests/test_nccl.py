"""The NCCL model against NCCL's own structure: its published constants and formulas
(NVIDIA/nccl v2.23.4-1 src/graph/tuning.cc, written out here by hand), and how the
schedule's bytes behave in the flow network."""

import math

import pytest
import simpy

from extrapolators.communication.base import Textbook
from extrapolators.communication.nccl.model import Nccl, pipeline_fill
from extrapolators.communication.nccl.options import NcclOptions
from networks import PacketSwitchNetwork
from networks import topology as topo
from triosim.common.errors import ConfigError

GB, MiB, GiB = 1e9, 2**20, 2**30


def model(g, gpu="H100", **opts):
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, g)
    return env, net, Nccl(env, net, NcclOptions(**opts), gpu=gpu)


def simulate(g, nbytes, op="allreduce", gpu="H100", group=None, copies=1, **opts):
    """Seconds one collective (or `copies` at once) takes, simulated through the network."""
    env, net, m = model(g, gpu, **opts)
    group = tuple(group or net.gpus)
    for _ in range(copies):
        env.process(m.run(op, group, nbytes, root=group[0]))
    env.run()
    return env.now, m, net


def h100_node(lat=0.0, nvls=True):
    return topo.switch_star(8, 450 * GB, lat, nvls=nvls)


def test_ideal_node_reproduces_nccls_formula():
    # NCCL's ring graph on an 8 x H100 NVSwitch node is 12 channels x 30 GB/s = 360 GB/s
    # (80 % of 450); Ring/Simple: 8.4 + 14 x 3.4 us and 360 x 8/14 GB/s
    S = 256 * MiB
    t, m, _ = simulate(h100_node(), S, algorithm="ring", protocol="Simple")
    assert t == pytest.approx((8.4 + 14 * 3.4) * 1e-6 + S / (360 * 8 / 14 * GB), rel=1e-9)
    # Ring/LL: 6.6 + 14 x 0.6 us; bus bandwidth min(llMaxBw 141, 360 / 2) (all 24 channels
    # from 768 KiB)
    S = 4 * MiB
    t, _, _ = simulate(h100_node(), S, algorithm="ring", protocol="LL")
    assert t == pytest.approx((6.6 + 14 * 0.6) * 1e-6 + S / (141 * 8 / 14 * GB), rel=1e-9)
    # A100 (12 x 20 = 240 of 300 GB/s), LL128: 14 + 14 x 1.9 us at 0.92 x 240 GB/s
    a100 = topo.switch_star(8, 300 * GB)
    t, _, _ = simulate(a100, S, gpu="A100-80GB", algorithm="ring", protocol="LL128")
    assert t == pytest.approx((14 + 14 * 1.9) * 1e-6 + S / (0.92 * 240 * 8 / 14 * GB), rel=1e-9)


def test_nccls_choices_on_one_h100_node():
    # NVIDIA (nccl-tests#309): "8B~1MB: RING/LL, 2MB~16GB: NVLS/SIMPLE"
    _, net, m = model(h100_node())
    g = tuple(net.gpus)
    assert {m.choose("allreduce", g, s) for s in (8, 64 * 1024, MiB)} == {("ring", "LL")}
    assert {m.choose("allreduce", g, s) for s in (2 * MiB, GiB, 16 * GiB)} == {("nvls", "Simple")}
    # NVLS needs the reducing switch and Hopper
    _, net, m = model(h100_node(nvls=False))
    assert m.choose("allreduce", g, GiB) == ("ring", "Simple")
    _, net, m = model(h100_node(), gpu="A100-80GB")
    assert m.choose("allreduce", g, GiB) == ("ring", "Simple")


def test_tree_latency_grows_with_log_n_ring_latency_with_n():
    # 8-byte all-reduce over N nodes of 8: Tree/LL 6.8 + 2 (7 x 0.6 + log2 N x 5.0) us;
    # Ring/LL 6.6 + (2(n-1) - 2(N-1)) x max(0.6, 1.0 net overhead) + 2(N-1) x 2.7 us
    tree, ring = {}, {}
    for N in (2, 4, 8, 16):
        g = topo.multi_node(N, 8, 450 * GB, 50 * GB)
        tree[N] = simulate(g, 8, algorithm="tree", protocol="LL")[0]
        ring[N] = simulate(g, 8, algorithm="ring", protocol="LL")[0]
        n = 8 * N
        # (8 bytes also take a few ns of bandwidth time)
        want = 6.8 + 2 * (7 * 0.6 + math.log2(N) * 5.0)
        assert tree[N] == pytest.approx(want * 1e-6, abs=1e-8)
        want = 6.6 + (2 * (n - 1) - 2 * (N - 1)) * 1.0 + 2 * (N - 1) * 2.7
        assert ring[N] == pytest.approx(want * 1e-6, abs=1e-8)
    steps = [tree[2 * N] - tree[N] for N in (2, 4, 8)]
    assert steps == pytest.approx([10e-6] * 3, abs=1e-8)  # log N: one step per doubling
    assert ring[16] - ring[8] > 3.5 * (ring[4] - ring[2])  # linear in N


def crossover(g, gpu, lo, hi, a, b):
    """The smallest size (bisection over bytes) at which NCCL leaves protocol a, for b."""
    _, net, m = model(g, gpu)
    grp = tuple(net.gpus)
    assert m.choose("allreduce", grp, lo)[1] == a and m.choose("allreduce", grp, hi)[1] != a
    while hi - lo > 256:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if m.choose("allreduce", grp, mid)[1] == a else (lo, mid)
    assert m.choose("allreduce", grp, hi) == ("ring", b)
    return hi


@pytest.mark.parametrize("n", [4, 8])
def test_protocol_switch_point_moves_with_n(n):
    # A100 NVSwitch node (ring graph 240 GB/s): Ring/LL vs Ring/LL128 where
    # 6.6 + 2(n-1) 0.6 + S / (87.7 n/(2(n-1))) = 14 + 2(n-1) 1.9 + S / (220.8 n/(2(n-1)))
    k = 2 * (n - 1)
    ll_bw = min(87.7, 0.5 * 240) * n / k  # GB/s = bytes per ns
    ll128_bw = min(0.92 * 240, 12 * 20.0) * n / k
    want = ((14 + k * 1.9) - (6.6 + k * 0.6)) * 1e3 / (1 / ll_bw - 1 / ll128_bw)
    got = crossover(topo.switch_star(n, 300 * GB), "A100-80GB", 1e4, 1e8, "LL", "LL128")
    assert got == pytest.approx(want, rel=1e-3)


def test_switch_points_differ_between_4_and_8_gpus():
    a = crossover(topo.switch_star(4, 300 * GB), "A100-80GB", 1e4, 1e8, "LL", "LL128")
    b = crossover(topo.switch_star(8, 300 * GB), "A100-80GB", 1e4, 1e8, "LL", "LL128")
    assert b > 1.3 * a


def test_bus_bandwidth_approaches_the_calibrated_peak():
    # A100 node, bandwidth scaled to 0.95 of NCCL's Ring/Simple 240 GB/s
    g = topo.switch_star(8, 300 * GB)
    busbw = []
    for S in (64 * MiB, GiB, 16 * GiB):
        t, _, _ = simulate(g, S, gpu="A100-80GB", bandwidth_scale=0.95)
        busbw.append(S / t * 2 * 7 / 8 / GB)
    assert busbw == sorted(busbw)
    assert busbw[-1] == pytest.approx(0.95 * 240, rel=0.005)


@pytest.mark.parametrize("ppn", [2, 4, 8])
def test_rail_optimised_bus_bandwidth_scales_with_nics_per_node(ppn):
    # 2 nodes of A100s, one 200 Gb/s NIC each: NCCL's rings, one per rail, cross between
    # nodes on every NIC: bus bandwidth = ppn x 25 GB/s x 0.96 (NCCL's 24 of 25 GB/s)
    g = topo.multi_node(2, ppn, 300 * GB, 25 * GB, 0.7e-6, 2e-6)
    S = 16 * GiB
    t, m, _ = simulate(g, S, gpu="A100-80GB", algorithm="ring", protocol="Simple")
    n = 2 * ppn
    busbw = S / t * 2 * (n - 1) / n / GB
    assert busbw == pytest.approx(ppn * 25 * 0.96, rel=0.02)
    # the textbook flat ring crosses between nodes through one NIC each way
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, g)
    env.process(Textbook(env, net).run("allreduce", tuple(range(n)), S))
    env.run()
    assert S / env.now * 2 * (n - 1) / n / GB < 25 * 1.01


def test_pipelined_ring_with_one_slow_latency_link():
    # 8 GPUs on a one-way ring (the order is forced) of 100 GB/s, 1 us links; link 3->4 50 us.
    # NCCL Ring/Simple, 1 MB: every hop costs max(3.4 us, its latency); a chunk is forwarded
    # when it arrives, so the slowest chain is a window of 14 consecutive hops of the ring
    # of 8, which crosses the slow link twice: + 2 x (50 - 3.4) us. The ring graph is
    # 100 GB/s at NCCL's 80 %: 80 GB/s, algorithm bandwidth 80 x 8/14.
    S = 1e6
    uniform = topo.ring(8, 100 * GB, 1e-6, bidirectional=False)
    slow = topo.ring(8, 100 * GB, 1e-6, bidirectional=False)
    topo.set_link(slow, 3, 4, latency=50e-6)
    t_u = simulate(uniform, S, algorithm="ring", protocol="Simple")[0]
    t_s = simulate(slow, S, algorithm="ring", protocol="Simple")[0]
    base = S / (80 * 8 / 14 * GB)
    assert t_u == pytest.approx((8.4 + 14 * 3.4) * 1e-6 + base, rel=1e-9)
    assert t_s == pytest.approx((8.4 + 14 * 3.4 + 2 * (50 - 3.4)) * 1e-6 + base, rel=1e-9)
    assert t_s / t_u < 3
    # the lock-step textbook ring waits for the slow link at each of its 14 steps
    times = []
    for g in (uniform, slow):
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, g)
        env.process(Textbook(env, net).run("allreduce", tuple(range(8)), S))
        env.run()
        times.append(env.now)
    assert times[1] / times[0] > 5


def test_both_ring_directions_are_used():
    S = 4 * GiB
    two = simulate(topo.ring(8, 50 * GB), S, gpu="A100-80GB", algorithm="ring")[0]
    one = simulate(
        topo.ring(8, 50 * GB, bidirectional=False), S, gpu="A100-80GB", algorithm="ring"
    )[0]
    assert one / two == pytest.approx(2.0, rel=0.02)


def test_a_slow_link_sets_the_ring_bandwidth():
    # one-way ring, link 2->3 10x slower: the pipelined ring runs at its slowest hop
    S = 4 * GiB
    g = topo.ring(8, 50 * GB, bidirectional=False)
    topo.set_link(g, 2, 3, bandwidth=5 * GB)
    t = simulate(g, S, gpu="A100-80GB", algorithm="ring", protocol="Simple")[0]
    assert t == pytest.approx((8.4 + 14 * 3.4) * 1e-6 + S / (5 * 0.8 * 8 / 14 * GB), rel=1e-6)


def test_contention_shares_the_links():
    # one all-reduce feeds the links at NCCL's 240 of their 300 GB/s (the GPUs' limit); two
    # at once share the full 300: each gets 150, so 2 x 0.8 = 1.6 times one's bandwidth time
    S = 4 * GiB
    g = topo.switch_star(8, 300 * GB)
    one = simulate(g, S, gpu="A100-80GB")[0]
    two = simulate(g, S, gpu="A100-80GB", copies=2)[0]
    lat = (8.4 + 14 * 3.4) * 1e-6
    assert one - lat == pytest.approx(S / (240 * GB * 8 / 14), rel=1e-9)
    assert two - lat == pytest.approx(1.6 * (one - lat), rel=1e-6)


@pytest.mark.no_cover
@pytest.mark.parametrize(
    "build,gpu",
    [
        (lambda: h100_node(0.7e-6), "H100"),
        (lambda: topo.multi_node(2, 8, 450 * GB, 50 * GB, 0.7e-6, 2e-6, nvls=True), "H100"),
        (lambda: topo.multi_node(3, 4, 300 * GB, 25 * GB, 0.7e-6, 2e-6), "A100-80GB"),
        (lambda: topo.dgx1(25 * GB, 1e-6), "A100-80GB"),
        (lambda: topo.fully_connected(6, 50 * GB, 1e-6), "H100"),
    ],
)
@pytest.mark.parametrize(
    "op",
    ["allreduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv"],
)
def test_simulation_matches_the_plans_free_network_time(build, gpu, op):
    for S in (8, 3 * MiB, GiB):
        t, m, net = simulate(build(), S, op=op, gpu=gpu)
        assert t == pytest.approx(m.predict(op, tuple(net.gpus), S, root=net.gpus[0]), rel=1e-6)


def test_all_links_of_a_direct_connect_system_carry_rings():
    # fully connected 8: three edge-disjoint rings, both ways: 6 links a GPU
    g = topo.fully_connected(8, 50 * GB)
    S = 4 * GiB
    t = simulate(g, S, gpu="A100-80GB", algorithm="ring", protocol="Simple")[0]
    assert S / t * 14 / 8 / GB == pytest.approx(3 * 2 * 50 * 0.8, rel=0.01)


def test_bounded_flows_for_a_large_collective():
    g = topo.multi_node(8, 8, 450 * GB, 50 * GB, 0.7e-6, 2e-6, nvls=True)
    _, m, net = simulate(g, GiB)
    assert len(net.records) <= 16 * 64  # O(N x rings), not O(N^2 x chunks)


def test_pipeline_fill_formula():
    # D stages, per-chunk cost o, bandwidth time T: one chunk costs (D-1) T; many, the
    # best m = sqrt((D-1) T / o) chunks: (D-1) T / m + (m - 1) o
    assert pipeline_fill(3, 1e-6, 0.1e-6) == pytest.approx(2 * 0.1e-6)
    D, o, T = 3, 2e-6, 800e-6
    m = math.sqrt((D - 1) * T / o)
    assert pipeline_fill(D, o, T) == pytest.approx((D - 1) * T / m + (m - 1) * o)
    assert pipeline_fill(1, o, T) == 0.0


def test_calibration_file_and_overrides(tmp_path):
    g = topo.switch_star(8, 300 * GB)
    S = GiB
    base = simulate(g, S, gpu="A100-80GB")[0]
    f = tmp_path / "calib.yaml"
    f.write_text("tuning:\n  bandwidth_scale_Simple: 0.5\n  launch_overhead: 1.0e-5\n")
    t = simulate(g, S, gpu="A100-80GB", calibration=str(f))[0]
    lat = (8.4 + 14 * 3.4) * 1e-6
    assert t == pytest.approx(1e-5 + lat + 2 * (base - lat), rel=1e-9)
    # an explicit config field wins over the file
    t2 = simulate(g, S, gpu="A100-80GB", calibration=str(f), launch_overhead=0.0)[0]
    assert t2 == pytest.approx(t - 1e-5, rel=1e-9)
    f.write_text("tuning:\n  bandwith_scale_Simple: 0.5\n")
    with pytest.raises(ConfigError, match="calibration"):
        simulate(g, S, gpu="A100-80GB", calibration=str(f))


def test_dp_iteration_with_nccl_is_compute_plus_the_collective():
    from tests.conftest import chain_trace
    from triosim.simulation.wiring import Simulation

    t = chain_trace(batch=32)
    cfg = {
        "num_gpus": 8,
        "parallelism": {"mode": "dp"},
        "gpu": "H100-SXM",
        "perfmodel": {"kind": "trace"},
        "topology": {"kind": "switch", "bandwidth": "450 GB/s", "nvls": True},
    }
    cfg["batch_size"] = 8 * 32
    s = Simulation(cfg, trace=t)
    r = s.run()
    compute = r.per_gpu()["compute"].max()
    env, net, m = model(h100_node())
    assert r.iteration_time == pytest.approx(
        compute + m.predict("allreduce", tuple(range(8)), t.weight_bytes()), rel=1e-9
    )


def test_a_forced_algorithm_the_gpus_lack_is_an_error_as_in_nccl():
    """NCCL fails where NCCL_ALGO names no algorithm the system has: NVLS needs a reducing
    NVSwitch (and Hopper), CollNet SHARP switches across nodes; before, both ran silently
    as auto. The other collectives have the ring only, so a forced all-reduce algorithm
    leaves them alone."""
    g = topo.ring(4, 65 * GB, 1e-6)
    for algo, needs in (("nvls", "NVSwitch that reduces"), ("collnet", "SHARP")):
        _, net, m = model(g, algorithm=algo)
        with pytest.raises(ConfigError, match=needs):
            m.plan("allreduce", tuple(net.gpus), MiB)
        assert m.plan("all_gather", tuple(net.gpus), MiB).algo == "ring"
    _, net, m = model(h100_node(nvls=False), algorithm="nvls")  # the switch does not reduce
    with pytest.raises(ConfigError, match="nvls"):
        m.plan("allreduce", tuple(net.gpus), GiB)
    _, net, m = model(h100_node(), algorithm="nvls", protocol="LL")  # NVLS runs Simple only
    with pytest.raises(ConfigError, match="Simple only"):
        m.plan("allreduce", tuple(net.gpus), GiB)
    _, net, m = model(h100_node(), algorithm="nvls")
    assert m.plan("allreduce", tuple(net.gpus), GiB).algo == "nvls"


def test_a_forced_protocol_is_enabled_as_nccl_proto_enables_it():
    """LL128 is off by default on PCIe; NCCL_PROTO=LL128 turns it on, and so does the
    config (before, the model fell back to its own pick without a word). Ring/LL128 on a
    4-GPU PCIe ring at 12 GB/s links: NCCL's LL128 ring bandwidth min(0.92 x bus, channels
    x 20 GB/s) with bus = the ring graph's (hand-worked below)."""
    g = topo.ring(4, 15.75 * GB, 0.0)
    for u, v in list(g.edges):
        g.edges[u, v]["kind"] = "pcie"
    _, net, auto = model(g, gpu="A100-80GB")
    grp = tuple(net.gpus)
    assert auto.plan("allreduce", grp, 64 * MiB).proto != "LL128"
    _, _, m = model(g, gpu="A100-80GB", protocol="LL128")
    p = m.plan("allreduce", grp, 64 * MiB)
    assert p.proto == "LL128"
    # the ring graph: both ways round the ring, each direction at 12 of 15.75 GB/s (PCIe's
    # efficiency), so 24 GB/s; channels 24 / 20 = 1.2; LL128 bus min(0.92 x 24, 1.2 x 20)
    bus = min(0.92 * 24.0, 1.2 * 20.0)
    t = m.terms("allreduce", grp, 64 * MiB)
    assert t.bw == pytest.approx(bus * 4 / 6, rel=1e-9)


def test_a_calibration_file_with_a_key_given_twice_is_refused(tmp_path):
    """Calibration files are read as configs are: a key given twice is an error with its
    lines (PyYAML alone keeps the last without a word)."""
    from extrapolators.communication.nccl.options import load_calibration
    from triosim.common.errors import InputError

    p = tmp_path / "calib.yaml"
    p.write_text("tuning:\n  latency_scale: 1.2\n  latency_scale: 0.8\n")
    with pytest.raises(InputError, match="given twice.*lines 2 and 3"):
        load_calibration(p)
    p.write_text("tuning:\n  latency_scale: 1.2\n")
    assert load_calibration(p) == {"latency_scale": 1.2}


def test_every_catalogue_gpu_gets_its_own_architecture():
    """NCCL's architecture comes from the catalogue's compute capability (one source): each
    catalogue GPU (and each alias) maps to 10 x major + minor, e.g. A40 86, H200 90; a GPU
    entering the catalogue without one is refused; an unknown name is the default."""
    import dataclasses

    import pytest as _pytest

    from triosim.hardware import catalogue
    from triosim.hardware.nccl_constants import DEFAULT_ARCH, arch_of

    assert catalogue.GPUS
    for name, g in catalogue.GPUS.items():
        major, minor = g.compute_capability
        assert arch_of(name) == 10 * major + minor
        for alias in g.aliases:
            assert arch_of(alias) == arch_of(name)
    assert (arch_of("A40"), arch_of("A100-80GB"), arch_of("H200")) == (86, 80, 90)
    assert arch_of("cpu") == arch_of(None) == DEFAULT_ARCH
    new = dataclasses.replace(catalogue.GPUS["H200"], name="X200", compute_capability=None)
    with _pytest.raises(ValueError, match="X200"):
        catalogue._gpu(new)
    # a GPU added to the catalogue alone is the architecture it says (the defect: 80)
    catalogue._gpu(dataclasses.replace(new, aliases=(), compute_capability=(10, 0)))
    try:
        assert arch_of("X200") == 100
    finally:
        del catalogue.GPUS["X200"]


@pytest.mark.parametrize(
    "name, g, groups",
    [
        (
            "rail cluster",
            topo.multi_node(4, 4, 300e9, 50e9, 1e-6, 2e-6),
            [(0, 5, 10, 15), tuple(range(16))],
        ),
        ("fat tree", topo.fat_tree(16, 25e9, 1e-6, radix=8), [(0, 3, 9, 12), (1, 2, 3, 4, 5, 6)]),
        ("one node", topo.multi_node(1, 8, 300e9, 50e9, 1e-6, 2e-6), [tuple(range(8))]),
    ],
)
def test_send_receive_schedules_skip_the_ring_search_with_the_same_plans(
    name, g, groups, monkeypatch
):
    """An all-to-all or a sendrecv runs on the group's system without rings (p2p_layout):
    NCCL's ring search is never run for it, and its plans (streams, latencies, times) are
    those of the family's default layout it ran on before."""
    from extrapolators.communication.nccl import system

    searched, search = [], system.order_and_alike

    def counted(*a, **k):
        searched.append(1)
        return search(*a, **k)

    monkeypatch.setattr(system, "order_and_alike", counted)
    _, _, light = model(g)
    for grp in groups:
        light.plan("all_to_all", grp, 3e6)
        light.plan("sendrecv", grp, 1e6)
    assert not searched  # no ring search for send/receive schedules
    _, _, full = model(g)
    full.analysis.p2p_layout = lambda grp: full.analysis.layout(
        full.analysis.family(grp), full.analysis.family(grp).default
    )
    for grp in groups:
        n = len(grp)
        sizes = tuple(tuple(float((i + 2 * j) % 5) * 1e5 for j in range(n)) for i in range(n))
        for op, x in (("all_to_all", 3e6), ("sendrecv", 1e6)):
            assert light.plan(op, grp, x) == full.plan(op, grp, x), (name, grp, op)
        assert light.plan_uneven(grp, sizes) == full.plan_uneven(grp, sizes)
        assert "order" not in light.analysis.p2p_layout(grp).system.__dict__  # not searched
        assert not light.analysis._families
