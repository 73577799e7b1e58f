"""Expert parallelism (mode `ep`): a 2-expert, 2-GPU layer against a timeline computed by
hand, uneven loads, the uneven all-to-all in both communication models, conservation on
random EP layouts (hypothesis), memory per GPU, and clear errors."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extrapolators.modes import moe_loads
from triosim import Simulation
from triosim.common.errors import ConfigError
from triosim.trace.model import Operator, Tensor, Trace

GB = 1e9
B, L = 10 * GB, 2e-6  # every link of the fully connected topology
T, H = 4096, 1024  # tokens per GPU, hidden
TB = H * 2  # bytes of one token's hidden state in bfloat16
TIMES = dict(router=1e-3, experts=4e-3, experts_bwd=8e-3, router_bwd=2e-3, optimizer=3e-3)
DENSE, EXPERT = 8e6, 64e6  # weight bytes: the router (dense), both experts together


def moe_trace(
    layers=1, experts=2, top_k=1, tokens=T, batch=2, capacity=None, dense=DENSE, shared=None
):
    """`layers` MoE layers of two operators each (router, grouped experts), their backward,
    one optimizer operator; times TIMES. The expert operators read the routed tokens (an
    activation), so they scale with the tokens each GPU gets. `shared` (forward, backward
    seconds): a shared expert after the routed ones, on the layer's input."""
    tensors, ops = {}, []

    def add(cat, nbytes, name=None):
        t = Tensor(len(tensors), (batch, 8), "bfloat16", float(nbytes), cat, name)
        tensors[t.id] = t
        return t.id

    x = add("input", tokens * TB)
    fwd = []
    for i in range(layers):
        wr = add("weight", dense / layers, f"layers.{i}.feed_forward.router.weight")
        we = add("weight", EXPERT / layers, f"layers.{i}.feed_forward.experts.w1")
        a, y = add("activation", tokens * TB), add("activation", tokens * TB)
        parts = [
            ("aten::linear", "router", (x, wr), (a,), TIMES["router"]),
            ("aten::bmm", "experts", (a, we), (y,), TIMES["experts"]),
        ]
        if shared is not None:
            ws = add("weight", dense / layers, f"layers.{i}.feed_forward.shared_experts.w")
            z = add("activation", tokens * TB)
            parts.append(("aten::linear", "shared_experts", (x, ws), (z,), shared[0]))
        for name, layer, ins, outs, t in parts:
            ops.append(
                Operator(
                    len(ops), name, f"layers.{i}.feed_forward.{layer}", "forward", t, ins, outs, 1.0
                )
            )
            fwd.append((ops[-1], ins))
        x = y
    grads = []
    for op, ins in reversed(fwd):
        g, ga = add("gradient", tensors[ins[1]].nbytes), add("activation", tokens * TB)
        grads.append(g)
        t = TIMES["experts_bwd" if op.name == "aten::bmm" else "router_bwd"]
        if op.layer.endswith("shared_experts"):
            t = shared[1]
        ops.append(
            Operator(
                len(ops),
                op.name + "Backward",
                op.layer,
                "backward",
                t,
                (ins[0], ins[1]),
                (ga, g),
                1.0,
                fwd_id=op.id,
            )
        )
    weights = tuple(t.id for t in tensors.values() if t.category == "weight")
    ops.append(
        Operator(
            len(ops),
            "aten::_foreach_add_",
            "optimizer",
            "optimizer",
            TIMES["optimizer"],
            weights + tuple(grads),
            (),
            None,
        )
    )
    moe = {
        "expert_module": "feed_forward.experts",
        "num_experts": experts,
        "top_k": top_k,
        "hidden": H,
        "tokens": tokens,
        "capacity": capacity if capacity is not None else tokens * top_k / experts,
        "capacity_factor": None,
        "dispatch_dtype": "bfloat16",
        "shared_experts": 1 if shared is not None else 0,
    }
    return Trace(ops, tensors, {"batch_size": batch, "gpu": "H100-SXM", "moe": moe}).validate()


def run(n=2, trace=None, comm="textbook", latency=L, batch=None, **parallelism):
    cfg = {
        "num_gpus": n,
        "batch_size": batch or 2 * n,  # the traced batch on every GPU: times as traced
        "parallelism": {"mode": "ep", **parallelism},
        "topology": {"kind": "fully_connected", "bandwidth": B, "latency": latency},
        "communication": {"kind": comm},
        "perfmodel": {"kind": "trace"},
        # bfloat16 weights (2 bytes a parameter, as traced), Adam: 12 bytes of fp32 states
        "memory": {"precision": "mixed", "optimizer": "adam"},
    }
    sim = Simulation(cfg, trace=trace or moe_trace())
    return sim, sim.run()


