"""Mixture-of-experts reference models (tracer.moe): published sizes, the router against a
per-token loop, real and shape-only traces alike, `--layers` replication, metadata."""

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from tracer.cli import trace_model  # noqa: E402
from tracer.models import build  # noqa: E402
from tracer.moe import MoE, capacity, moe_config  # noqa: E402
from triosim.common.errors import TracerError  # noqa: E402

# Published totals: Mixtral 8x7B 46.7B parameters, 12.9B active per token (Jiang et al.
# 2024; HF's count from config.json: 46,702,792,704); DeepSeek-V3 671B, 37B activated
# (technical report, abstract; the 14B multi-token-prediction module not counted).
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9), "deepseek-v3": (671e9, 37e9)}


def mixtral_hand_count():
    d, f, v, layers, e = 4096, 14336, 32000, 32, 8
    attention = 2 * d * d + 2 * d * 1024  # wq, wo; wk, wv at 8 of 32 heads
    per_layer = attention + e * 3 * d * f + d * e + 2 * d  # experts, router, two norms
    return 2 * v * d + layers * per_layer + d


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_are_the_published_ones(name):
    with torch.device("meta"):
        model, _, _ = build(name)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    cfg = moe_config(name)
    active = total - experts + experts * cfg["top_k"] // cfg["experts"]
    pub_total, pub_active = PUBLISHED[name]
    assert total == pytest.approx(pub_total, rel=0.002)
    assert active == pytest.approx(pub_active, rel=0.02)
    if name == "mixtral-8x7b":
        assert total == mixtral_hand_count() == 46_702_792_704


def test_capacity_is_the_balanced_share_times_the_factor():
    assert capacity(32, 8, 2, None) == 8  # 32 x 2 / 8
    assert capacity(32, 8, 2, 1.25) == 10
    assert capacity(30, 8, 2, 1.0) == 8  # ceil(7.5)
    assert capacity(4, 8, 8, 4.0) == 4  # never more than the tokens


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_router_and_experts_match_a_per_token_loop(gate):
    """With room for every token (capacity factor E / k), the grouped, capacity-dispatched
    layer computes what each token's top-k experts give, weighted: a loop by hand."""
    torch.manual_seed(1)
    e, k, d, f = 4, 2, 8, 12
    moe = MoE(d, e, k, f, shared=0, gate=gate, capacity_factor=e / k).double()
    moe.experts.compute_dtype = moe.router.compute_dtype = torch.float64
    x = torch.randn(1, 6, d, dtype=torch.float64)
    got = moe(x)[0]
    flat = x[0]
    logits = flat @ moe.router.weight.t()
    for t in range(flat.shape[0]):
        if gate == "softmax":
            s = torch.softmax(logits[t], -1)
            w, i = s.topk(k)
            w = w / w.sum()
        else:
            s = torch.sigmoid(logits[t])
            i = s.topk(k).indices
            w = s[i] / s[i].sum() * 2.5
        want = torch.zeros(d, dtype=torch.float64)
        for wt, ex in zip(w, i, strict=True):
            w1, w3, w2 = (moe.experts.w1[ex], moe.experts.w3[ex], moe.experts.w2[ex])
            want += wt * ((torch.nn.functional.silu(flat[t] @ w1) * (flat[t] @ w3)) @ w2)
        assert torch.allclose(got[t], want, atol=1e-10)


def test_dropping_routing_drops_what_is_over_capacity():
    """Capacity 1 per expert, 4 tokens, top-1: each expert keeps one token (the one with
    the heaviest gate), the rest give 0 from the routed experts."""
    torch.manual_seed(0)
    moe = MoE(4, 2, 1, 4, shared=0, gate="softmax", capacity_factor=1 / 2).double()
    moe.experts.compute_dtype = moe.router.compute_dtype = torch.float64
    assert capacity(4, 2, 1, 0.5) == 1
    out = moe(torch.randn(1, 4, 4, dtype=torch.float64))[0]
    assert int((out.abs().sum(-1) > 0).sum()) <= 2


def _names(t, phases=("forward", "backward")):
    # (a CPU run's optimizer loops over the parameters; a shape-only one, for a GPU, uses
    # the foreach kernels)
    return Counter((o.name, o.phase) for o in t.operators if o.phase in phases)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3"])
