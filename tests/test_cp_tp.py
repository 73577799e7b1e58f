"""Context parallelism with tensor parallelism and the distributed optimizer (`mode: cp` with
`tp` and `distributed_optimizer`, extrapolators/modes/cp_tp.py): a 2-rank ring with TP 2
timed by hand, the equivalences (tp 1: mode cp; cp 1, dp 1: mode tp), the degree checks,
memory per GPU by hand, and conservation on random tp x cp x dp layouts.

The trace is one Megatron attention block: x -> QKV projection (column-parallel) -> q, k, v
(b, H, s, d) -> attention -> view -> output projection (row-parallel) -> loss. Its
operators' FLOPs are time x 1e12, so the performance model scales each by its share:
tokens (batch / dp / cp) and, for the split layers, 1 / tp; the attention between them runs
on heads / tp (mode tp's "sharded" role) and, in the ring, in cp steps of 1 / cp of that.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TraceBuilder
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation
from triosim.trace.model import Trace

GB = 1e9
# seconds: QKV, attention, output projection, loss (forward); loss, output projection,
# attention, QKV (backward); the optimizer
F0, A, F1, F2, B2, B1, AB, B0, OPT = 1e-3, 4e-3, 0.5e-3, 0.2e-3, 0.2e-3, 1e-3, 8e-3, 2e-3, 1e-3


def block_trace(b=2, H=8, s=1024, d=64, kv_heads=None):
    """One attention block, float32 (module docstring). With `kv_heads`, grouped-query
    attention as torchtitan traces it: k and v projected at kv_heads, repeated to H."""
    tb = TraceBuilder()
    tensors, ops, T, op = tb.tensors, tb.ops, tb.tensor, tb.op

    h = H * d
    x = T((b, s, h), "activation")  # made by no operator of the trace: it has a gradient
    wo = T((h, h), "weight")
    q, k, v, y = (T((b, H, s, d), "activation") for _ in range(4))
    kv_w = []
    if kv_heads:
        wq = T((h, h), "weight")
        fq = op("aten::linear", "attn.q", "forward", F0, [x, wq], [q], split=True)
        for name, rep in (("k", k), ("v", v)):
            w = T((kv_heads * d, h), "weight")
            small = T((b, s, kv_heads * d), "activation")
            f = op("aten::linear", f"attn.{name}", "forward", 0.0, [x, w], [small], split=True)
            op("aten::repeat_interleave", f"attn.{name}", "forward", 0.0, [small], [rep])
            kv_w.append((w, f))
        w_in = wq
    else:
        w_in = T((3 * h, h), "weight")
        fq = op("aten::linear", "attn.qkv", "forward", F0, [x, w_in], [q, k, v], split=True)
    fa = op("aten::scaled_dot_product_attention", "attn.core", "forward", A, [q, k, v], [y])
    y2 = T((b, s, h), "activation")
    op("aten::view", "attn.core", "forward", 0.0, [y], [y2])
    out = T((b, s, h), "activation")
    fo = op("aten::linear", "attn.wo", "forward", F1, [y2, wo], [out], split=True)
    loss = T((), "activation")
    fl = op("aten::mse_loss", "loss", "forward", F2, [out], [loss])
    dout = T((b, s, h), "activation")
    op("MseLossBackward0", "loss", "backward", B2, [loss], [dout], fwd=fl)
    dy2, gwo = T((b, s, h), "activation"), T((h, h), "gradient")
    op("MmBackward0", "attn.wo", "backward", B1, [dout, y2, wo], [dy2, gwo], fwd=fo, split=True)
    dq, dk, dv = (T((b, H, s, d), "activation") for _ in range(3))
    name = "ScaledDotProductEfficientAttentionBackward0"
    op(name, "attn.core", "backward", AB, [dy2, q, k, v, y], [dq, dk, dv], fwd=fa)
    dx, g_in = T((b, s, h), "activation"), T(tensors[w_in].shape, "gradient")
    op("MmBackward0", ops[fq].layer, "backward", B0, [dq, dk, dv, x, w_in], [dx, g_in], fwd=fq,
       split=True)  # fmt: skip
    grads = [g_in, gwo]
    for w, f in kv_w:
        g = T(tensors[w].shape, "gradient")
        op("MmBackward0", ops[f].layer, "backward", 0.0, [dk, x, w], [g], fwd=f, split=True)
        grads.append(g)
    weights = [w_in, wo, *(w for w, _ in kv_w)]
    op("aten::_foreach_add_", "optimizer", "optimizer", OPT, weights + grads, [])
    meta = {"batch_size": b, "gpu": "H100-SXM", "seq_len": s}
    return Trace(ops, tensors, meta).validate()


def simulate(trace, n, bw, latency=0.0, memory=None, **par):
    cfg = {
        "num_gpus": n,
        "topology": {"kind": "switch", "bandwidth": bw, "latency": latency},
        "parallelism": {"mode": "cp", **par},
        "communication": {"kind": "textbook"},
    }
    if memory:
        cfg["memory"] = memory
    s = Simulation(cfg, trace=trace)
    r = s.run()
    r.extrapolator = s.extrapolator
    return r


def rows(r, gpu, kind, name=None, phase=None):
    tl = r.timeline
    t = tl[(tl.gpu == gpu) & (tl.kind == kind)]
    if name is not None:
        t = t[t.name.astype(str).str.contains(name, regex=False)]
    if phase is not None:
        t = t[t.phase == phase]
    return t.sort_values("start")


ONE_GPU_BUCKET = {"bucket_size": 1e9, "first_bucket_size": 1e9}  # one gradient bucket


# -- a 2-rank ring with TP 2, by hand -------------------------------------------------------------
@pytest.mark.parametrize("bw", [2 * GB, 100 * GB])  # a ring transfer longer / shorter than a step
def test_two_rank_ring_with_tp_2_timeline_by_hand(bw):
    """tp 2 x cp 2 on 4 GPUs (Megatron's order: TP groups {0, 1}, {2, 3}; CP groups {0, 2},
    {1, 3}; gradient groups the same GPUs as CP here, dp 1). b = 2 sequences of 1,024
    tokens, H = 8 heads of d = 64 (hidden h = 512), float32. Per GPU: 1 sequence's tokens
    (r = 1/2), the layers' 1/2 (tp): QKV F0 / 4, each ring step A / 8 (A x r / tp / cp),
    the output projection F1 / 4, the loss whole on the TP group (F2 x r)."""
    lat, t = 1e-6, block_trace()
    r = simulate(t, 4, bw, lat, cp=2, tp=2, **ONE_GPU_BUCKET)
    # the key/value block: k and v of 1,024 tokens (r), 8 / 2 = 4 heads (tp), 64 x 4 bytes
    kv = 2 * 1024 * 4 * 64 * 4
    assert kv == 2 * (2 * 8 * 1024 * 64 * 4) / 2 / 2  # mode cp's block (r = 1/2) / tp
    ts = lat + kv / bw
    act = 1024 * 512 * 4  # one CP rank's tokens x hidden x 4 bytes: each TP all-reduce
    ar = act / bw + 2 * lat  # textbook ring all-reduce on 2 GPUs: 2 steps of half
    t1 = F0 / 4
    fwd_steps = [t1, t1 + max(A / 8, ts)]
    t_ar = fwd_steps[1] + A / 8 + F1 / 4  # the row-parallel output's all-reduce
    t2 = t_ar + ar + F2 / 2 + B2 / 2 + B1 / 4  # the attention's backward begins
    t3 = t2 + max(AB / 8, ts)
    bwd_end = t3 + max(AB / 8, ts)  # step 1, or the gradient of its block coming back
    t_in = bwd_end + B0 / 4  # the QKV input gradient's all-reduce
    grads = (3 * 512 * 512 + 512 * 512) * 4 / 2  # the GPU's TP shard of both weights
    dp_ar = grads / bw + 2 * lat  # over the gradient group (the 2 CP ranks)
    want = t_in + ar + dp_ar + OPT / 2  # the optimizer on the shard: 1/2 of the weights
    for g in range(4):
        peer = {0: 2, 1: 3, 2: 0, 3: 1}[g]
        tp_peer = g ^ 1
        att = rows(r, g, "compute", "scaled_dot_product")
        assert att.start.tolist() == pytest.approx(fwd_steps, rel=1e-9)
        assert (att.end - att.start).tolist() == pytest.approx([A / 8] * 2, rel=1e-9)
        back = rows(r, g, "compute", "ScaledDotProduct")
        assert back.start.tolist() == pytest.approx([t2, t3], rel=1e-9)
        sends = rows(r, g, "comm", "send to")
        assert sends.name.astype(str).tolist() == [f"send to {peer}"] * 3
        assert sends.nbytes.tolist() == [kv] * 3
        assert sends.start.tolist() == pytest.approx([t1, t2, t3], rel=1e-9)
        ars = rows(r, g, "comm", "allreduce")
        assert ars.nbytes.tolist() == [act, act, grads]
        assert ars.start.tolist() == pytest.approx([t_ar, t_in, t_in + ar], rel=1e-9)
        assert (ars.end - ars.start).tolist() == pytest.approx([ar, ar, dp_ar], rel=1e-9)
        ex = r.extrapolator
        assert set(ex.group(g, "tp")) == {g, tp_peer}
        assert set(ex.group(g, "dp_replicate", "dp_shard", "cp")) == {g, peer}
    assert r.iteration_time == pytest.approx(want, rel=1e-9)


def test_two_rank_ulysses_with_tp_2_timeline_by_hand():
    """cp_comm a2a, tp 2 x cp 2: each TP rank's 4 of the 8 heads go through the all-to-alls
    of its CP group (2 of them to each GPU): 4 all-to-alls forward (q, k, v; the output)
    and 4 backward, each of the GPU's tensor at its tokens (r = 1/2) and heads (1/2), half
    of which crosses the link; the attention whole on those heads, A x r / tp."""
    lat, bw = 1e-6, 20 * GB
    r = simulate(block_trace(), 4, bw, lat, cp=2, tp=2, cp_comm="a2a", **ONE_GPU_BUCKET)
    q = 1024 * 4 * 64 * 4  # 1,024 tokens x 4 heads x 64 x 4 bytes
    a2a = lat + (q / 2) / bw
    ar = 1024 * 512 * 4 / bw + 2 * lat
    dp_ar = (4 * 512 * 512 * 4 / 2) / bw + 2 * lat
    want = (
        F0 / 4 + 4 * a2a + A / 4 + F1 / 4 + ar + F2 / 2 + B2 / 2 + B1 / 4 + 4 * a2a + AB / 4
        + B0 / 4 + ar + dp_ar + OPT / 2
    )  # fmt: skip
    for g in range(4):
        c = rows(r, g, "comm", "all_to_all")
        assert c.nbytes.tolist() == [q] * 8
        assert (c.end - c.start).tolist() == pytest.approx([a2a] * 8, rel=1e-9)
    assert r.iteration_time == pytest.approx(want, rel=1e-9)


def test_recomputation_runs_the_tp_collectives_of_the_recomputed_forward_again():
    """recompute full (a unit per layer here): the output projection's forward runs again
    before its backward, and so does its all-reduce (Megatron's recomputation reruns the
    forward with its collectives), keyed apart and marked recompute; the ring attention's
    forward is recomputed with its sends as in mode cp."""
    r = simulate(block_trace(), 4, 100 * GB, 1e-6, cp=2, tp=2, recompute="full")
    ar = rows(r, 0, "comm", "allreduce")
    out = ar[ar.key.astype(str).str.contains("output")]
    assert out.phase.tolist() == ["forward", "recompute"]
    assert out.nbytes.tolist() == [1024 * 512 * 4] * 2
    att = rows(r, 0, "compute", "scaled_dot_product")
    assert att.phase.tolist() == ["forward"] * 2 + ["recompute"] * 2


# -- the equivalences ----------------------------------------------------------------------------
def test_tp_1_is_mode_cp_as_before():
    """`tp: 1` (the default) takes mode cp's own path: the same timeline as without it."""
    t = block_trace()
    a = simulate(t, 4, 50 * GB, 1e-6, cp=2)
    b = simulate(t, 4, 50 * GB, 1e-6, cp=2, tp=1, sequence_parallel=False)
    assert a.iteration_time == b.iteration_time
    cols = ["gpu", "kind", "name", "start", "end", "nbytes"]
    assert a.timeline[cols].equals(b.timeline[cols])