def a2a_rows(r, gpu=None):
    tl = r.timeline
    rows = tl[(tl["kind"] == "comm") & (tl["name"] == "all_to_all")]
    return rows if gpu is None else rows[rows["gpu"] == gpu]


def test_two_experts_on_two_gpus_by_hand():
    """Top-1, uniform: each GPU keeps half its tokens and sends the other half to the other
    GPU's expert, tokens x hidden x 2 bytes x 1/2, four times (dispatch, combine, and
    both in backward). Hand timeline: router, A, experts, A, A, experts' backward, A,
    router's backward, the router's gradient all-reduced over both GPUs (the expert
    gradients have no replica: dp 1), the optimizer on the router and one expert."""
    _, r = run()
    sent = T * TB / 2
    a2a = sent / B + L  # one transfer each way, on its own link
    allreduce = 2 * (2 - 1) / 2 * DENSE / B + 2 * (2 - 1) * L  # textbook ring on 2 GPUs
    share = (DENSE + EXPERT / 2) / (DENSE + EXPERT)
    t = TIMES
    want = (
        t["router"] + t["experts"] + t["experts_bwd"] + t["router_bwd"] + 4 * a2a + allreduce
    ) + t["optimizer"] * share
    assert r.iteration_time == pytest.approx(want, rel=1e-9)
    for g in (0, 1):
        rows = a2a_rows(r, g)
        assert len(rows) == 4
        assert list(rows["phase"]) == ["forward", "forward", "backward", "backward"]
        assert (rows["end"] - rows["start"]).to_numpy() == pytest.approx([a2a] * 4)
        assert rows["nbytes"].sum() == pytest.approx(4 * T * TB)  # its whole buffer, 4 times
    # bytes on the links: 4 all-to-alls x 2 directions x half the tokens, + the ring
    links = r.per_link()["nbytes"].sum()
    assert links == pytest.approx(4 * 2 * sent + 2 * DENSE)


def test_uneven_loads_by_hand():
    """Given loads 3:1: expert 0 (GPU 0) gets 3/4 of the routed tokens, 1.5 x the traced
    work, expert 1 (GPU 1) 0.5 x. Each all-to-all ends with its larger direction (3/4 of
    a GPU's tokens); GPU 0's experts set the pace, GPU 1 waits for it."""
    sim, r = run(load="given", expert_loads=[3, 1])
    a2a = 0.75 * T * TB / B + L
    allreduce = DENSE / B + 2 * L
    share = (DENSE + EXPERT / 2) / (DENSE + EXPERT)
    t = TIMES
    want = (
        t["router"]
        + 1.5 * (t["experts"] + t["experts_bwd"])
        + t["router_bwd"]
        + 4 * a2a
        + allreduce
    ) + t["optimizer"] * share
    assert r.iteration_time == pytest.approx(want, rel=1e-9)
    tl = r.timeline
    busy = tl[(tl["kind"] == "compute") & tl["layer"].str.endswith("experts")]
    per_gpu = busy.assign(d=busy["end"] - busy["start"]).groupby("gpu")["d"].sum()
    assert per_gpu[0] == pytest.approx(1.5 * (t["experts"] + t["experts_bwd"]))
    assert per_gpu[1] == pytest.approx(0.5 * (t["experts"] + t["experts_bwd"]))
    # GPU 0 sends 1/4 of its tokens to GPU 1 and GPU 1 3/4 of its own to GPU 0 (dispatch)
    row = (0.75 * T * TB, 0.25 * T * TB)
    assert [x for r_ in sim.extrapolator.experts.sizes for x in r_] == pytest.approx([*row, *row])


def test_nccl_uneven_all_to_all_is_the_even_one_when_even():
    """The NCCL model's uneven all-to-all with equal sizes is its all-to-all: same streams,
    same time; a pair sending twice the bytes takes twice the bandwidth time."""
    import simpy

    from extrapolators.communication.nccl.model import Nccl
    from networks import PacketSwitchNetwork
    from networks import topology as topo

    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.fully_connected(4, B, L))
    m = Nccl(env, net)
    g, size = (0, 1, 2, 3), 64e6
    even = m.plan("all_to_all", g, size)
    uneven = m.plan_uneven(g, tuple(tuple(size / 4 for _ in g) for _ in g))
    assert uneven.time == pytest.approx(even.time, rel=1e-12)
    flat = [x for st_ in sorted(uneven.streams) for x in st_]
    assert flat == pytest.approx([x for st_ in sorted(even.streams) for x in st_])
    double = tuple(tuple(size / 2 if (i, j) == (0, 1) else size / 4 for j in g) for i in g)
    p = m.plan_uneven(g, double)
    assert p.bandwidth_time == pytest.approx(2 * even.bandwidth_time, rel=1e-12)


