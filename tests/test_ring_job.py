"""The packet network's ring jobs (`net.ring` on free links): hand-computed step times,
the split when other traffic arrives mid-job, the same outputs as the per-step reference
engine, and the exact repeated sums the job's counters rely on."""

import numpy as np
import pandas as pd
import pytest
import simpy
from conftest import chain_trace
from hypothesis import given
from hypothesis import strategies as st

from extrapolators.communication import collectives
from networks import PacketSwitchNetwork
from networks import topology as topo
from networks.groups import repeat_add
from triosim.simulation.wiring import Simulation

GB = 1e9


def _ring4(engine):
    """A 4-GPU ring whose link 2->3 is slower (4 GB/s, 3 us) than the rest (10 GB/s, 1 us)."""
    env = simpy.Environment()
    g = topo.ring(4, 10 * GB, 1e-6)
    topo.set_link(g, 2, 3, bandwidth=4 * GB, latency=3e-6)
    return env, PacketSwitchNetwork(env, g, engine=engine)


def test_a_lone_ring_job_takes_the_slowest_hop_each_step():
    # every step ends when the slow hop's chunk has crossed: chunk/4 GB/s + 3 us; the
    # all-reduce is 2(N-1) = 6 such steps
    env, net = _ring4("fast")
    env.process(collectives.ring_allreduce(env, net, (0, 1, 2, 3), 4e8))
    env.run()
    assert env.now == pytest.approx(6 * (1e8 / (4 * GB) + 3e-6), rel=1e-12)
    assert (net.ring_jobs, net.ring_splits) == (1, 0)
    assert len(net.records) == 6 * 4 and net.in_flight == 0
    # each ring link carried 6 chunks; the fast links were busy chunk/10 GB/s per step
    stats = net.link_stats().set_index(["src", "dst"])
    assert stats.loc[(0, 1), "bytes"] == 6e8 and stats.loc[(1, 0), "bytes"] == 0
    assert stats.loc[(0, 1), "busy_time"] == pytest.approx(6 * 1e8 / (10 * GB), rel=1e-12)
    assert stats.loc[(2, 3), "busy_time"] == pytest.approx(6 * 1e8 / (4 * GB), rel=1e-12)


@pytest.mark.parametrize("at", [0.0, 1e-3, 0.0101, 0.02, 0.0603])
def test_a_transfer_mid_job_splits_it_and_both_engines_agree(at):
    def run(engine):
        env, net = _ring4(engine)
        ring = env.process(collectives.ring_allreduce(env, net, (0, 1, 2, 3), 4e8))
        p2p = []

        def late():
            yield env.timeout(at)
            ev = net.transfer(1, 2, 5e7)  # crosses the ring's link 1->2
            yield ev
            p2p.append(env.now)

        env.process(late())
        env.run()
        recs = sorted((r.src, r.dst, r.start, r.end) for r in net.records)
        return ring.value, env.now, p2p, recs, net.link_stats(), net

    ref, fast = run("reference"), run("fast")
    assert fast[1] == pytest.approx(ref[1], rel=1e-12)
    assert fast[2] == pytest.approx(ref[2], rel=1e-12)
    np.testing.assert_allclose([r[2:] for r in fast[3]], [r[2:] for r in ref[3]], rtol=1e-12)
    assert [r[:2] for r in fast[3]] == [r[:2] for r in ref[3]]
    cols = ["bytes", "busy_time"]
    np.testing.assert_allclose(fast[4][cols], ref[4][cols], rtol=1e-12)
    net = fast[5]
    assert net.ring_splits == (1 if at < 6 * (1e8 / (4 * GB) + 3e-6) else 0)
    assert net.bytes_sent == pytest.approx(net.bytes_delivered) and net.in_flight == 0


def test_simulation_outputs_match_the_reference_engine():
    # DDP over a textbook ring: the timeline, the per-transfer table and the link table
    # of the fast engine (ring jobs) equal the reference engine's
    def run(engine):
        cfg = {
            "num_gpus": 4,
            "parallelism": {"mode": "ddp", "bucket_size": 4e6},
            "communication": {"kind": "textbook"},
            "topology": {"kind": "ring"},
            "network": {"kind": "packet", "engine": engine},
        }
        return Simulation(cfg, trace=chain_trace(batch=8)).run()

    ref, fast = run("reference"), run("fast")
    assert fast.iteration_time == ref.iteration_time
    pd.testing.assert_frame_equal(fast.timeline, ref.timeline)
    pd.testing.assert_frame_equal(fast.transfers(), ref.transfers())
    pd.testing.assert_frame_equal(fast.links, ref.links)
    assert fast.bytes_delivered == ref.bytes_delivered


@given(
    acc=st.one_of(st.floats(0, 1e15), st.integers(0, 2**40).map(float)),
    c=st.one_of(st.floats(0, 1e10), st.integers(0, 2**30).map(lambda x: x / 1024)),
    k=st.integers(0, 3000),
)
def test_repeat_add_is_the_sequential_sum(acc, c, k):
    total = acc
    for _ in range(k):
        total += c
    assert repeat_add(acc, c, k) == total


def test_link_stats_asked_mid_job_count_what_was_done_so_far():
    # the reference engine's per-link bytes and busy time at an instant inside the job,
    # and the same final result after the fast engine split the job to answer
    def run(engine):
        env, net = _ring4(engine)
        env.process(collectives.ring_allreduce(env, net, (0, 1, 2, 3), 4e8))
        seen = []

        def ask():
            yield env.timeout(0.0333)
            seen.append(net.link_stats()[["bytes", "busy_time"]].to_numpy())

        env.process(ask())
        env.run()
        return seen[0], net.link_stats()[["bytes", "busy_time"]].to_numpy(), env.now

    ref, fast = run("reference"), run("fast")
    np.testing.assert_allclose(fast[0], ref[0], rtol=1e-12)
    np.testing.assert_allclose(fast[1], ref[1], rtol=1e-12)
    assert fast[2] == pytest.approx(ref[2], rel=1e-12)
