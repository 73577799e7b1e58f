"""Context parallelism (`mode: cp`): ring attention and Ulysses timed by hand on 2 GPUs,
the degree checks, and conservation on random layouts.

The ring's hand calculation follows TransformerEngine's AttnFuncWithCPAndKVP2P
(transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py, which
Megatron-LM's `--cp-comm-type p2p` runs): forward, c steps, each a 1/c share of the
attention, the key/value block sent on during the step (c-1 sends); backward, c steps the
other way round, messages of the block (step 0), block + partial gradient (steps 1..c-2),
the gradient alone (step c-1, received after the last step). Ulysses: DeepSpeed-Ulysses
(Jacobs et al. 2023) as TE's AttnFuncWithCPAndQKVOA2A: all-to-alls of q, k, v, the whole
attention on 1/c of the heads, an all-to-all of the output; backward the reverse.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TraceBuilder
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation
from triosim.trace.model import Trace

GB = 1e9
# seconds: the QKV projection, attention, loss (forward); loss, attention, projection
# (backward); the optimizer
F0, A, F2, B2, AB, B0, OPT = 1e-3, 4e-3, 0.5e-3, 0.5e-3, 8e-3, 2e-3, 1e-3


def attention_trace(b=2, H=8, s=4096, d=128, layers=1, kv_heads=None):
    """x -> [qkv projection -> q, k, v (b, H, s, d) -> attention -> y] x layers -> loss,
    float32; FLOPs = time x 1e12, so the performance model scales each operator exactly
    by its share of the batch. With `kv_heads`, grouped-query attention as torchtitan
    traces it: k and v projected at kv_heads and repeated to H before the attention."""
    tb = TraceBuilder()
    tensors, ops, T, op = tb.tensors, tb.ops, tb.tensor, tb.op

    x = T((b, s, H * d), "input")
    weights, fwd = [], []
    for i in range(layers):
        w = T((3 * H * d, H * d), "weight")
        q, k, v = T((b, H, s, d), "activation"), T((b, H, s, d), "activation"), None
        if kv_heads:  # k and v by their own projections at kv_heads, then repeated
            k, v = T((b, H, s, d), "activation"), T((b, H, s, d), "activation")
            for name, rep in (("wk", k), ("wv", v)):
                wk = T((kv_heads * d, H * d), "weight")
                small = T((b, s, kv_heads * d), "activation")
                f_k = op(
                    "aten::linear", f"l{i}.{name}", "forward", 0.0, [x, wk], [small], split=True
                )
                weights.append((wk, f_k))
                op("aten::repeat_interleave", f"l{i}.attn", "forward", 0.0, [small], [rep])
        else:
            v = T((b, H, s, d), "activation")
        made = [q] if kv_heads else [q, k, v]  # (GQA: the query's projection alone)
        f_qkv = op("aten::linear", f"l{i}.qkv", "forward", F0, [x, w], made, split=True)
        weights.append((w, f_qkv))
        y = T((b, H, s, d), "activation")
        f_att = op("aten::scaled_dot_product_attention", f"l{i}.attn", "forward", A, [q, k, v], [y])
        fwd.append((f_qkv, f_att, q, k, v, y))
        x = T((b, s, H * d), "activation")
        op("aten::view", f"l{i}.attn", "forward", 0.0, [y], [x])
    loss = T((), "activation")
    f_loss = op("aten::mse_loss", "loss", "forward", F2, [x], [loss])
    dx = T((b, s, H * d), "activation")
    op("MseLossBackward0", "loss", "backward", B2, [loss], [dx], fwd=f_loss)
    grads = []
    for f_qkv, f_att, q, k, v, y in reversed(fwd):
        dq, dk, dv = (T((b, H, s, d), "activation") for _ in range(3))
        name = "ScaledDotProductEfficientAttentionBackward0"
        op(name, ops[f_att].layer, "backward", AB, [dx, q, k, v, y], [dq, dk, dv], fwd=f_att)
        g = T(tensors[ops[f_qkv].inputs[1]].shape, "gradient")
        grads.append(g)
        dx = T((b, s, H * d), "activation")
        op("AddmmBackward0", ops[f_qkv].layer, "backward", B0, [dq, dk, dv], [dx, g], fwd=f_qkv)
    for w, f in weights:
        if f not in (x[0] for x in fwd):  # (the key/value projections of GQA: no time)
            op(
                "MmBackward0",
                ops[f].layer,
                "backward",
                0.0,
                [dx],
                [T(tensors[w].shape, "gradient")],
                fwd=f,
            )
    op("aten::_foreach_add_", "optimizer", "optimizer", OPT, [w for w, _ in weights] + grads, [])
    meta = {"batch_size": b, "gpu": "H100-SXM", "seq_len": s}
    return Trace(ops, tensors, meta).validate()


def simulate(trace, n, bw, latency=0.0, topology="ring", **par):
    s = Simulation(
        {
            "num_gpus": n,
            "topology": {"kind": topology, "bandwidth": bw, "latency": latency},
            "parallelism": {"mode": "cp", **par},
            "communication": {"kind": "textbook"},
        },
        trace=trace,
    )
    r = s.run()
    r.extrapolator = s.extrapolator
    return r


def rows(r, gpu, kind, name=None):
    tl = r.timeline
    t = tl[(tl.gpu == gpu) & (tl.kind == kind)]
    if name is not None:
        t = t[t.name.astype(str).str.contains(name, regex=False)]
    return t.sort_values("start")


# -- ring attention on 2 GPUs, by hand ------------------------------------------------------------
# the transfer longer, then shorter, than a step
@pytest.mark.parametrize("bw", [10 * GB, 200 * GB])
def test_two_rank_ring_attention_timeline_by_hand(bw):
    """cp = 2, one sequence pair (b = 2): each GPU holds 1 sequence's worth of tokens, so every
    operator runs at 1/2 and each of the 2 attention steps at 1/4 of the trace's attention.
    The key/value block each GPU passes on: k and v at 1/2 of the trace's bytes."""
    lat = 2e-6
    t = attention_trace()
    r = simulate(t, 2, bw, lat, cp=2)
    k_bytes = 2 * 8 * 4096 * 128 * 4
    kv = 2 * k_bytes / 2  # k and v, half the tokens
    ts = lat + kv / bw  # one send over one link
    t1 = F0 / 2
    # forward: step 0 from t1 while the block goes; step 1 once it is here
    fwd_steps = [t1, t1 + max(A / 4, ts)]
    t_fwd_end = fwd_steps[1] + A / 4
    t2 = t_fwd_end + F2 / 2 + B2 / 2  # the attention's backward starts
    # backward: step 0 sends the block; step 1 (once it is here) sends the gradient of the
    # block of step 0, which must reach its owner after step 1
    t3 = t2 + max(AB / 4, ts)
    bwd_steps = [t2, t3]
    t_bwd_end = t3 + max(AB / 4, ts)
    w_bytes = 3 * 1024 * 1024 * 4
    allreduce = w_bytes / bw + 2 * lat  # textbook ring, 2 GPUs: 2 steps of half the buffer
    want = t_bwd_end + B0 / 2 + allreduce + OPT
    for g in (0, 1):
        att = rows(r, g, "compute", "scaled_dot_product")
        assert att.start.tolist() == pytest.approx(fwd_steps, rel=1e-9)
        assert (att.end - att.start).tolist() == pytest.approx([A / 4] * 2, rel=1e-9)
        back = rows(r, g, "compute", "ScaledDotProduct")
        assert back.start.tolist() == pytest.approx(bwd_steps, rel=1e-9)
        sends = rows(r, g, "comm", "send to")
        assert sends.name.astype(str).tolist() == [f"send to {1 - g}"] * 3
        assert sends.nbytes.tolist() == [kv] * 3  # block; block; gradient
        assert sends.start.tolist() == pytest.approx([t1, t2, t3], rel=1e-9)
        assert (sends.end - sends.start).tolist() == pytest.approx([ts] * 3, rel=1e-9)
    assert r.iteration_time == pytest.approx(want, rel=1e-9)


