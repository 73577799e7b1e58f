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
    s = Sharded(t, make_model("trace", t), [0, 1], batch_size=16).shard
    assert s.names == ["layer0", "layer1", "layer2", "layer3"]
    assert [s.bytes[0, u] for u in range(4)] == [4e6] * 4  # chunk 0: no pipeline


def two_units_with_accumulate_grad(t_f=1e-3, t_b=2e-3, t_acc=0.1e-3, t_opt=0.5e-3, w=4e6):
    """Two linear layers u0, u1 as a real trace has them: each backward operator paired
    with its forward one makes the input gradient, and autograd's AccumulateGrad (no
    forward partner, the layer's name) then writes the weight's gradient."""
    from triosim.trace.model import Operator, Tensor, Trace

    tensors, ops = {}, []

    def tensor(cat, nbytes):
        t = Tensor(len(tensors), (8, 8), "float32", float(nbytes), cat)
        tensors[t.id] = t
        return t.id

    def op(name, layer, phase, t, ins, outs, fwd=None):
        ops.append(Operator(len(ops), name, layer, phase, t, ins, outs, t * 1e12, fwd_id=fwd))

    x, w0, w1 = tensor("input", 1e6), tensor("weight", w), tensor("weight", w)
    a0, a1 = tensor("activation", 1e6), tensor("activation", 1e6)
    op("aten::linear", "u0", "forward", t_f, (x, w0), (a0,))
    op("aten::linear", "u1", "forward", t_f, (a0, w1), (a1,))
    for u, (inp, weight) in ((1, (a0, w1)), (0, (x, w0))):
        g_in, g_w, buf = tensor("activation", 1e6), tensor("gradient", w), tensor("buffer", w)
        op("MmBackward0", f"u{u}", "backward", t_b, (inp, weight), (g_in, buf), fwd=u)
        op("torch::autograd::AccumulateGrad", f"u{u}", "backward", t_acc, (buf,), (g_w,))
    op("aten::_foreach_add_", "optimizer", "optimizer", t_opt, (w0, w1), ())
    return Trace(ops, tensors, {"batch_size": 8, "gpu": "H100-SXM"}).validate()


def test_fsdp_reduce_scatters_a_unit_once_its_gradients_are_ready():
    """By hand, 2 GPUs on a 10 GB/s ring (textbook): every gather and reduce-scatter of a
    unit moves (2 - 1) / 2 x 4 MB per GPU, 0.2 ms. Compute: forward u0 after its gather
    [0.2, 1.2], u1 [1.2, 2.2] (its gather prefetched), backward of u1 with its
    AccumulateGrad [2.2, 4.3], of u0 [4.3, 6.4] (gathered again at 2.2-2.4). u1's
    gradients are ready at 4.3: its reduce-scatter runs [4.3, 4.5], inside u0's backward;
    u0's [6.4, 6.6]; then the optimizer on half the weights. (The last unit used to hold
    every AccumulateGrad, so u1's reduce-scatter waited for the end of the backward pass,
    6.4, and the iteration took 0.2 ms longer.)"""
    t = two_units_with_accumulate_grad()
    cfg = {
        "num_gpus": 2,
        "batch_size": 16,
        "topology": RING,
        "parallelism": {"mode": "fsdp", "wrap_depth": 1},
        "communication": {"kind": "textbook"},
    }
    r = Simulation(cfg, trace=t).run()
    rs = r.timeline[(r.timeline.name == "reduce_scatter") & (r.timeline.gpu == 0)]
    starts = dict(zip(rs.layer, rs.start, strict=True))
    assert starts["u1"] == pytest.approx(4.3e-3, rel=1e-9)
    tl = r.timeline
    u0_backward = tl[(tl.kind == "compute") & (tl.layer == "u0") & (tl.phase == "backward")]
    assert starts["u1"] < u0_backward.end.max() == pytest.approx(6.4e-3, rel=1e-9)
    assert starts["u0"] == pytest.approx(6.4e-3, rel=1e-9)
    assert r.iteration_time == pytest.approx(6.6e-3 + 0.5e-3 / 2, rel=1e-9)
