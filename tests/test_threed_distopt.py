"""Megatron's distributed optimizer inside 3D parallelism (`mode: 3d` with
`distributed_optimizer: true`; extrapolators/modes/dist_optimizer.py, threed_streams.py):
per pipeline stage, gradients reduce-scattered over the stage's dp x cp GPUs, the step on
1/(dp x cp) of the stage's weights, the updated parameters all-gathered; memory 4 + 4 +
8/d bytes per held float32 parameter with AdamW (Megatron-LM's dist_optimizer.md, "fp32
param, fp32 grads: 8 + 8/d"). A 2-stage, 2-replica pipeline timed by hand, memory by hand,
invariants on random grids. (With one stage, 3D is mode cp with the distributed optimizer
digit for digit: tests/test_threed_cp.py.)

The trace is conftest's chain: L linear layers of W = 4 MB weights, forward 1 ms and
backward 2 ms per layer at the traced batch of 8, activations of 1 MB, optimizer 0.5 ms.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import chain_trace
from triosim.simulation.wiring import Simulation

W, ACT, T_F, T_B, T_OPT = 4e6, 1e6, 1e-3, 2e-3, 0.5e-3


def run(n, bw=10e9, lat=1e-6, memory=None, layers=4, batch_size=None, **par):
    cfg = {
        "num_gpus": n,
        "batch_size": batch_size,
        "parallelism": {"mode": "3d", **par},
        "topology": {"kind": "switch", "bandwidth": bw, "latency": lat},
        "communication": {"kind": "textbook"},
    }
    if memory:
        cfg["memory"] = memory
    s = Simulation(cfg, trace=chain_trace(layers=layers))
    r = s.run()
    r.extrapolator = s.extrapolator
    return r


def comm(r, g, name):
    tl = r.timeline
    t = tl[(tl.gpu == g) & (tl.kind == "comm") & (tl.name.astype(str) == name)]
    return t.sort_values("start")


def compute(r, g, phase):
    tl = r.timeline
    return tl[(tl.gpu == g) & (tl.kind == "compute") & (tl.phase == phase)].sort_values("start")


@pytest.mark.parametrize("bw", [10e9, 1e12])
def test_two_stages_two_replicas_timeline_by_hand(bw):
    """dp 2 x pp 2 on 4 GPUs (tp-pp-dp: stage 0 is GPUs 0 and 2, stage 1 GPUs 1 and 3), 1F1B
    with 2 micro-batches of 2 samples, 4 layers (2 per stage), dp_overlap off (the stage's
    gradients reduced at once after its schedule). At 2 samples a layer takes f = 1/4 ms
    forward, b = 1/2 ms backward; a stage 2f and 2b; a pipeline send carries 1/4 of the
    1 MB activation: s = lat + 0.25 MB / bw.

    Stage 0: F0 [0, 2f], F1 [2f, 4f]; stage 1: F0 from 2f + s, B0 after it, F1, B1 ending
    at e1 = 2f + s + 2 (2f + 2b); its last gradient leaves at e1 + s. Stage 0: B0 when
    stage 1's B0 gradient arrives, B1 when the second does: it ends at e0 = e1 + s + 2b.
    Then on each GPU: the reduce-scatter of its stage's 2 W = 8 MB over its 2 replicas
    (one ring step of 4 MB: X = lat + 4 MB / bw), the optimizer on 1/2 of the stage's
    half of the weights (T_OPT / 4), the all-gather of the 8 MB (X). Without the
    distributed optimizer the all-reduce is 2 X and the optimizer T_OPT / 2: the
    distributed optimizer's iteration is T_OPT / 4 shorter."""
    lat = 1e-6
    par = dict(dp=2, pp=2, microbatches=2, dp_overlap=False)
    r = run(4, bw, lat, distributed_optimizer=True, **par)
    plain = run(4, bw, lat, **par)
    f, b = T_F / 4, T_B / 4
    s = lat + ACT / 4 / bw
    e1 = 2 * f + s + 2 * (2 * f + 2 * b)
    e0 = e1 + s + 2 * b
    X = lat + 2 * W / 2 / bw
    for g in range(4):
        end = e0 if g in (0, 2) else e1 + s  # the stage's gradients are complete
        rs, ag = comm(r, g, "reduce_scatter"), comm(r, g, "all_gather")
        assert rs.nbytes.tolist() == [2 * W] and ag.nbytes.tolist() == [2 * W]
        assert rs.start.tolist() == pytest.approx([end], rel=1e-9)
        assert rs.end.tolist() == pytest.approx([end + X], rel=1e-9)
        opt = compute(r, g, "optimizer")
        assert opt.start.min() == pytest.approx(end + X, rel=1e-9)
        assert (opt.end - opt.start).sum() == pytest.approx(T_OPT / 4, rel=1e-9)
        assert ag.start.tolist() == pytest.approx([end + X + T_OPT / 4], rel=1e-9)
        assert ag.end.tolist() == pytest.approx([end + 2 * X + T_OPT / 4], rel=1e-9)
        assert comm(r, g, "allreduce").empty
        assert comm(plain, g, "allreduce").nbytes.tolist() == [2 * W]
    assert r.iteration_time == pytest.approx(e0 + 2 * X + T_OPT / 4, rel=1e-9)
    assert plain.iteration_time == pytest.approx(r.iteration_time + T_OPT / 4, rel=1e-9)


