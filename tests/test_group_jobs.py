"""The packet engine's group jobs (networks.packet.groupjobs): a transfer group alone on
its links runs in closed form, and is split into flows when other traffic touches its
links. Checked against hand calculations, against the flow table's way (jobs off) bit
for bit where nothing else runs, and to round-off in random scenarios."""

import numpy as np
import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from networks import PacketSwitchNetwork
from networks import topology as topo
from networks.packet.groupjobs import GroupJobs
from tests.test_engine_fuzz import _close, _conserved, _graph, _scenario

GB = 1e9


def _star(n=4, bw=100 * GB, lat=2e-6):
    """n GPUs on one switch: GPU -> switch -> GPU crosses two links of `bw`, `lat`/2 each."""
    env = simpy.Environment()
    return env, PacketSwitchNetwork(env, topo.switch_star(n, bw, lat))


def test_a_lone_group_is_one_job_at_its_closed_form():
    env, net = _star()
    # 0 -> 1 and 2 -> 3 share no link: each alone at 100 GB/s; lands 2 us after it left
    ev = net.transfer_all([(0, 1, 1e9), (2, 3, 1e9)])
    env.run()
    ends = [r.end for r in ev.value]
    assert ends == [pytest.approx(1e9 / (100 * GB) + 2e-6, rel=1e-12)] * 2
    assert (net.group_jobs, net.group_splits, net.in_flight) == (1, 0, 0)
    assert net.bytes_delivered == 2e9 == net.bytes_sent
    # each link busy while the group sent (0.01 s), carrying its flow's bytes
    stats = net.link_stats().set_index(["src", "dst"])
    assert stats.loc[(0, "nvswitch"), "busy_time"] == pytest.approx(0.01, rel=1e-12)
    assert stats.loc[(2, "nvswitch"), "bytes"] == 1e9


def test_a_capped_job_counts_its_links_utilisation():
    # capped at 40 GB/s, the flows load their 100 GB/s links to 0.4
    env, net = _star()
    ev = net.transfer_all([(0, 1, 1e9, 40 * GB), (2, 3, 1e9, 40 * GB)])
    env.run()
    assert [r.end for r in ev.value] == [pytest.approx(1e9 / (40 * GB) + 2e-6, rel=1e-12)] * 2
    assert net.group_jobs == 1 and net.max_utilisation == pytest.approx(0.4, rel=1e-12)


def test_a_group_whose_flows_end_apart_takes_the_table():
    # 1 GB and 0.5 GB on separate links: the timer after 5 ms leaves the 1 GB flow half
    # sent (a second round): not a job; each lands when its own bytes are sent
    env, net = _star()
    ev = net.transfer_all([(0, 1, 1e9), (2, 3, 5e8)])
    env.run()
    assert sorted(r.end for r in ev.value) == pytest.approx([5e-3 + 2e-6, 1e-2 + 2e-6], rel=1e-12)
    assert net.group_jobs == 0


def test_a_transfer_that_touches_a_job_splits_it():
    # 1 GB from 0 to 1 and from 3 to 2, at 100 GB/s; at 5 ms another 1 GB from 0 to 2
    # shares 0's link with the first and 2's with the second: all three at 50 GB/s, so
    # the group's last 0.5 GB each take 10 ms more (end 15 ms), and the third then has
    # 0.5 GB left at 100 GB/s (ends 20 ms); each lands 2 us later
    env, net = _star()
    first = net.transfer_all([(0, 1, 1e9), (3, 2, 1e9)])
    ends = {}

    def later():
        yield env.timeout(5e-3)
        recs = yield net.transfer_all([(0, 2, 1e9)])
        ends["second"] = recs[0].end

    env.process(later())
    env.run()
    a, b = (r.end for r in first.value)
    assert a == pytest.approx(15e-3 + 2e-6, rel=1e-12)
    assert b == pytest.approx(15e-3 + 2e-6, rel=1e-12)
    assert ends["second"] == pytest.approx(20e-3 + 2e-6, rel=1e-12)
    assert (net.group_jobs, net.group_splits) == (1, 1)  # the first a job, split at 5 ms
    _conserved(net)


