"""ZeRO-1/2/3 and FSDP: traffic, memory and overlap against hand calculations."""

import pytest

from tests.conftest import chain_trace
from triosim.simulation.wiring import Simulation

RING = {"kind": "ring", "bandwidth": "10 GB/s", "latency": 0}
FREE = {"kind": "ring", "bandwidth": 1e30, "latency": 0.0}


def run(mode, n=4, topology=RING, **par):
    t = chain_trace(batch=8, layers=4)  # 4 units of 4 MB of weights
    cfg = {
        "num_gpus": n,
        "batch_size": 8 * n,
        "topology": topology,
        "parallelism": {"mode": mode, **par},
        "communication": {"kind": "textbook"},
    }  # closed forms: the alpha-beta ring
    return Simulation(cfg, trace=t).run(), t


@pytest.mark.parametrize("n", [2, 4])
def test_zero3_moves_one_and_a_half_times_dp_and_holds_a_shard(n):
    # ring all-reduce sends 2(N-1)/N x W per GPU; ZeRO-3 all-gathers W before forward and
    # before backward and reduce-scatters W: 3 (N-1)/N x W, 1.5x
    dp, t = run("dp", n)
    z3, _ = run("fsdp", n, stage=3)
    assert z3.bytes_delivered == pytest.approx(1.5 * dp.bytes_delivered, rel=1e-12)
    w = t.weight_bytes()
    assert z3.memory.groupby("gpu")["weights"].max().tolist() == [w / n] * n
    assert dp.memory.groupby("gpu")["weights"].max().tolist() == [w] * n


def test_zero_stages_shard_states_and_move_what_they_should():
    dp, t = run("dp")
    w, n = t.weight_bytes(), 4
    z1, _ = run("fsdp", stage=1)  # all-reduce + all-gather of the updated parameters
    z2, _ = run("fsdp", stage=2)  # reduce-scatter + all-gather: the all-reduce's volume
    assert z1.bytes_delivered == pytest.approx(dp.bytes_delivered + n * (n - 1) / n * w)
    assert z2.bytes_delivered == pytest.approx(dp.bytes_delivered)
    g1 = z1.memory[z1.memory.gpu == 0].max()
    g2 = z2.memory[z2.memory.gpu == 0].max()
    assert (g1["weights"], g1["gradients"]) == (w, w)
    assert (g2["weights"], g2["gradients"]) == (w, w / n)


def test_zero3_on_a_free_network_is_compute_with_a_sharded_optimizer_step():
    # forward 4 x 1 ms + backward 4 x 2 ms at the traced batch, optimizer 0.5 ms / 4 GPUs
    z3, _ = run("fsdp", topology=FREE, stage=3)
    assert z3.iteration_time == pytest.approx(12e-3 + 0.5e-3 / 4, rel=1e-12)


def test_zero3_overlaps_gathers_with_compute():
    # each unit's gather (3 MB at 10 GB/s = 0.3 ms) is shorter than a unit's forward (1 ms):
    # only the first gather and the last reduce-scatter are exposed
    z3, _ = run("fsdp", stage=3)
    exposed = 2 * 0.75 * 4e6 / 10e9
    assert z3.iteration_time == pytest.approx(12e-3 + 0.5e-3 / 4 + exposed, rel=1e-9)


def test_units_follow_the_wrap_depth():
    from extrapolators.modes import Sharded
    from perfmodel import make_model

    t = chain_trace(batch=8, layers=4)
    s = Sharded(t, make_model("trace", t), [0, 1])
    assert s.unit_names == ["layer0", "layer1", "layer2", "layer3"]
    assert s.unit_weights == [4e6] * 4
