"""Back-to-back iterations: the next forward waits for the optimizer; network state carries."""

import pytest

from tests.conftest import chain_trace
from triosim.simulation.wiring import Simulation


def run(k, mode="dp", network=None, n=4, **par):
    cfg = {
        "num_gpus": n,
        "iterations": k,
        "parallelism": {"mode": mode, **par},
        "topology": {"kind": "ring", "bandwidth": "10 GB/s", "latency": "1 us"},
    }
    if network:
        cfg["network"] = network
    return Simulation(cfg, trace=chain_trace(batch=8)).run()


def test_photonic_circuits_are_set_up_once():
    # DP's ring all-reduce sets up all 4 circuits at once in its first step, on the
    # critical path: the first iteration pays one 20 ms set-up, the second none
    net = {"kind": "photonic", "setup_time": "20 ms"}
    one, two = run(1, network=net), run(2, network=net)
    assert two.first_iteration_time == pytest.approx(one.iteration_time, rel=1e-12)
    assert two.first_iteration_time - two.iteration_time == pytest.approx(20e-3, rel=1e-9)
    assert two.network_stats["setups"] == one.network_stats["setups"] == 4
    assert two.total_time == pytest.approx(2 * one.iteration_time - 20e-3, rel=1e-9)


@pytest.mark.parametrize(
    "mode,par",
    [
        ("dp", {}),
        ("ddp", {}),
        ("tp", {}),
        ("gpipe", {"microbatches": 2}),
        ("1f1b", {"microbatches": 4}),
        ("hybrid", {"dp": 2, "inner": "gpipe", "microbatches": 2}),
    ],
)
def test_a_stateless_network_repeats_the_same_iteration(mode, par):
    one, three = run(1, mode, **par), run(3, mode, **par)
    assert three.iteration_times == pytest.approx([one.iteration_time] * 3, rel=1e-9)
    assert len(three.timeline) == 3 * len(one.timeline)


def test_the_next_iteration_starts_after_the_optimizer():
    r = run(2, "ddp")
    tl = r.timeline
    for g in r.gpus:
        first, second = (
            tl[(tl.gpu == g) & (tl.iteration == 0)],
            tl[(tl.gpu == g) & (tl.iteration == 1)],
        )
        last_opt = first[first.phase == "optimizer"]["end"].max()
        assert second["start"].min() >= last_opt - 1e-15
    assert "iteration time (steady state)" in r.summary() and "first iteration" in r.summary()