@pytest.mark.parametrize("sp", [False, True])
def test_cp_1_dp_1_is_mode_tp_exactly(sp):
    """tp 2, cp 1, dp 1: the TP plan alone (no gradient group to reduce over): mode tp's
    iteration, computes and collectives, digit for digit."""
    t = block_trace()
    r = simulate(t, 2, 50 * GB, 1e-6, cp=1, tp=2, sequence_parallel=sp)
    s = Simulation(
        {
            "num_gpus": 2,
            "batch_size": 2,
            "topology": {"kind": "switch", "bandwidth": 50 * GB, "latency": 1e-6},
            "parallelism": {"mode": "tp", "sequence_parallel": sp},
            "communication": {"kind": "textbook"},
        },
        trace=t,
    ).run()
    assert r.iteration_time == s.iteration_time
    for g in (0, 1):
        for kind in ("compute", "comm"):
            a, b = rows(r, g, kind), rows(s, g, kind)
            assert a.nbytes.tolist() == b.nbytes.tolist()
            assert a.start.tolist() == b.start.tolist()
            assert a.end.tolist() == b.end.tolist()
    assert r.per_gpu()["compute"].tolist() == s.per_gpu()["compute"].tolist()


# -- the degree checks ---------------------------------------------------------------------------
def test_degree_checks_name_the_field():
    t = block_trace(H=6, s=96)
    with pytest.raises(ConfigError, match=r"'parallelism.tp' = 4 .*6 attention heads"):
        simulate(t, 8, GB, cp=2, tp=4)
    with pytest.raises(ConfigError, match=r"'parallelism.tp' = 3 .*dividing num_gpus \(8\)"):
        simulate(t, 8, GB, cp=2, tp=3)
    with pytest.raises(ConfigError, match=r"'parallelism.cp' = 3 .*tp x cp \(2 x 3\).*\(8\)"):
        simulate(t, 8, GB, cp=3, tp=2)
    # Ulysses: 6 heads, 3 per TP rank, do not split over cp 2
    with pytest.raises(ConfigError, match=r"'parallelism.cp' = 2 .*3 per TP rank of the 6"):
        simulate(t, 4, GB, cp=2, tp=2, cp_comm="a2a")
    t = block_trace(H=8, s=64, kv_heads=2)  # grouped-query attention: 2 key/value heads
    with pytest.raises(ConfigError, match=r"'parallelism.tp' = 4 .*2 key/value heads"):
        simulate(t, 4, GB, cp=1, tp=4)
    with pytest.raises(ConfigError, match=r"'parallelism.cp' = 2 .*1 per TP rank of the 2 key"):
        simulate(t, 4, GB, cp=2, tp=2, cp_comm="a2a")
    assert simulate(t, 4, 100 * GB, cp=2, tp=2).iteration_time  # the ring: 1 head each
    t = block_trace(s=12)  # 2 x cp = 4 chunks of 3 tokens; sequence parallelism needs 6 / 4
    with pytest.raises(ConfigError, match=r"'parallelism.cp' = 2 .*4 sequence chunks"):
        simulate(block_trace(s=6), 4, GB, cp=2, tp=2)
    with pytest.raises(ConfigError, match=r"'parallelism.tp' = 4 .*6 tokens"):
        simulate(t, 8, GB, cp=2, tp=4, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"'parallelism.sequence_parallel' = True"):
        simulate(t, 2, GB, cp=2, sequence_parallel=True)


