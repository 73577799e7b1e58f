"""FSDP inside context parallelism (`mode: cp` with `fsdp: true`, extrapolators/modes/
cp_fsdp.py; torchtitan's FSDP2 over its flattened "dp_shard_cp" mesh dimension): a 2-rank
CP x FSDP layer timed by hand, its collectives' bytes and groups, memory per GPU by hand,
cp 1 against mode fsdp, and invariants on random tp x cp x dp layouts.

The trace is test_cp_tp's attention block (QKV projection, attention, output projection,
loss; FLOPs = time x 1e12). With `wrap_depth: 2` its units are attn.qkv (the QKV weight,
3 h^2 float32 parameters), attn.core (none), attn.wo (h^2) and loss (none).
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_cp_tp import AB, B0, B1, B2, F0, F1, F2, GB, OPT, A, block_trace, rows, simulate
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation

H, D = 8, 64
HID = H * D
WQKV, WO = 3 * HID * HID * 4, HID * HID * 4  # bytes of the two weights (float32)


DP = ("dp_replicate", "dp_shard", "cp")  # the mesh's data-parallel dimensions


def gathers(r, g):
    return rows(r, g, "comm", "all_gather")


def scatters(r, g):
    return rows(r, g, "comm", "reduce_scatter")


# -- a 2-rank CP x FSDP layer, by hand ---------------------------------------------------------
@pytest.mark.parametrize("policy", ["always", "default", "never"])
def test_two_rank_cp_fsdp_layer_timeline_by_hand(policy):
    """cp 2, dp 1 on 2 GPUs (the FSDP group is the CP group {0, 1}), b = 2 sequences of
    1,024 tokens: each GPU runs one sequence's worth (r = 1/2) of every operator, the
    attention in 2 ring steps of A / 4. Links of 10 TB/s with a latency L = 0.2 ms: an
    all-gather or reduce-scatter of a unit of W bytes on 2 GPUs is one ring step,
    X(W) = L + (W / 2) / bw; the ring's key/value blocks arrive within a step.

    Gather stream: AG(qkv) at 0; the compute enters qkv at X(qkv); AG(wo) is issued when
    the compute starts attn.core (the unit before: prefetch), at a = X(qkv) + F0/2, and is
    done by the time the attention (A/2) ends. Backward: the loss's backward starts at
    b' = a + A/2 + F1/2 + F2/2; with resharding, AG(wo) again is issued then (the unit
    before it in the backward order started) and the output projection's backward waits
    for it: c = b' + max(B2/2, X(wo)); without ("default" keeps the last unit holding
    weights, attn.wo, gathered; "never" every unit) c = b' + B2/2. Its gradients are
    reduce-scattered at c + B1/2; AG(qkv) again (unless "never") is issued when the
    attention's backward starts, at c + B1/2, well inside its AB/2. The QKV backward
    ends at d = c + B1/2 + AB/2 + B0/2, its reduce-scatter ends at d + X(qkv), then the
    optimizer on 1/2 of the weights: iteration d + X(qkv) + OPT/2."""
    L, bw = 2e-4, 1e13

    def X(w):
        return L + w / 2 / bw

    r = simulate(block_trace(), 2, bw, L, cp=2, fsdp=True, wrap_depth=2,
                 reshard_after_forward=policy)  # fmt: skip
    a = X(WQKV) + F0 / 2
    b = a + A / 2 + F1 / 2 + F2 / 2
    c = b + (max(B2 / 2, X(WO)) if policy == "always" else B2 / 2)
    d = c + B1 / 2 + AB / 2 + B0 / 2
    ag = [(WQKV, 0.0, "forward"), (WO, a, "forward")]
    if policy == "always":
        ag.append((WO, b, "backward"))
    if policy != "never":
        ag.append((WQKV, c + B1 / 2, "backward"))
    for g in (0, 1):
        got = gathers(r, g)
        assert got.nbytes.tolist() == [x for x, _, _ in ag]
        assert got.start.tolist() == pytest.approx([t for _, t, _ in ag], rel=1e-9, abs=1e-12)
        assert got.phase.tolist() == [p for _, _, p in ag]
        # (sharing links with the ring's blocks or each other can only slow a transfer)
        assert all(got.end - got.start >= [X(w) * (1 - 1e-9) for w, _, _ in ag])
        rs = scatters(r, g)
        assert rs.nbytes.tolist() == [WO, WQKV]
        assert rs.start.tolist() == pytest.approx([c + B1 / 2, d], rel=1e-9)
        assert rows(r, g, "comm", "allreduce").empty  # no DDP buckets
        att = rows(r, g, "compute", "scaled_dot_product")
        assert att.start.tolist() == pytest.approx([a, a + A / 4], rel=1e-9)
        wo_bwd = rows(r, g, "compute", "MmBackward0")
        assert wo_bwd.start.min() == pytest.approx(c, rel=1e-9)
        assert set(r.extrapolator.group(g, *DP)) == {0, 1}
    assert r.iteration_time == pytest.approx(d + X(WQKV) + OPT / 2, rel=1e-9)


def test_two_rank_cp_fsdp_with_tp_2_gathers_the_tp_shard_over_the_cp_group():
    """tp 2 x cp 2 on 4 GPUs: GPU t of each CP rank holds half of each split weight, and
    shards it over the GPUs of its gradient group ({0, 2} or {1, 3}: torchtitan's
    dp_shard_cp mesh of one TP rank)."""
    r = simulate(block_trace(), 4, 100 * GB, 1e-6, cp=2, tp=2, fsdp=True, wrap_depth=2,
                 reshard_after_forward="always")  # fmt: skip
    for g in range(4):
        assert gathers(r, g).nbytes.tolist() == [WQKV / 2, WO / 2, WO / 2, WQKV / 2]
        assert scatters(r, g).nbytes.tolist() == [WO / 2, WQKV / 2]
        assert set(r.extrapolator.group(g, *DP)) == {g, g ^ 2}


# -- memory per GPU, by hand ---------------------------------------------------------------------
def test_memory_per_gpu_by_hand():
    """tp 2 x cp 2 x dp 2 on 8 GPUs, AdamW in float32: a GPU's TP shard is P = 4 h^2 / 2
    parameters; FSDP keeps 1/(dp x cp) = 1/4 of it: weights 4 P / 4, gradients 4 P / 4,
    AdamW's two states 8 P / 4 bytes; the buffers: the two largest units gathered (here
    both weights' shards, 4 P bytes) less the GPU's own quarter, 3/4 of 4 P."""
    mem = {"optimizer": "adamw", "capacity": 80e9, "workspace": 0}
    r = simulate(block_trace(b=4), 8, 100 * GB, 1e-6, memory=mem, cp=2, tp=2, fsdp=True,
                 wrap_depth=2)  # fmt: skip
    P = 4 * HID * HID / 2
    for g in (0, 5):
        m = r.memory[r.memory.gpu == g]
        assert m.weights.max() == pytest.approx(4 * P / 4, rel=1e-12)
        assert m.gradients.max() == pytest.approx(4 * P / 4, rel=1e-12)
        assert m.optimizer_states.max() == pytest.approx(8 * P / 4, rel=1e-12)
        assert m.buffers.min() == pytest.approx(4 * P * 3 / 4, rel=1e-12)
    assert r.extrapolator.held_weight_bytes(0) == pytest.approx(4 * P / 4, rel=1e-12)


def test_fsdp_and_the_distributed_optimizer_exclude_each_other():
    with pytest.raises(ConfigError, match=r"'parallelism.distributed_optimizer' = True"):
        simulate(block_trace(), 2, GB, cp=2, fsdp=True, distributed_optimizer=True)


# -- cp 1: mode fsdp ------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_cp_1_is_mode_fsdp(recompute):
    """cp 1, tp 1 on 4 GPUs with every unit resharded is ZeRO-3 as mode fsdp runs it (the
    same units, prefetch, reduce-scatters and optimizer shard): the same iteration time
    and the same collectives at the same times (mode fsdp also posts units without
    weights as 0-byte collectives, here off the critical path; mode cp leaves them out)."""
    t = block_trace(b=4)

    def run(par):
        cfg = {
            "num_gpus": 4,
            "topology": {"kind": "switch", "bandwidth": 2 * GB, "latency": 1e-6},
            "parallelism": {"wrap_depth": 2, "recompute": recompute, **par},
            "communication": {"kind": "textbook"},
        }
        return Simulation(cfg, trace=t).run()

    fsdp = run({"mode": "fsdp", "stage": 3, "reshard_after_forward": True})
    cp = run({"mode": "cp", "cp": 1, "fsdp": True, "reshard_after_forward": "always",
              "recompute_depth": 2})  # fmt: skip
    assert cp.iteration_time == pytest.approx(fsdp.iteration_time, rel=1e-12)
    for g in range(4):
        a, b = (rows(r, g, "comm") for r in (fsdp, cp))
        a = a[a.nbytes > 0]
        assert b.name.astype(str).tolist() == a.name.astype(str).tolist()
        assert b.nbytes.tolist() == a.nbytes.tolist()
        assert b.start.tolist() == pytest.approx(a.start.tolist(), rel=1e-12)
        assert b.end.tolist() == pytest.approx(a.end.tolist(), rel=1e-12)


# -- random layouts: conservation and invariants ---------------------------------------------------
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.sampled_from([2, 4, 8]),
    tp_log=st.integers(0, 3),
    cp_log=st.integers(0, 3),
    comm=st.sampled_from(["p2p", "a2a"]),
    policy=st.sampled_from(["default", "always", "never"]),
    acc=st.integers(1, 2),
    bw=st.floats(5, 500),
)
def test_random_layouts_shard_over_dp_x_cp(n, tp_log, cp_log, comm, policy, acc, bw):
    """Any tp x cp x dp layout with FSDP: each GPU computes 1/num_gpus of every operator TP
    splits or shards, 1/(dp x cp) of the loss, the optimizer on 1/(dp x cp) of its TP
    shard; it all-gathers each unit's shard (qkv, wo: W / tp) before every micro-batch's
    forward and, as the policy says, backward, and reduce-scatters each once, all over
    its dp x cp gradient group (no all-reduce but TP's); the attention's traffic is mode
    cp's. Every GPU holds 1/(dp x cp) of its TP shard."""
    tp = min(2**tp_log, n)
    cp = min(2**cp_log, n // tp)
    dp = n // (tp * cp)
    s = 256
    b = 2 * dp * acc
    t = block_trace(b=b, H=H, s=s, d=D)
    par = {"cp": cp, "tp": tp, "cp_comm": comm, "fsdp": True, "wrap_depth": 2}
    par.update(reshard_after_forward=policy, accumulation_steps=acc)
    r = simulate(t, n, bw * GB, 1e-6, **par)
    split = F0 + A + F1 + B1 + AB + B0
    compute = split / n + (F2 + B2) / (dp * cp) + OPT / tp / (dp * cp)
    assert r.per_gpu()["compute"].tolist() == pytest.approx([compute] * n, rel=1e-9)
    assert r.iteration_time >= compute * (1 - 1e-12)
    ex = r.extrapolator
    assert ex.held_weight_bytes(0) == pytest.approx((WQKV + WO) / tp / (dp * cp), rel=1e-12)
    again = {"always": [WO, WQKV], "default": [WQKV], "never": []}[policy]
    per_mb = [WQKV, WO] + again
    tokens = b * s / (dp * cp * acc)
    act = tokens * HID * 4
    q = tokens * (H // tp) * D * 4
    for g in range(n):
        gg = ex.group(g, *DP)
        tp_rank = ex.layout.coord  # (pp, dp_replicate, dp_shard, cp, tp)
        assert len(gg) == dp * cp and {tp_rank[x][4] for x in gg} == {tp_rank[g][4]}
        ag, rs = gathers(r, g), scatters(r, g)
        if dp * cp == 1:
            assert ag.empty and rs.empty
        else:
            assert ag.nbytes.tolist() == pytest.approx([x / tp for x in per_mb] * acc)
            assert rs.nbytes.tolist() == pytest.approx([WO / tp, WQKV / tp])
        ar = rows(r, g, "comm", "allreduce")
        assert ar.nbytes.tolist() == pytest.approx([act] * 2 * acc if tp > 1 else [])
        sends = rows(r, g, "comm", "send to")
        want = 3 * (cp - 1) * 2 * q * acc if comm == "p2p" and cp > 1 else 0.0
        assert sends.nbytes.sum() == pytest.approx(want)
