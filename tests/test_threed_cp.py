"""Context parallelism as a degree of 3D parallelism (`mode: 3d` with `cp`): each data-parallel
replica's pipeline runs on cp GPUs per (stage, TP rank), each with 1/cp of the tokens, the
attention across them as mode cp does it (ring attention or Ulysses, cp_attention.py).

Checked: with one stage it is mode cp (with tp) digit for digit, timelines and memory; a
2-stage x 2-rank pipeline with ring attention timed by hand; the degree checks; the ring's
bytes and each GPU's compute on random dp x pp x cp layouts.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_context_parallel import AB, B0, B2, F0, F2, OPT, A, attention_trace
from tests.test_cp_tp import block_trace, rows
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation

GB = 1e9


def sim(trace, n, par, bw=100 * GB, latency=1e-6):
    s = Simulation(
        {
            "num_gpus": n,
            "topology": {"kind": "switch", "bandwidth": bw, "latency": latency},
            "parallelism": par,
            "communication": {"kind": "textbook"},
        },
        trace=trace,
    )
    r = s.run()
    r.extrapolator = s.extrapolator
    return r


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("distopt", [False, True])
def test_one_stage_is_mode_cp_exactly(comm, sp, distopt):
    """dp 2 x cp 2 x tp 2, pp 1: the same grid (TP innermost, then CP, then DP), the same
    TP plan on each CP rank's tokens, the same ring or all-to-alls, the same gradient
    buckets over the dp x cp GPUs of each TP rank (with the distributed optimizer
    reduce-scattered, the step on 1/4, the parameters all-gathered): every task at the
    same instant, the same memory."""
    t = block_trace(b=4)
    par = {"cp": 2, "tp": 2, "cp_comm": comm, "sequence_parallel": sp}
    par["distributed_optimizer"] = distopt
    a = sim(t, 8, {"mode": "cp", **par})
    b = sim(t, 8, {"mode": "3d", "dp": 2, "pp": 1, **par})
    assert a.iteration_time == b.iteration_time
    for g in range(8):
        for kind in ("compute", "comm"):
            x, y = rows(a, g, kind), rows(b, g, kind)
            assert x.nbytes.tolist() == y.nbytes.tolist()
            assert x.start.tolist() == y.start.tolist() and x.end.tolist() == y.end.tolist()
    assert a.peak_memory == b.peak_memory


@pytest.mark.parametrize("bw", [2 * GB, 100 * GB])  # a ring transfer longer / shorter than a step
@pytest.mark.parametrize("distopt", [False, True])
def test_two_stages_of_two_ring_ranks_timeline_by_hand(bw, distopt):
    """pp 2 x cp 2 on 4 GPUs (stage 0: GPUs 0, 1; stage 1: 2, 3), one micro-batch of 2
    sequences, each GPU 1 sequence's tokens (r = 1/2). Stage 0 holds layer 0, stage 1
    layer 1 and the loss. The activation each CP rank passes on is its half; the ring
    steps are A / 4 (forward) and AB / 4 (backward) with the blocks sent between them; the
    gradients are reduced over each stage's 2 CP ranks after the schedule
    (dp_overlap false), the optimizer on the stage's half of the weights; with the
    distributed optimizer reduce-scattered (one ring step of half the bytes), the
    optimizer on 1/2 of that, the parameters all-gathered after it (one step)."""
    lat, t = 1e-6, attention_trace(b=2, layers=2)
    par = {"mode": "3d", "dp": 1, "pp": 2, "cp": 2, "microbatches": 1, "dp_overlap": False}
    par["distributed_optimizer"] = distopt
    r = sim(t, 4, par, bw, lat)
    ex = r.extrapolator
    assert [op.layer for op in ex.pipe.fwd_ops[0] if op.tp_split] == ["l0.qkv"]
    assert ex.group(0, "cp") == (0, 1) and ex.group(2, "cp") == (2, 3)
    kv = 2 * (2 * 8 * 4096 * 128 * 4) / 2  # k and v of the GPU's 4,096 tokens
    ts = lat + kv / bw
    act = 2 * 4096 * 1024 * 4 / 2  # the boundary activation at the GPU's tokens
    tp_ = lat + act / bw
    fwd = max(A / 4, ts) + A / 4  # the two forward ring steps
    bwd = 2 * max(AB / 4, ts)  # the two backward steps (the last one's gradient back)
    s1 = F0 / 2 + fwd + tp_  # stage 1 has the activation
    b1 = s1 + F0 / 2 + fwd + F2 / 2 + B2 / 2  # its attention's backward begins
    b0 = b1 + bwd + B0 / 2 + tp_  # stage 0 has the gradient
    w = 3 * 1024 * 1024 * 4  # one layer's weight: each stage's gradients
    step = lat + w / 2 / bw  # one ring step of a reduction over the 2 CP ranks
    tail = step + OPT / 4 + step if distopt else 2 * step + OPT / 2
    want = b0 + bwd + B0 / 2 + tail
    for g in range(4):
        att = rows(r, g, "compute", "ScaledDotProduct")
        assert att.start.tolist()[0] == pytest.approx(b1 if g >= 2 else b0, rel=1e-9)
        sends = rows(r, g, "comm", "send to")
        peer = {0: 1, 1: 0, 2: 3, 3: 2}[g]
        ring = sends[sends.name.astype(str) == f"send to {peer}"]
        assert ring.nbytes.tolist() == [kv] * 3
        pipe = sends[sends.name.astype(str) != f"send to {peer}"]
        assert pipe.nbytes.tolist() == [act]
        rs, ag = rows(r, g, "comm", "reduce_scatter"), rows(r, g, "comm", "all_gather")
        assert rs.nbytes.tolist() == ([w] if distopt else [])
        assert ag.nbytes.tolist() == ([w] if distopt else [])
        assert rows(r, g, "comm", "allreduce").nbytes.tolist() == ([] if distopt else [w])
    assert r.iteration_time == pytest.approx(want, rel=1e-9)


def test_degree_checks_name_the_field():
    t = attention_trace(b=2, layers=2, s=12)
    with pytest.raises(ConfigError, match=r"'parallelism.pp' = 3 .*dp x tp x pp x cp"):
        sim(t, 8, {"mode": "3d", "dp": 1, "pp": 3, "cp": 2})
    with pytest.raises(ConfigError, match=r"'parallelism.cp' = 4 .*8 sequence chunks.*12"):
        sim(t, 8, {"mode": "3d", "dp": 1, "pp": 2, "cp": 4})
    with pytest.raises(ConfigError, match=r"'parallelism.tp_style' = 'channel'"):
        sim(t, 4, {"mode": "3d", "dp": 1, "pp": 2, "cp": 2, "tp_style": "channel"})
    from tests.conftest import chain_trace

    with pytest.raises(ConfigError, match=r"'parallelism.mode' = '3d' .*scaled_dot_product"):
        sim(chain_trace(), 4, {"mode": "3d", "dp": 1, "pp": 2, "cp": 2})


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    cp=st.sampled_from([1, 2, 4]),
    m=st.sampled_from([1, 2]),
    comm=st.sampled_from(["p2p", "a2a"]),
)
def test_random_dp_pp_cp_layouts_conserve_compute_and_bytes(dp, pp, cp, m, comm):
    """Each GPU computes its stage's operators at its tokens (1/(dp x cp x m) of the
    trace's batch, m micro-batches: 1/(dp x cp) in all) plus the optimizer on its stage's
    weights; every attention of its stage moves 3 (cp - 1) key/value blocks (ring) or 8
    all-to-alls of its tensor (Ulysses) per micro-batch, within its CP group (one stage,
    one replica); pipeline activations are its tokens' share."""
    layers = 2
    t = attention_trace(b=2 * dp * m, s=256, H=8, d=64, layers=layers)
    par = {"mode": "3d", "dp": dp, "pp": pp, "cp": cp, "microbatches": m, "cp_comm": comm}
    r = sim(t, dp * pp * cp, par)
    ex = r.extrapolator
    kv = 2 * (2 * 8 * 256 * 64 * 4) / cp  # k and v of the GPU's tokens, one micro-batch
    coord = ex.layout.coord  # (pp, dp_replicate, dp_shard, cp, tp)
    for g, (p, d, _, _, _) in coord.items():
        ops = [*ex.pipe.fwd_ops[p], *ex.pipe.bwd_ops[p]]
        work = sum(op.time for op in ops) / (dp * cp)
        opt = OPT * ex.optimizer_scale(p)
        assert r.per_gpu().loc[g, "compute"] == pytest.approx(work + opt)
        group = ex.group(g, "cp")
        assert g in group and len(group) == cp
        assert {coord[x][0] for x in group} == {p} and {coord[x][1] for x in group} == {d}
        n_att = sum(1 for op in ex.pipe.fwd_ops[p] if "attention" in op.name)
        sends = rows(r, g, "comm", "send to")
        ring = sends[sends.name.astype(str).isin([f"send to {x}" for x in group if x != g])]
        a2a = rows(r, g, "comm", "all_to_all")
        if cp == 1:
            assert ring.empty and a2a.empty
        elif comm == "p2p":
            assert ring.nbytes.sum() == pytest.approx(3 * (cp - 1) * kv * n_att * m)
            assert a2a.empty
        else:
            assert len(a2a) == 8 * n_att * m and a2a.nbytes.sum() == pytest.approx(
                8 * n_att * m * kv / 2
            )


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("distopt", [False, True])
def test_the_per_operator_streams_give_the_template_timeline(comm, distopt):
    """compute_runs off (one task per operator, `_compute_per_op`) gives the same timeline
    as the stage templates, attention steps and TP collectives included (interleaved: 2
    chunks per stage), and the distributed optimizer's step and parameter all-gather."""
    import pandas as pd

    t = attention_trace(b=4, s=256, H=8, d=64, layers=4)
    par = {"mode": "interleaved", "dp": 1, "pp": 2, "cp": 2, "tp": 2, "microbatches": 2}
    par.update(cp_comm=comm, sequence_parallel=True, distributed_optimizer=distopt)
    out = []
    for runs in (False, True):
        s = Simulation(
            {
                "num_gpus": 8,
                "topology": {"kind": "switch", "bandwidth": 100 * GB, "latency": 1e-6},
                "parallelism": par,
                "communication": {"kind": "textbook"},
            },
            trace=t,
        )
        s.extrapolator.compute_runs = runs
        out.append(s.run())
    pd.testing.assert_frame_equal(out[0].timeline, out[1].timeline, check_exact=True)
    assert len(rows(out[1], 0, "comm", "send to" if comm == "p2p" else "all_to_all"))