def test_a_ring_send_waits_for_its_receiver():
    """NCCL pairs a point-to-point send with the receiver's posted receive (TE posts each
    step's send and receive together): with GPU 1 computing 2x slower, GPU 0's first block
    leaves when GPU 1 reaches the attention (F0), not when GPU 0 does (F0 / 2)."""
    t = attention_trace()
    s = Simulation(
        {
            "num_gpus": 2,
            "topology": {"kind": "ring", "bandwidth": 100 * GB, "latency": 0.0},
            "parallelism": {"mode": "cp", "cp": 2},
            "communication": {"kind": "textbook"},
            "heterogeneity": {"compute": {1: 2.0}},
        },
        trace=t,
    )
    r = s.run()
    first = rows(r, 0, "comm", "send to").iloc[0]
    assert first.start == pytest.approx(F0, rel=1e-12)
    assert rows(r, 1, "comm", "send to").iloc[0].start == pytest.approx(F0, rel=1e-12)


def test_ring_sends_follow_the_ring_and_count_3_c_minus_1_blocks():
    """cp = 4: forward passes 3 blocks to the next GPU, backward 4 messages to the previous
    (block, block + gradient twice, gradient): 3 + 6 = 9 blocks' bytes = 3 (c - 1)."""
    t = attention_trace()
    r = simulate(t, 4, 100 * GB, topology="switch", cp=4)
    kv = 2 * (2 * 8 * 4096 * 128 * 4) / 4
    for g in range(4):
        sends = rows(r, g, "comm", "send to")
        fwd, bwd = sends[sends.phase == "forward"], sends[sends.phase == "backward"]
        assert set(fwd.name.astype(str)) == {f"send to {(g + 1) % 4}"}
        assert set(bwd.name.astype(str)) == {f"send to {(g - 1) % 4}"}
        assert fwd.nbytes.tolist() == [kv] * 3
        assert bwd.nbytes.tolist() == [kv, 2 * kv, 2 * kv, kv]