# -- memory per GPU with the distributed optimizer, by hand ----------------------------------------
@pytest.mark.parametrize("distopt", [False, True])
def test_memory_per_gpu_with_the_distributed_optimizer_by_hand(distopt):
    """tp 2 x cp 2 x dp 2 on 8 GPUs, AdamW in float32: each GPU holds half of both
    weights (P = 4 h^2 / 2 parameters), 4 bytes each of weights and gradients (in buffers),
    and 8 bytes of AdamW's two states, those over the dp x cp = 4 GPUs of its gradient group
    with the distributed optimizer (Megatron shards the state over the data-parallel group
    with CP): 8 P / 4; per parameter 4 + 4 + 8 / 4 bytes (Megatron-LM's dist_optimizer.md:
    "fp32 param, fp32 grads: 8 + 8/d")."""
    t = block_trace(b=4)
    # no cuBLAS workspaces (triosim.results.workspaces: 64 MiB of buffers on this GPU):
    # the buffers here are the gradients' alone
    mem = {"optimizer": "adamw", "capacity": 80e9, "workspace": 0}
    r = simulate(t, 8, 100 * GB, 1e-6, memory=mem, cp=2, tp=2, distributed_optimizer=distopt)
    P = 4 * 512 * 512 / 2
    m = r.memory[r.memory.gpu == 0]
    assert m.weights.max() == pytest.approx(4 * P, rel=1e-12)
    assert m.optimizer_states.max() == pytest.approx(8 * P / (4 if distopt else 1), rel=1e-12)
    # the gradients' buffer held all run: DDP's bucket copies, or Megatron's gradient buffer
    # (the distributed optimizer's gradients are views of it: none come and go beside it)
    assert m.buffers.min() == pytest.approx(4 * P, rel=1e-12)
    assert m.gradients.max() == pytest.approx(0.0 if distopt else 4 * P, rel=1e-12, abs=1e-6)
    # activations: the GPU's tokens (4 sequences / dp 2 / cp 2 = 1 of the trace's 4: 1/4),
    # and 1/tp more where TP shards them (the QKV's outputs, the attention, its view)
    ex, ops = r.extrapolator, t.operators
    want = {"aten::linear": [1 / 8, 1 / 4], "aten::scaled_dot_product_attention": [1 / 8]}
    want.update({"aten::view": [1 / 8], "aten::mse_loss": [1 / 4]})
    for name, ratios in want.items():
        got = [ex.activation_ratio(o) for o in ops if o.name == name and o.phase == "forward"]
        assert got == pytest.approx(ratios, rel=1e-12), name
    if distopt:  # its gradient buckets reduce-scattered, its parameters all-gathered after
        rs = rows(r, 0, "comm", "reduce_scatter")
        ag = rows(r, 0, "comm", "all_gather")
        assert rs.nbytes.sum() == pytest.approx(4 * P)
        assert ag.nbytes.tolist() == [4 * P]
        opt = rows(r, 0, "compute", phase="optimizer")
        assert (opt.end - opt.start).sum() == pytest.approx(OPT / 2 / 4, rel=1e-9)
        assert ag.start.min() >= opt.end.max() - 1e-15