@pytest.mark.parametrize("distopt", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
def test_memory_per_gpu_by_hand(distopt, overlap):
    """dp 2 x tp 2 x pp 2 on 8 GPUs, 8 layers, AdamW in float32: a stage holds 4 layers,
    each split over tp 2: P = 4 W / 2 / 4 bytes = 2e6 parameters per GPU. Weights 4 P; the
    gradients 4 P in the bucket buffers (DDP: plus the gradient tensors, 4 P, and no
    buffer without dp_overlap; the distributed optimizer: Megatron's gradient buffer
    only, with or without buckets); AdamW's states 8 P, over the
    stage's dp = 2 GPUs with the distributed optimizer: 4 + 4 + 8/2 = 12 bytes a
    parameter (8 + 8/d)."""
    mem = {"optimizer": "adamw", "capacity": 80e9, "workspace": 0}
    r = run(8, memory=mem, layers=8, dp=2, tp=2, pp=2, microbatches=2,
            distributed_optimizer=distopt, dp_overlap=overlap)  # fmt: skip
    P = 4 * W / 2 / 4
    m = r.memory.groupby("gpu")
    assert m.weights.max().tolist() == pytest.approx([4 * P] * 8, rel=1e-12)
    assert m.gradients.max().tolist() == pytest.approx([0.0 if distopt else 4 * P] * 8)
    buffers = 4 * P if distopt or overlap else 0.0
    assert m.buffers.min().tolist() == pytest.approx([buffers] * 8, rel=1e-12)
    states = 8 * P / (2 if distopt else 1)
    assert m.optimizer_states.max().tolist() == pytest.approx([states] * 8, rel=1e-12)
    if distopt:  # weights, the gradient buffer, the states' shard: 8 + 8/d
        static = (m.weights.max() + m.buffers.min() + m.optimizer_states.max()) / P
        assert static.tolist() == pytest.approx([4 + 4 + 8 / 2] * 8, rel=1e-12)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2]),
    m=st.sampled_from([1, 2, 4]),
    overlap=st.booleans(),
    bw=st.floats(1, 100),
)
def test_random_grids_shard_each_stage_over_its_replicas(dp, pp, tp, m, overlap, bw):
    """Any dp x tp x pp grid: each GPU reduce-scatters exactly its stage's TP shard over
    its dp GPUs (buckets or at once) and all-reduces none of it, steps the optimizer on
    1/dp of that shard after the reduction, and all-gathers the shard once, after its
    step; the iteration ends with the last all-gather. Nothing is moved with dp 1."""
    n = dp * pp * tp
    r = run(n, bw * 1e9, layers=8, dp=dp, tp=tp, pp=pp, microbatches=m, dp_overlap=overlap,
            distributed_optimizer=True, batch_size=16)  # fmt: skip
    ex = r.extrapolator
    shard = 8 * W / pp / tp  # a stage's 8 / pp layers, each split over tp
    for g in range(n):
        p, _, _, _, t = ex.layout.coord[g]  # (pp, dp_replicate, dp_shard, cp, tp)
        assert ex.weights.stage_bytes[p] == pytest.approx(shard)
        assert set(ex.group(g, "dp_replicate")) == {ex.layout.at[p, k, 0, 0, t] for k in range(dp)}
        rs, ag = comm(r, g, "reduce_scatter"), comm(r, g, "all_gather")
        tl = r.timeline
        grads = tl[(tl.gpu == g) & tl.layer.astype(str).str.match(r"bucket|gradients")]
        opt = compute(r, g, "optimizer")
        assert (opt.end - opt.start).sum() == pytest.approx(T_OPT / pp / tp / dp, rel=1e-9)
        if dp == 1:
            assert rs.empty and ag.empty
            continue
        assert rs.nbytes.sum() == pytest.approx(shard)
        assert set(grads.name.astype(str)) == {"reduce_scatter"}  # no all-reduce of them
        assert ag.nbytes.tolist() == pytest.approx([shard])
        assert opt.start.min() >= rs.end.max() - 1e-15
        assert ag.start.min() >= opt.end.max() - 1e-15
        assert r.iteration_time >= ag.end.max() - 1e-15