def test_cp_of_one_is_ddp_exactly():
    t = attention_trace()
    a = simulate(t, 2, 50 * GB, 1e-6, cp=1)
    s = Simulation(
        {
            "num_gpus": 2,
            "topology": {"kind": "ring", "bandwidth": 50 * GB, "latency": 1e-6},
            "parallelism": {"mode": "ddp"},
            "communication": {"kind": "textbook"},
        },
        trace=t,
    ).run()
    assert a.iteration_time == s.iteration_time
    assert a.per_gpu()["compute"].tolist() == s.per_gpu()["compute"].tolist()


def test_activations_per_gpu_are_one_cp_th():
    """One sequence on 4 GPUs: each GPU keeps a quarter of the activations a single GPU
    keeps (the memory model's per-operator ratio is the GPU's token share)."""
    t = attention_trace(b=1)
    cp = simulate(t, 4, 100 * GB, topology="switch", cp=4)
    one = Simulation({"num_gpus": 1, "parallelism": {"mode": "single"}}, trace=t).run()
    ex = cp.extrapolator
    assert ex.op_batch() == 0.25
    for op in t.operators:
        assert ex.activation_ratio(op) == pytest.approx(0.25)
    act = [c for c in cp.memory.columns if "activation" in str(c)]
    assert act, cp.memory.columns
    peak = cp.memory[cp.memory.gpu == 0][act].sum(axis=1).max()
    peak_one = one.memory[act].sum(axis=1).max()
    assert peak == pytest.approx(peak_one / 4, rel=1e-9)


# -- Ulysses on 2 GPUs, by hand ------------------------------------------------------------------
def test_two_rank_ulysses_timeline_by_hand():
    """cp_comm a2a: 4 all-to-alls around each attention (q, k, v before, the output after;
    backward the output gradient before, dq, dk, dv after), each of one GPU's tensor
    (half the tokens, all heads), half of which crosses the link; the attention whole at
    the GPU's token share (1/2)."""
    lat, bw = 1e-6, 20 * GB
    t = attention_trace()
    r = simulate(t, 2, bw, lat, cp=2, cp_comm="a2a")
    q = 2 * 8 * 4096 * 128 * 4 / 2  # one GPU's q (or k, v, y)
    a2a = lat + (q / 2) / bw
    w_bytes = 3 * 1024 * 1024 * 4
    want = (
        F0 / 2 + 4 * a2a + A / 2 + F2 / 2 + B2 / 2 + 4 * a2a + AB / 2 + B0 / 2
        + w_bytes / bw + 2 * lat + OPT
    )  # fmt: skip
    for g in (0, 1):
        c = rows(r, g, "comm", "all_to_all")
        assert c.nbytes.tolist() == [q] * 8
        assert (c.end - c.start).tolist() == pytest.approx([a2a] * 8, rel=1e-9)
    assert r.iteration_time == pytest.approx(want, rel=1e-9)


# -- the degree checks ---------------------------------------------------------------------------
def test_degree_checks_name_the_field():
    t = attention_trace(s=96)
    with pytest.raises(ConfigError, match=r"'parallelism.cp' = 3 .*dividing num_gpus \(4\)"):
        simulate(t, 4, GB, cp=3)
    t = attention_trace(s=12)
    with pytest.raises(ConfigError, match=r"'parallelism.cp' = 4 .*8 sequence chunks.*12 tokens"):
        simulate(t, 4, GB, cp=4)
    assert simulate(t, 4, 100 * GB, cp=4, cp_comm="a2a").iteration_time  # 12 % 4 == 0
    t = attention_trace(H=6, s=64)
    with pytest.raises(ConfigError, match=r"'parallelism.cp' = 4 .*6 attention heads"):
        simulate(t, 4, GB, cp=4, cp_comm="a2a")
    t = attention_trace(H=8, s=64, kv_heads=2)  # grouped-query attention: 2 key/value heads
    with pytest.raises(ConfigError, match=r"'parallelism.cp' = 4 .*2 key/value heads.*8 query"):
        simulate(t, 4, GB, cp=4, cp_comm="a2a")
    assert simulate(t, 4, 100 * GB, cp=4).iteration_time  # the ring sends 2 heads' blocks