def _lone_groups(seed: int, jobs: bool):
    """Random transfer groups on a random topology, one at a time (each starts when the
    last landed): what each gives, with group jobs on or off."""
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, _graph(int(rng.integers(0, 8)), rng))
    gpus = list(net.gpus)
    out = []

    def run():
        for _ in range(6):
            ts = []
            for _ in range(int(rng.integers(1, 6))):
                a, b = (gpus[int(x)] for x in rng.choice(len(gpus), 2, replace=False))
                t = (a, b, float(rng.choice([1e6, 4e6, float(rng.uniform(1e3, 3e7))])))
                ts.append(t + ((float(rng.uniform(1, 20)) * GB,) if rng.random() < 0.2 else ()))
            recs = yield net.transfer_all(ts)
            out.append([(r.start, r.end) for r in recs])

    with pytest.MonkeyPatch.context() as m:
        m.setattr(GroupJobs, "enabled", jobs)
        env.process(run())
        env.run()
    _conserved(net)
    return out, net


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_alone_a_job_gives_the_tables_times_bit_for_bit(seed):
    on, net_on = _lone_groups(seed, True)
    off, net_off = _lone_groups(seed, False)
    assert on == off
    assert np.array_equal(net_on.link_bytes, net_off.link_bytes)
    assert np.array_equal(net_on.link_busy, net_off.link_busy)
    assert net_on.max_utilisation == net_off.max_utilisation


def test_the_lone_groups_reach_jobs_and_the_table():
    """The comparison above runs both ways: some groups are jobs, some need the table."""
    jobs = tabled = 0
    for seed in range(10):
        out, net = _lone_groups(seed, True)
        jobs += net.group_jobs
        tabled += len(out) - net.group_jobs
    assert jobs >= 10 and tabled >= 10, (jobs, tabled)


@pytest.mark.no_cover
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), kind=st.integers(0, 7))
def test_random_scenarios_agree_with_jobs_off_to_round_off(seed, kind):
    """Concurrent groups, p2p, rings: a job's times differ from the table's only by
    round-off (the table moves a group's bytes at every other flow's event)."""
    on = _scenario("fast", seed, kind)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(GroupJobs, "enabled", False)
        off = _scenario("fast", seed, kind)
    assert len(on[0]) == len(off[0]) and len(on[1]) == len(off[1])
    for (k1, a1, t1), (k2, a2, t2) in zip(on[0], off[0], strict=True):
        assert (k1, a1) == (k2, a2) and _close(t1, t2), (t1, t2)
    for r, f in zip(on[1], off[1], strict=True):
        assert r[:3] == f[:3] and r[5] == f[5] and _close(r[3], f[3]) and _close(r[4], f[4])
    assert np.array_equal(on[2], off[2])  # bytes: added at each start, in the same order
    np.testing.assert_allclose(on[3], off[3], rtol=1e-9, atol=1e-15)


def test_the_scenarios_reach_jobs_and_splits():
    jobs = splits = 0
    for seed in range(20):
        for kind in (0, 2, 5):
            net = _scenario("fast", seed, kind)[4]
            jobs, splits = jobs + net.group_jobs, splits + net.group_splits
    assert jobs >= 40 and splits >= 5, (jobs, splits)


def test_flow_rates_see_a_jobs_flows():
    env, net = _star()
    net.transfer_all([(0, 1, 1e9), (2, 3, 1e9)])
    env.run(until=1e-3)
    assert net.flow_rates().tolist() == [100 * GB, 100 * GB]
    env.run()
    assert net.in_flight == 0 and net.bytes_delivered == 2e9