def test_both_communication_models_deliver_the_uneven_bytes():
    """No dense weights (so no all-reduce) and dp 1: the links carry exactly the
    all-to-alls' off-diagonal bytes, four times, in both models (NCCL's p2p runs Simple:
    no protocol flags)."""
    tr = moe_trace(experts=4, top_k=2, dense=0.0)
    for comm in ("textbook", "nccl"):
        sim, r = run(4, tr, comm, load="skew", skew=1.2, seed=3)
        s = sim.extrapolator.experts.sizes
        assert len({row for row in s}) == 1 and len(set(s[0])) == 4  # uneven columns
        off = sum(s[i][j] for i in range(4) for j in range(4) if i != j)
        assert r.per_link()["nbytes"].sum() == pytest.approx(4 * off, rel=1e-9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2, 4]),
    per_rank=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 2]),
    layers=st.sampled_from([1, 2]),
    loads=st.lists(st.integers(1, 5), min_size=8, max_size=8),
    cf=st.sampled_from([None, 1.0, 1.5]),
)
def test_conservation_on_random_ep_layouts(dp, ep, per_rank, top_k, layers, loads, cf):
    """Bytes on the links = the all-to-alls' off-diagonal sizes x 4 x layers x replicas +
    the dense ring all-reduce over all GPUs + each expert group's ring all-reduce; kept
    tokens <= routed; each GPU's expert time is its share of the tokens."""
    n, experts = dp * ep, ep * per_rank
    top_k = min(top_k, experts)
    loads = loads[:experts]
    shares = [x / sum(loads) for x in loads]
    if max(shares) > 1 / top_k:
        loads = [1] * experts
    tr = moe_trace(layers=layers, experts=experts, top_k=top_k)
    sim, r = run(
        n, tr, ep=ep, load="given", expert_loads=[float(x) for x in loads], capacity_factor=cf
    )
    ex = sim.extrapolator
    routed = sum(moe_loads.kept_tokens(ex.experts.shares, T, top_k, ep, None))
    kept = sum(ex.experts.kept)
    assert kept <= routed * (1 + 1e-12)
    if cf is None:
        assert kept == pytest.approx(ep * T * top_k)  # dropless: every routed token
    s = ex.experts.sizes
    assert sum(map(sum, s)) == pytest.approx(kept * TB)  # every kept token dispatched once
    off = sum(s[i][j] for i in range(ep) for j in range(ep) if i != j)
    ring = 2 * (n - 1) * DENSE if n > 1 else 0.0
    expert_ring = ep * 2 * (dp - 1) * EXPERT / ep
    links = r.per_link()["nbytes"].sum() if n > 1 else 0.0
    assert links == pytest.approx(4 * layers * dp * off + ring + expert_ring, rel=1e-9, abs=1e-6)
    # each GPU's expert compute: its experts' tokens / the traced slots, per layer
    tl = r.timeline
    busy = tl[(tl["kind"] == "compute") & tl["layer"].str.endswith("experts")]
    per_gpu = busy.assign(d=busy["end"] - busy["start"]).groupby("gpu")["d"].sum()
    traced = experts * T * top_k / experts
    for g in range(n):
        j = g % ep
        want = (
            layers * (TIMES["experts"] + TIMES["experts_bwd"]) * ex.experts.gpu_tokens[j] / traced
        )
        assert per_gpu[g] == pytest.approx(want, rel=1e-9)


def test_memory_holds_the_gpus_share_of_the_experts():
    for ep in (1, 2, 4):
        sim, r = run(4, moe_trace(experts=4), ep=ep)
        held = sim.extrapolator.held_weight_bytes(0)
        assert held == pytest.approx(DENSE + EXPERT / ep)
        mem = r.memory[r.memory["gpu"] == 0]
        assert mem["weights"].max() == pytest.approx(held, rel=1e-9)
        # mixed precision: 2-byte gradients, 12 bytes of fp32 master + Adam states a parameter
        assert mem["optimizer_states"].max() == pytest.approx(6 * held, rel=1e-9)


