"""Hop (decentralized training with update and token queues) and heterogeneity."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import chain_trace
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation

RING = {"kind": "ring", "bandwidth": "10 GB/s", "latency": "1 us"}


def hop(n=4, k=3, topology=RING, heterogeneity=None, trace=None, **opts):
    cfg = {
        "num_gpus": n,
        "batch_size": 2 * n,
        "iterations": k,
        "topology": topology,
        "parallelism": {"mode": "hop", **opts},
    }
    if heterogeneity:
        cfg["heterogeneity"] = heterogeneity
    return Simulation(cfg, trace=trace or chain_trace(batch=8, layers=2)).run()


def test_homogeneous_ring_matches_the_hand_schedule():
    # per worker (batch 8 / 4 GPUs = 2 of the traced 8): forward 2 x 1 ms / 4, backward
    # 2 x 2 ms / 4 -> C = 1.5 ms; optimizer O = 0.5 ms. Each worker sends its 8 MB of weights
    # to both ring neighbours over separate links: W = 8e6 / 10e9 + 1 us. With b = 0 and no
    # staleness every iteration is C + W + O, back to back.
    c, o, w = 1.5e-3, 0.5e-3, 8e6 / 10e9 + 1e-6
    r = hop(k=3)
    assert r.iteration_times == pytest.approx([c + w + o] * 3, rel=1e-12)
    assert r.total_time == pytest.approx(3 * (c + w + o), rel=1e-12)
    # no global collective: only the 2 x 4 point-to-point updates per iteration
    assert r.collective_bytes == {} and len(r.transfers()) == 3 * 8


def test_staleness_hides_the_update_transfer():
    # with s = 1 a worker uses last iteration's updates, which arrived while it computed
    # (W = 0.8 ms < C + O = 2 ms): after the first iteration only C + O remains
    c, o = 1.5e-3, 0.5e-3
    r = hop(k=4, staleness=1)
    assert r.iteration_times[1:3] == pytest.approx([c + o] * 2, rel=1e-9)


def test_a_worker_reports_what_it_waited_for():
    r = hop(k=2, heterogeneity={"compute": {1: 3.0}})
    waits = r.timeline[(r.timeline.gpu == 0) & (r.timeline.kind == "wait")]
    assert waits["key"].str.contains("hop:upd:1->0").any()  # GPU 0 waited for slow GPU 1


def test_infinite_staleness_never_deadlocks_and_never_waits_for_updates():
    r = hop(k=5, staleness=10, heterogeneity={"compute": {2: 4.0}}, max_gap=100)
    assert not r.timeline["key"].fillna("").str.contains("p2p:hop:upd").any()
    fast = r.timeline[(r.timeline.gpu == 0) & (r.timeline.kind == "compute")]
    assert fast["end"].max() == pytest.approx(5 * 2e-3, rel=1e-9)  # never held back


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    slow=st.lists(st.floats(1.0, 6.0), min_size=6, max_size=6),
    b=st.integers(0, 1),
    s=st.integers(0, 2),
    gap=st.integers(1, 3),
)
def test_token_queues_bound_how_far_a_worker_runs_ahead(slow, b, s, gap):
    k = 6
    r = hop(
        n=6,
        k=k,
        topology={"kind": "ring_chord", "bandwidth": "10 GB/s"},
        heterogeneity={"compute": dict(enumerate(slow))},
        backup_workers=b,
        staleness=s,
        max_gap=gap,
    )
    tl = r.timeline[(r.timeline.stream == "compute") & (r.timeline.kind == "compute")]
    begin = tl.groupby(["gpu", "iteration"])["start"].min()
    end = tl.groupby(["gpu", "iteration"])["end"].max()
    pairs = [(w, (w + d) % 6) for w in range(6) for d in (1, 3, 5)]  # ring + chords
    for w, j in pairs:
        for it in range(gap, k):
            assert begin[(w, it)] >= end[(j, it - gap)] - 1e-12, (w, j, it)


def test_backup_workers_must_leave_one_update_to_wait_for():
    with pytest.raises(ConfigError, match="parallelism.backup_workers.*smallest in-degree"):
        hop(backup_workers=2)  # a ring's workers have 2 in-neighbours


def test_a_backup_worker_lets_the_fast_go_on_without_the_slowest():
    het = {"compute": {3: 5.0}}
    wait, go_on = (
        hop(n=4, k=6, heterogeneity=het),
        hop(n=4, k=6, heterogeneity=het, backup_workers=1, max_gap=2),
    )
    tl = go_on.timeline
    fast_b = tl[(tl.gpu == 0) & (tl.kind == "compute")]["end"].max()
    tl = wait.timeline
    fast_0 = tl[(tl.gpu == 0) & (tl.kind == "compute")]["end"].max()
    assert fast_b < fast_0


# -- heterogeneity for every mode ---------------------------------------------------------------


def test_a_slow_gpu_slows_data_parallelism_by_its_extra_compute():
    base = {"num_gpus": 4, "parallelism": {"mode": "dp"}, "topology": RING}
    t = chain_trace(batch=8)
    fast = Simulation(base, trace=t).run()
    slow = Simulation({**base, "heterogeneity": {"compute": {2: 2.0}}}, trace=t).run()
    # GPU 2's forward + backward (3 ms) and optimizer (0.5 ms) take twice as long
    assert slow.iteration_time - fast.iteration_time == pytest.approx(3e-3 + 0.5e-3, rel=1e-9)


def test_random_bandwidth_slowdowns_are_reproducible_and_in_range():
    base = {
        "num_gpus": 8,
        "parallelism": {"mode": "dp"},
        "topology": {"kind": "ring"},
        "heterogeneity": {"random": [{"target": "bandwidth", "low": 1, "high": 10}]},
    }
    t = chain_trace(batch=8)
    a, b = Simulation({**base, "seed": 3}, trace=t), Simulation({**base, "seed": 3}, trace=t)
    bw = [d["bandwidth"] for _, _, d in a.graph.edges(data=True)]
    assert bw == [d["bandwidth"] for _, _, d in b.graph.edges(data=True)]
    assert all(65e9 / 10 <= x <= 65e9 for x in bw) and len(set(bw)) > 1
    other = Simulation({**base, "seed": 4}, trace=t)
    assert bw != [d["bandwidth"] for _, _, d in other.graph.edges(data=True)]


def test_heterogeneity_errors():
    with pytest.raises(ConfigError, match=r"heterogeneity.compute\[9\].*a GPU"):
        hop(heterogeneity={"compute": {9: 2.0}})
    with pytest.raises(ConfigError, match=r"heterogeneity.compute.*> 0"):
        hop(heterogeneity={"compute": {1: -2.0}})
    with pytest.raises(ConfigError, match=r"heterogeneity.links\[0\].*a link"):
        hop(heterogeneity={"links": [{"src": 0, "dst": 2, "factor": 2}]})