def test_a_flow_with_less_time_left_than_the_clock_resolves_is_done_with_the_job():
    # at t = 1,000 s the clock resolves 1e-12 x 1,000 = 1 ns: a flow 1e-8 of its bytes
    # (0.1 ns at 100 GB/s) behind the other is done at the same timer, as in the table
    def run(jobs: bool):
        env, net = _star()
        out = {}

        def proc():
            yield env.timeout(1000.0)
            recs = yield net.transfer_all([(0, 1, 1e9), (2, 3, 1e9 * (1 + 1e-8))])
            out["ends"] = [r.end for r in recs]

        with pytest.MonkeyPatch.context() as m:
            m.setattr(GroupJobs, "enabled", jobs)
            env.process(proc())
            env.run()
        return out["ends"], net.group_jobs

    (ends, jobs), (table_ends, _) = run(True), run(False)
    assert jobs == 1 and ends == table_ends and ends[0] == ends[1]


def test_a_callback_that_starts_transfers_where_a_group_lands_inside_a_solve():
    # no latency: the table's group (unequal sizes: not a job) lands in the solve that
    # retires it; its callback (transfer_all_then) starts two more transfers, which must
    # run: the callback waits for the solve to end (a review found them stuck before)
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.switch_star(4, 10 * GB, 0.0))
    net.check_solves = True
    later = []

    def then(_records):
        later.append(net.transfer_all([(0, 1, 5e8), (2, 3, 1e8)]))

    net.transfer_all_then(net.batch([(0, 1, 1e8), (1, 0, 2e8)]), then)
    env.run()
    # 0.2 GB at 10 GB/s, then 0.5 GB at 10 GB/s
    assert [r.end for r in later[0].value] == pytest.approx([0.07, 0.03], rel=1e-12)
    assert net.in_flight == 0 and net.bytes_delivered == net.bytes_sent == 9e8


def _two_land_at_once(jobs: bool, engine: str = "fast"):
    # A (2 -> 3) sends from 0 to 6u, lands at 7u; B (0 -> 1) sends from u to 3u with
    # 4u of latency: lands at 7u too (u = 2^-12 s, so every sum is exact)
    import networkx as nx

    u = 2.0**-12
    g = nx.DiGraph()
    for i in range(4):
        g.add_node(i, kind="gpu")
    topo.add_link(g, 2, 3, 2.0**30, u)
    topo.add_link(g, 0, 1, 2.0**30, 4 * u)
    topo.add_link(g, 1, 2, 2.0**30, u)
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, g, engine=engine)
    order = []

    def a():
        r = yield net.transfer_all([(2, 3, 3 * 2.0**19)])
        order.append(("A", r[0].end))

    def b():
        yield env.timeout(u)
        r = yield net.transfer_all([(0, 1, 2.0**19)])
        order.append(("B", r[0].end))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(GroupJobs, "enabled", jobs)
        env.process(a())
        env.process(b())
        env.run()
    return order, net


def test_landings_at_one_instant_come_in_the_tables_order():
    on, net = _two_land_at_once(True)
    assert net.group_jobs == 2
    assert on == _two_land_at_once(False)[0] == _two_land_at_once(True, "reference")[0]
    assert on == [("B", 7 * 2.0**-12), ("A", 7 * 2.0**-12)]


def test_flow_rates_come_in_the_order_the_groups_started():
    # a job (capped at 40 GB/s) from 0; at 1 ms a group that takes the table (unequal
    # sizes); at 2 ms the rates read split the job into the table, after the other group
    env, net = _star(8, lat=2e-6)
    net.transfer_all([(0, 1, 1e9, 40 * GB)])
    got = {}

    def later():
        yield env.timeout(1e-3)
        net.transfer_all([(2, 3, 1e9), (4, 5, 5e8)])
        yield env.timeout(1e-3)
        got["rates"] = net.flow_rates().tolist()

    env.process(later())
    env.run()
    assert got["rates"] == [40 * GB, 100 * GB, 100 * GB]
    assert net.group_splits == 1