def test_ep_1_is_data_parallel_with_the_gradients_in_two_all_reduces():
    """ep 1: no all-to-all, every expert local; at zero latency two ring all-reduces of A
    and B bytes take what one of A + B does, so the iteration is mode dp's."""
    _, r = run(4, moe_trace(experts=4), latency=0.0, ep=1)
    cfg = {
        "num_gpus": 4,
        "batch_size": 8,
        "parallelism": {"mode": "dp"},
        "topology": {"kind": "fully_connected", "bandwidth": B, "latency": 0.0},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "trace"},
    }
    dp = Simulation(cfg, trace=moe_trace(experts=4)).run()
    assert len(a2a_rows(r)) == 0
    assert r.iteration_time == pytest.approx(dp.iteration_time, rel=1e-12)


@pytest.mark.parametrize(
    "parallelism, field",
    [
        ({"ep": 3}, "parallelism.ep"),
        ({"ep": 4}, "parallelism.ep"),  # 4 GPUs but 2 experts
        ({"ep": 2, "load": "given", "expert_loads": [1.0]}, "parallelism.expert_loads"),
        ({"ep": 2, "load": "given", "expert_loads": [-1.0, 2.0]}, "parallelism.expert_loads"),
    ],
)
def test_bad_plans_name_their_field(parallelism, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        run(4, **parallelism)


def test_a_trace_without_experts_is_refused():
    from tests.conftest import chain_trace

    cfg = {"num_gpus": 2, "parallelism": {"mode": "ep"}, "batch_size": 16}
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        Simulation(cfg, trace=chain_trace())


def test_skewed_shares_are_capped_and_seeded():
    a = moe_loads.expert_shares(8, 2, "skew", skew=3.0, seed=1)
    assert sum(a) == pytest.approx(1) and max(a) <= 0.5 + 1e-12
    assert a == moe_loads.expert_shares(8, 2, "skew", skew=3.0, seed=1)
    assert a != moe_loads.expert_shares(8, 2, "skew", skew=3.0, seed=2)
    assert moe_loads.expert_shares(8, 2, "skew", skew=0.0) == pytest.approx([1 / 8] * 8)
    # dropping: expert 0 has 3/4 of 2 x 100 tokens; capacity 1.0 x 100 keeps 100
    kept = moe_loads.kept_tokens([0.75, 0.25], 100, 1, 2, 1.0)
    assert kept == [100.0, 50.0]


def test_loads_above_one_over_top_k_are_refused():
    with pytest.raises(ConfigError, match=r"parallelism\.expert_loads.*1/top_k"):
        run(2, moe_trace(top_k=2), load="given", expert_loads=[3.0, 1.0])


def test_a_traced_moe_model_runs_with_expert_parallelism():
    """The tiny Mixtral's real CPU trace: per GPU 4 all-to-alls per MoE layer, each its
    buffer of tokens x top_k x hidden x 2 bytes; dense and expert gradients reduced."""
    pytest.importorskip("torch")
    from tracer.cli import trace_model

    tr = trace_model("mixtral-8x7b", 4, small=True, seq_len=8, warmup=1, measure=1)
    moe = tr.metadata["moe"]
    cfg = {
        "num_gpus": 4,
        "batch_size": 8,  # 2 sequences per GPU: half the traced tokens
        "parallelism": {"mode": "ep", "ep": 2},
        "topology": {"kind": "switch", "bandwidth": "50 GB/s", "latency": "1 us"},
    }
    r = Simulation(cfg, trace=tr).run()
    rows = a2a_rows(r, 0)
    assert len(rows) == 4 * moe["moe_layers"]
    per_gpu_tokens = moe["tokens"] / 2
    assert rows["nbytes"].to_numpy() == pytest.approx(
        per_gpu_tokens * moe["top_k"] * moe["hidden"] * 2
    )
    tl = r.timeline
    comm = tl[tl["kind"] == "comm"]
    assert set(comm["key"]) >= {"dp:p0t0", "dp:experts0.0p0", "dp:experts1.0p0"}


def test_accumulation_repeats_forward_backward_and_reduces_once():
    """2 accumulation steps of the traced batch (global batch 2 GPUs x 2 steps x 1): the
    2-GPU layer's forward and backward with their four all-to-alls twice, then one
    all-reduce and the optimizer, by hand."""
    sim, r = run(2, moe_trace(batch=1), batch=4, accumulation_steps=2)
    assert sim.extrapolator.op_batch() == 1
    a2a = T * TB / 2 / B + L
    allreduce = DENSE / B + 2 * L
    share = (DENSE + EXPERT / 2) / (DENSE + EXPERT)
    t = TIMES
    step = t["router"] + t["experts"] + t["experts_bwd"] + t["router_bwd"] + 4 * a2a
    assert r.iteration_time == pytest.approx(2 * step + allreduce + t["optimizer"] * share)
    assert len(a2a_rows(r, 0)) == 8
    tl = r.timeline
    assert set(tl[tl["name"] == "allreduce"]["key"].astype(str)) == {"dp:p0t0"}


def test_expert_gemms_read_one_gpus_share_of_the_weights():
    """With a model that scales operators (roofline, efficiency fitted per operator name on
    the trace), an expert operator on EP rank j is timed on E/ep experts' weights at its
    tokens: the synthetic experts' operators are memory-bound (1 FLOP), so their time is
    the traced time x (their bytes with the weights and gradients halved) / (their
    traced bytes). The router keeps its traced time."""
    tr = moe_trace()
    cfg = {
        "num_gpus": 2,
        "batch_size": 4,
        "parallelism": {"mode": "ep"},
        "topology": {"kind": "fully_connected", "bandwidth": B, "latency": L},
        "perfmodel": {"kind": "roofline"},
    }
    r = Simulation(cfg, trace=tr).run()
    tl = r.timeline
    g0 = tl[(tl["gpu"] == 0) & (tl["kind"] == "compute")]
    d = dict(zip(g0["name"].astype(str), g0["end"] - g0["start"], strict=True))
    act = T * TB  # the routed tokens in, the expert output out (forward)
    fwd = TIMES["experts"] * (EXPERT / 2 + 2 * act) / (EXPERT + 2 * act)
    # backward: reads the tokens and the weight, writes the tokens' and the weight's gradient
    bwd = TIMES["experts_bwd"] * (2 * EXPERT / 2 + 2 * act) / (2 * EXPERT + 2 * act)
    assert d["aten::bmm"] == pytest.approx(fwd, rel=1e-9)
    assert d["aten::bmmBackward"] == pytest.approx(bwd, rel=1e-9)
    assert d["aten::linear"] == pytest.approx(TIMES["router"], rel=1e-9)


def test_overlapped_reduction_at_ep_1_is_ddp_with_a_bucket_per_weight():
    """ep 1 with dp_overlap and buckets of one weight each: every weight's gradient
    all-reduced over all GPUs as soon as it is ready, in the same order as mode ddp with
    the same buckets: the same iteration, to the last bit of the sums."""
    tiny = {"bucket_size": 1.0, "first_bucket_size": 1.0}
    tr = moe_trace(layers=2, experts=4)
    sim, r = run(4, tr, ep=1, dp_overlap=True, **tiny)
    assert [k for _, _, k in sim.extrapolator.buckets[0]].count("expert") == 2
    cfg = {
        "num_gpus": 4,
        "batch_size": 8,
        "parallelism": {"mode": "ddp", **tiny},
        "topology": {"kind": "fully_connected", "bandwidth": B, "latency": L},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "trace"},
    }
    ddp = Simulation(cfg, trace=moe_trace(layers=2, experts=4)).run()
    assert r.iteration_time == pytest.approx(ddp.iteration_time, rel=1e-12)