def test_a_trace_without_fused_attention_is_refused():
    from tests.conftest import chain_trace

    with pytest.raises(ConfigError, match=r"'parallelism.mode' = 'cp' .*scaled_dot_product"):
        simulate(chain_trace(), 2, GB, cp=2)


def test_gqa_sends_the_key_value_heads_only():
    """Llama-style grouped-query attention (k and v projected at 2 of 8 heads, repeated
    before the attention): the ring passes blocks of 2 heads; Ulysses' all-to-alls of k and
    v (and of their gradients) carry 2 heads, those of q and the output 8."""
    t = attention_trace(H=8, s=64, kv_heads=2)
    r = simulate(t, 2, 100 * GB, cp=2)
    q = 2 * 8 * 64 * 128 * 4 / 2  # one GPU's query: half the tokens
    kv = 2 * q * 2 / 8  # k and v at 2 of 8 heads
    assert rows(r, 0, "comm", "send to").nbytes.tolist() == [kv] * 3
    r = simulate(t, 2, 100 * GB, cp=2, cp_comm="a2a")
    k = q * 2 / 8
    assert rows(r, 0, "comm", "all_to_all").nbytes.tolist() == [q, k, k, q, q, q, k, k]


# -- random layouts: conservation and invariants ---------------------------------------------------
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.sampled_from([2, 4, 8]),
    cp_log=st.integers(0, 3),
    comm=st.sampled_from(["p2p", "a2a"]),
    acc=st.integers(1, 2),
    layers=st.integers(1, 2),
    bw=st.floats(5, 500),
)
def test_random_cp_layouts_conserve_compute_and_bytes(n, cp_log, comm, acc, layers, bw):
    """Any dp x cp layout on a switch (every GPU its own links): each GPU computes its token
    share of the trace, 1/num_gpus of every forward and backward operator (here all of them
    scale with the tokens: CP moves attention, not work), plus the whole optimizer; the ring
    sends 3 (c - 1) key/value blocks per attention and micro-batch, each to a ring neighbour
    in its own group, and Ulysses does 8 all-to-alls; the iteration is the compute plus at
    most one transfer per ring step (or the all-to-alls) and the gradient all-reduces."""
    cp = min(2**cp_log, n)
    bw *= GB
    b = 2 * (n // cp) * acc
    t = attention_trace(b=b, s=256, layers=layers, H=8, d=64)
    par = {"cp": cp, "cp_comm": comm, "accumulation_steps": acc}
    r = simulate(t, n, bw, 1e-6, topology="switch", **par)
    work = sum(op.time for op in t.operators if op.phase != "optimizer")
    compute = work / n + OPT
    assert r.per_gpu()["compute"].tolist() == pytest.approx([compute] * n, rel=1e-9)
    ex = r.extrapolator
    kv = 2 * (b * 8 * 256 * 64 * 4) / (n * acc)  # k and v of one GPU's tokens per micro-batch
    assert r.iteration_time >= compute * (1 - 1e-12)
    for g in range(n):
        group = ex.group(g, "cp")
        assert len(group) == cp and g in group
        assert sorted({x // cp for x in group}) == [g // cp]  # consecutive ids
        sends = rows(r, g, "comm", "send to")
        a2a = rows(r, g, "comm", "all_to_all")
        reduce = rows(r, g, "comm", "allreduce")
        bound = compute + (reduce.end - reduce.start).sum()
        if cp == 1 or comm == "a2a":
            assert sends.empty
        if cp == 1 or comm == "p2p":
            assert a2a.empty
        if comm == "a2a" and cp > 1:
            assert len(a2a) == 8 * layers * acc
            assert a2a.nbytes.sum() == pytest.approx(8 * layers * acc * kv / 2)
            bound += (a2a.end - a2a.start).sum()
        if comm == "p2p" and cp > 1:
            j = group.index(g)
            nxt, prv = group[(j + 1) % cp], group[(j - 1) % cp]
            assert sends.nbytes.sum() == pytest.approx(3 * (cp - 1) * kv * layers * acc)
            assert set(sends[sends.phase == "forward"].name.astype(str)) == {f"send to {nxt}"}
            assert set(sends[sends.phase == "backward"].name.astype(str)) == {f"send to {prv}"}
            # at most one transfer's wait per step: forward c - 1, backward c
            steps = (2 * cp - 1) * layers * acc
            bound += steps * (2e-6 + 2 * kv / bw)  # two hops, the longest message
        assert r.iteration_time <= bound * (1 + 1e-9)