def test_real_and_shape_only_traces_agree_and_layers_replicate(name):
    real = trace_model(name, 2, small=True, seq_len=8, warmup=1, measure=1)
    meta = trace_model(name, 2, small=True, seq_len=8, shapes_only=True)
    one = trace_model(name, 2, small=True, seq_len=8, shapes_only=True, layers=1)
    # the meta device follows the CPU's dispatch: the same operators as a real run
    assert _names(real) == _names(meta)
    # 1 traced MoE layer replicated to 2 is operator for operator the 2-layer trace
    assert _names(one) == _names(meta)
    assert _names(one, ("optimizer",)) == _names(meta, ("optimizer",))
    assert len(one.tensors) == len(meta.tensors)
    assert sorted(t.nbytes for t in one.tensors.values()) == sorted(
        t.nbytes for t in meta.tensors.values()
    )
    cfg = moe_config(name, small=True)
    moe = real.metadata["moe"]
    assert moe == one.metadata["moe"]
    assert moe["num_experts"] == cfg["experts"] and moe["top_k"] == cfg["top_k"]
    assert moe["tokens"] == 16 and moe["capacity"] == capacity(16, cfg["experts"], 2, None)
    assert moe["dropless"] is True and moe["capacity_factor"] is None
    # the routed experts' grouped GEMMs: 3 bmm forward per MoE layer, in the expert module
    layers = {o.layer for o in real.operators if o.layer.endswith("." + moe["expert_module"])}
    assert layers == {f"layers.{i}.feed_forward.experts" for i in range(cfg["layers"])}
    bmm = [o for o in real.operators if o.name == "aten::bmm" and o.layer in layers]
    assert len(bmm) == 3 * cfg["layers"]
    # (experts, capacity, hidden) x (experts, hidden, ffn): 2 x E x C x d x f FLOPs
    e, c, d, f = cfg["experts"], moe["capacity"], cfg["dim"], cfg["expert_ffn"]
    assert bmm[0].flops == 2 * e * c * d * f
    weights = [t for t in real.tensors.values() if t.category == "weight"]
    expert_w = [t for t in weights if ".feed_forward.experts." in (t.name or "")]
    assert len(expert_w) == 3 * cfg["layers"]


def test_capacity_factor_is_for_moe_models_only():
    with pytest.raises(TracerError, match="capacity-factor"):
        trace_model("llama3-8b", 1, small=True, shapes_only=True, capacity_factor=1.0)
    t = trace_model("mixtral-8x7b", 2, small=True, seq_len=8, shapes_only=True, capacity_factor=2)
    assert t.metadata["moe"]["capacity"] == capacity(16, 8, 2, 2) == 8
    assert t.metadata["moe"]["dropless"] is False


@pytest.mark.no_cover
def test_latent_attention_runs_one_fused_attention_operator():
    t = trace_model("deepseek-v3", 1, small=True, seq_len=8, shapes_only=True)
    att = [o for o in t.operators if o.layer == "layers.0.attention"]
    fwd = [o.name for o in att if o.phase == "forward"]
    assert fwd.count("aten::scaled_dot_product_attention") == 1
    # PyTorch's unfused fallback (query and value head sizes differ) differentiates its
    # matrix products one by one, holding the whole score matrix: none here
    assert not [o.name for o in att if o.phase == "backward" and "Bmm" in o.name]


def test_mtp_module_holds_one_more_moe_layer_and_a_projection():
    """DeepSeek-V3 with one MTP module (--mtp 1): 14B parameters in the report with the
    shared embedding and head counted; here without them, by hand: one more MoE layer
    (attention, router, 256 routed and 1 shared expert, two norms) + eh_proj (2 x 7,168 x
    7,168 = 102,760,448) + its three norms (3 x 7,168)."""
    with torch.device("meta"):
        base, _, _ = build("deepseek-v3")
        mtp, _, loss = build("deepseek-v3", mtp=1)
    layer = sum(p.numel() for p in base.layers[0].parameters())
    extra = sum(p.numel() for p in mtp.parameters()) - sum(p.numel() for p in base.parameters())
    assert extra == layer + 2 * 7168 * 7168 + 3 * 7168
    assert 11e9 < extra < 14e9
    assert loss.__name__ == "mtp_loss"


def test_mtp_trace_runs_the_module_after_the_main_head_with_its_own_loss():
    """The module's operators come after the main model's output head, its MoE layer's
    experts are named as the others' (so expert parallelism finds them), the shared head
    runs twice, two cross-entropies; real and shape-only traces have the same operators;
    the metadata says so; other models refuse --mtp."""
    meta = trace_model("deepseek-v3", 2, small=True, seq_len=8, shapes_only=True, mtp=1)
    real = trace_model("deepseek-v3", 2, small=True, seq_len=8, warmup=1, measure=1, mtp=1)
    assert _names(meta) == _names(real)
    fwd = [o for o in meta.operators if o.phase == "forward"]
    first_mtp = min(i for i, o in enumerate(fwd) if (o.layer or "").startswith("mtp.0"))
    heads = [i for i, o in enumerate(fwd) if o.layer == "output" and o.name == "aten::linear"]
    assert len(heads) == 2 and heads[0] < first_mtp < heads[1]
    assert any(o.layer == "mtp.0.block.feed_forward.experts" for o in fwd)
    assert sum(o.name == "aten::cross_entropy_loss" for o in fwd) == 2
    assert meta.metadata["moe"]["mtp_layers"] == 1
    plain = trace_model("deepseek-v3", 2, small=True, seq_len=8, shapes_only=True)
    assert plain.metadata["moe"]["mtp_layers"] == 0
    assert not any((o.layer or "").startswith("mtp") for o in plain.operators)
    with pytest.raises(TracerError, match="--mtp"):
        trace_model("mixtral-8x7b", 2, small=True, shapes_only=True, mtp=1)