def test_overlapped_reduction_starts_when_a_bucket_is_ready():
    """2 MoE layers on 2 GPUs (ep 2, dp 2 on 4 GPUs): the dense bucket of layer 1's router
    is all-reduced right after that router's backward, before layer 0's backward ends, and
    each expert bucket over its 2 replicas; bytes as the two kinds' totals."""
    tr = moe_trace(layers=2, experts=2)
    sim, r = run(4, tr, ep=2, dp_overlap=True, bucket_size=1.0, first_bucket_size=1.0)
    ex = sim.extrapolator
    assert sum(b for _, b, k in ex.buckets[0] if k == "dense") == pytest.approx(DENSE)
    assert sum(b for _, b, k in ex.buckets[0] if k == "expert") == pytest.approx(EXPERT / 2)
    tl = r.timeline
    g0 = tl[tl["gpu"] == 0]
    router1 = g0[
        (g0["name"] == "aten::linearBackward") & (g0["layer"] == "layers.1.feed_forward.router")
    ]
    first = g0[(g0["kind"] == "comm") & g0["key"].astype(str).str.startswith("dp:p0t0:bucket")]
    assert first["start"].min() == pytest.approx(float(router1["end"].iloc[0]))
    last_bwd = g0[(g0["kind"] == "compute") & (g0["phase"] == "backward")]["end"].max()
    assert first["start"].min() < last_bwd
    expert = g0[
        (g0["kind"] == "comm") & g0["key"].astype(str).str.startswith("dp:experts0.0p0:bucket")
    ]
    assert len(expert) == 2 and (expert["nbytes"] == EXPERT / 2 / 2).all()
    _, after = run(4, tr, ep=2)
    assert r.iteration_time < after.iteration_time