# -- random layouts: conservation and invariants ---------------------------------------------------
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.sampled_from([2, 4, 8]),
    tp_log=st.integers(0, 3),
    cp_log=st.integers(0, 3),
    comm=st.sampled_from(["p2p", "a2a"]),
    distopt=st.booleans(),
    acc=st.integers(1, 2),
    bw=st.floats(5, 500),
)
def test_random_tp_cp_dp_layouts_conserve_compute_and_bytes(
    n, tp_log, cp_log, comm, distopt, acc, bw
):
    """Any tp x cp x dp layout on a switch: each GPU computes 1/num_gpus of every operator
    TP splits or shards (its tokens' share of its heads), 1/(dp x cp) of the loss (whole on
    the TP group), the optimizer on its TP shard (1/(dp x cp) of it with the distributed
    optimizer); the ring sends 3 (cp - 1) blocks of the GPU's k, v at heads / tp; Ulysses 8
    all-to-alls of its q at heads / tp; TP does 2 all-reduces of its tokens' activation;
    the gradients of its shard are reduced over its dp x cp GPUs (all-reduce, or
    reduce-scatter + all-gather). With accumulation each micro-batch moves 1/acc of it,
    acc times. Groups follow Megatron's order."""
    tp = min(2**tp_log, n)
    cp = min(2**cp_log, n // tp)
    dp = n // (tp * cp)
    bw *= GB
    H, s, d = 8, 256, 64
    b = 2 * dp * acc
    t = block_trace(b=b, H=H, s=s, d=d)
    par = {"cp": cp, "tp": tp, "cp_comm": comm, "distributed_optimizer": distopt}
    par["accumulation_steps"] = acc
    r = simulate(t, n, bw, 1e-6, **par, **ONE_GPU_BUCKET)
    split = F0 + A + F1 + B1 + AB + B0
    opt = OPT / tp / (dp * cp if distopt else 1)
    compute = split / n + (F2 + B2) / (dp * cp) + opt
    assert r.per_gpu()["compute"].tolist() == pytest.approx([compute] * n, rel=1e-9)
    assert r.iteration_time >= compute * (1 - 1e-12)
    ex = r.extrapolator
    tokens = b * s / (dp * cp * acc)  # one GPU's tokens per micro-batch
    q = tokens * (H // tp) * d * 4  # its q (or k, v, output) at its heads
    act = tokens * H * d * 4
    grads = 4 * (H * d) ** 2 * 4 / tp
    for g in range(n):
        i = ex.gpus.index(g)
        # the mesh's coordinates (pp, dp_replicate, dp_shard, cp, tp): Megatron's order
        coord = {x: (c[1], c[3], c[4]) for x, c in ex.layout.coord.items()}
        assert coord[g] == (i // (tp * cp), (i // tp) % cp, i % tp)
        assert sorted(ex.group(g, "tp")) == [i // tp * tp + k for k in range(tp)]
        cpg = ex.group(g, "cp")
        assert len(cpg) == cp and {coord[x][0::2] for x in cpg} == {coord[g][0::2]}
        gg = ex.group(g, "dp_replicate", "dp_shard", "cp")
        assert len(gg) == dp * cp and {coord[x][2] for x in gg} == {coord[g][2]}
        sends = rows(r, g, "comm", "send to")
        a2a = rows(r, g, "comm", "all_to_all")
        ar = rows(r, g, "comm", "allreduce")
        rs, ag = rows(r, g, "comm", "reduce_scatter"), rows(r, g, "comm", "all_gather")
        if comm == "p2p" and cp > 1:
            assert sends.nbytes.sum() == pytest.approx(3 * (cp - 1) * 2 * q * acc)
        else:
            assert sends.empty
        if comm == "a2a" and cp > 1:
            assert a2a.nbytes.tolist() == pytest.approx([q] * 8 * acc)
        else:
            assert a2a.empty
        tp_ar = [act] * 2 * acc if tp > 1 else []
        if dp * cp == 1:
            assert ar.nbytes.tolist() == pytest.approx(tp_ar) and rs.empty and ag.empty
        elif distopt:
            assert ar.nbytes.tolist() == pytest.approx(tp_ar)
            assert rs.nbytes.tolist() == pytest.approx([grads])
            assert ag.nbytes.tolist() == pytest.approx([grads])
        else:
            assert ar.nbytes.tolist() == pytest.approx([*tp_ar, grads])
            assert rs.empty and ag.empty
