"""Activation checkpointing policies (parallelism.recompute) on one Llama layer by hand: which
forward operators each recomputes and what each keeps from the forward pass to the backward.

The layer as torchtitan writes it (torchtitan/models/llama3/model.py): attention_norm, wq, wk,
wv, scaled-dot-product attention, wo, the residual add, ffn_norm, w1, silu, w3, their product,
w2, the residual add; the loss reads the layer's output. Each backward operator reads what
autograd saves for it (a linear its input, silu its input, the product both factors, the
attention its q, k, v and output, a norm its input).
"""

from __future__ import annotations

import re

import pytest

from extrapolators.modes.blocks import block_depth, check_modules, layer_units, with_recompute
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation
from triosim.trace.model import Operator, Tensor, Trace

S, F = 1e6, 3e6  # bytes of a hidden-sized activation and of an FFN-sized one
KV = S / 4  # grouped-query attention: k and v a quarter of q


def llama_layer(layers: int = 1) -> Trace:
    tensors, ops = {}, []

    def tensor(cat, nbytes):
        t = Tensor(len(tensors), (8, 16), "bfloat16", float(nbytes), cat)
        tensors[t.id] = t
        return t.id

    def op(name, layer, phase, ins, outs, fwd=None):
        t = 1e-3 if phase == "forward" else 2e-3
        ops.append(Operator(len(ops), name, layer, phase, t, ins, outs, 0.0, fwd_id=fwd))
        return len(ops) - 1

    x = tensor("input", S)
    saved = []  # (forward op id, what its backward reads, name, layer)
    for i in range(layers):
        L = f"layers.{i}"
        w = {
            n: tensor("weight", 1e3) for n in ("an", "wq", "wk", "wv", "wo", "fn", "w1", "w2", "w3")
        }

        def fwd(name, layer, ins, out_bytes, reads, weight=None, L=L, w=w):
            out = tensor("activation", out_bytes)
            full_ins = ins + ((w[weight],) if weight else ())
            where = f"{L}.{layer}" if layer else L
            k = op(name, where, "forward", full_ins, (out,))
            saved.append((k, reads + ((w[weight],) if weight else ()), name, where))
            return out

        n1 = fwd("aten::rms_norm", "attention_norm", (x,), S, (x,), "an")
        q = fwd("aten::linear", "attention.wq", (n1,), S, (n1,), "wq")
        k = fwd("aten::linear", "attention.wk", (n1,), KV, (n1,), "wk")
        v = fwd("aten::linear", "attention.wv", (n1,), KV, (n1,), "wv")
        qv = len(tensors)  # q's heads: a view (the same storage; no kernel, no bytes)
        tensors[qv] = Tensor(qv, (8, 16), "bfloat16", S, "activation", storage=q)
        tensors[q] = Tensor(q, (8, 16), "bfloat16", S, "activation", storage=q)
        view = op("aten::view", f"{L}.attention", "forward", (q,), (qv,))
        saved.append((view, (), "view", f"{L}.attention"))
        a = tensor("activation", S)
        sdpa = op(
            "aten::scaled_dot_product_attention", f"{L}.attention", "forward", (qv, k, v), (a,)
        )
        saved.append((sdpa, (qv, k, v, a), "sdpa", f"{L}.attention"))
        o = fwd("aten::linear", "attention.wo", (a,), S, (a,), "wo")
        r1 = fwd("aten::add", "attention", (x, o), S, ())
        n2 = fwd("aten::rms_norm", "ffn_norm", (r1,), S, (r1,), "fn")
        g = fwd("aten::linear", "feed_forward.w1", (n2,), F, (n2,), "w1")
        s = fwd("aten::silu", "feed_forward", (g,), F, (g,))
        u = fwd("aten::linear", "feed_forward.w3", (n2,), F, (n2,), "w3")
        m = fwd("aten::mul", "feed_forward", (s, u), F, (s, u))
        d = fwd("aten::linear", "feed_forward.w2", (m,), S, (m,), "w2")
        x = fwd("aten::add", "", (r1, d), S, ())
    loss = tensor("activation", 4.0)
    sum_op = op("aten::sum", "loss", "forward", (x,), (loss,))
    op("SumBackward0", "loss", "backward", (), (tensor("activation", S),), fwd=sum_op)
    for k, reads, name, layer in reversed(saved):
        grad = tensor("activation", S)
        op(f"{name}Backward", layer, "backward", reads, (grad,), fwd=k)
    return Trace(ops, tensors, {"batch_size": 8}).validate()


def recomputed(trace, policy, every=1, modules=()):
    """The recomputed (module, operator) pairs, the modules checked first (as the mesh
    checks them, once for the whole trace)."""
    if policy == "modules":
        check_modules(trace.operators, modules)
    unit_of, names, _ = layer_units(trace, block_depth(trace))
    walk = with_recompute(trace.operators, policy, unit_of, names, every, modules)
    return [
        (re.sub(r"^layers\.\d+\.?", "", op.layer) or op.layer, op.name)
        for op, again in walk
        if again
    ]


def test_the_blocks_are_the_numbered_layers():
    t = llama_layer(2)
    assert block_depth(t) == 2  # layers.0, layers.1 (not the loss)
    assert layer_units(t, 2)[1] == ["layers.0", "layers.1", "loss"]


def test_torchtitans_op_policy_saves_the_attention_and_every_other_matrix_product():
    # the block's matrix products in forward order: wq 1, wk 2, wv 3, wo 4, w1 5, w3 6,
    # w2 7; the odd ones (wq, wv, w1, w2) and the attention are saved, all else runs again
    assert recomputed(llama_layer(), "op") == [
        ("attention_norm", "aten::rms_norm"),
        ("attention.wk", "aten::linear"),
        ("attention", "aten::view"),  # (of the saved q: no second copy)
        ("attention.wo", "aten::linear"),
        ("attention", "aten::add"),
        ("ffn_norm", "aten::rms_norm"),
        ("feed_forward", "aten::silu"),
        ("feed_forward.w3", "aten::linear"),
        ("feed_forward", "aten::mul"),
        ("layers.0", "aten::add"),  # (the block's own: its residual add)
    ]


def test_full_recomputes_the_whole_block_and_never_the_loss():
    assert len(recomputed(llama_layer(), "full")) == 15  # every forward op of the layer


def test_every_second_block_as_torchtitans_selective_layer_option():
    layers = {layer for layer, _ in recomputed(llama_layer(2), "full", every=2)}
    assert layers == {"attention_norm", "attention.wq", "attention.wk", "attention.wv",
                      "attention", "attention.wo", "ffn_norm", "feed_forward.w1",
                      "feed_forward", "feed_forward.w3", "feed_forward.w2", "layers.1"}  # fmt: skip
    ops = recomputed(llama_layer(2), "full", every=2)
    assert len(ops) == 15 and ("layers.1", "aten::add") in ops  # only layers.1


def activations_after_forward(policy, modules=()):
    """The activation bytes held while the loss runs, the forward pass's last operator (one
    GPU): what the forward pass leaves for the backward, and the loss's 4-byte output."""
    par = {"mode": "mesh", "recompute": policy}
    if modules:
        par["recompute_modules"] = list(modules)
    cfg = {"num_gpus": 1, "parallelism": par}
    r = Simulation(cfg, trace=llama_layer()).run()
    tl = r.timeline
    end = tl[(tl.phase == "forward")].end.max()
    m = r.memory
    return m[m.time < end].activations.iloc[-1] - 4.0, r


@pytest.mark.parametrize(
    "policy,held",
    [
        # everything a backward op reads: x, n1, q, k, v, attention out, r1, n2, g, silu
        # out, u, m; the model's output (the training loop holds it)
        ("none", 6 * S + 2 * KV + 4 * F + S),
        # the block's input (x), the saved products' outputs (q, v, g, w2's d) and the
        # attention output; the model's output
        ("op", S + S + KV + F + S + S + S),
        # the block's input; the model's output
        ("full", S + S),
    ],
)
def test_what_each_policy_keeps_from_forward_to_backward(policy, held):
    got, _ = activations_after_forward(policy)
    assert got == pytest.approx(held, rel=1e-12)


def test_op_recomputes_in_backward_what_it_did_not_save():
    # 15 forward ops of 1 ms (the view's too); 15 backward of 2 ms; the recomputed ones
    # 1 ms each again
    times = {p: activations_after_forward(p)[1].iteration_time for p in ("none", "op", "full")}
    assert times["none"] == pytest.approx(16e-3 + 32e-3, rel=1e-12)  # + the loss's two
    assert times["op"] == pytest.approx(times["none"] + 10e-3, rel=1e-12)
    assert times["full"] == pytest.approx(times["none"] + 15e-3, rel=1e-12)


def test_recompute_every_needs_a_policy_of_whole_blocks():
    cfg = {"num_gpus": 1, "parallelism": {"mode": "mesh", "recompute": "selective",
                                          "recompute_every": 2}}  # fmt: skip
    with pytest.raises(ConfigError, match="recompute_every"):
        Simulation(cfg, trace=llama_layer())


def test_megatrons_recompute_modules_by_hand():
    # Megatron-Core's --recompute-modules on the layer: each names the operators it runs
    # again (the weights' casts of a module go with it where the trace has them)
    layer = llama_layer()
    assert recomputed(layer, "modules", modules=("layernorm",)) == [
        ("attention_norm", "aten::rms_norm"),
        ("ffn_norm", "aten::rms_norm"),
    ]
    assert recomputed(layer, "modules", modules=("core_attn",)) == [
        ("attention", "aten::scaled_dot_product_attention")
    ]
    assert recomputed(layer, "modules", modules=("mlp",)) == [  # no experts: the dense MLP
        ("feed_forward.w1", "aten::linear"),
        ("feed_forward", "aten::silu"),
        ("feed_forward.w3", "aten::linear"),
        ("feed_forward", "aten::mul"),
        ("feed_forward.w2", "aten::linear"),
    ]
    # modules the layer does not have are refused, as Megatron refuses them
    for m, what in (
        ("mla_up_proj", "multi-latent"),
        ("moe", "experts"),
        ("moe_act", "experts"),
        ("shared_experts", "shared experts"),
    ):
        with pytest.raises(ConfigError, match=what):
            recomputed(layer, "modules", modules=(m,))


def test_mla_up_proj_and_moe_act_on_deepseek_and_mixtral():
    # DeepSeek-V3's MLA: the up-projections (wq_b, wkv_b, with their weights' casts) and
    # what its attention module runs before the kernel (RoPE's products, splits,
    # concatenations); never the down-projections, MLA's own norms or the kernel.
    # Mixtral's moe_act: the experts' activation (silu and the product), not the casts of
    # the experts' weights
    from pathlib import Path

    from triosim.trace.model import load

    root = Path(__file__).resolve().parents[1] / "traces/modelled/h100-sxm"
    ds = load(root / "deepseek-v3-s4096-b1.trace.json.gz")
    again = {
        (re.sub(r"^dense_layers\.\d+\.", "", layer), name)  # (its 3 dense layers: dense_layers.N)
        for layer, name in recomputed(ds, "modules", modules=("mla_up_proj",))
    }
    layers = {layer for layer, _ in again}
    assert layers == {"attention", "attention.wq_b", "attention.wkv_b"}
    assert ("attention", "aten::scaled_dot_product_attention") not in again
    # a pipeline stage without experts (DeepSeek-V3's dense layers) under moe: the model
    # has experts, so moe is accepted; the stage recomputes nothing of it
    check_modules(ds.operators, ("moe",))
    unit_of, names, _ = layer_units(ds, block_depth(ds))
    dense = [o for o in ds.operators if o.layer.startswith("dense_layers.0")]
    assert not any(
        again for _, again in with_recompute(dense, "modules", unit_of, names, 1, ("moe",))
    )
    mx = load(root / "mixtral-8x7b-s4096-b1.trace.json.gz")
    names = {name for _, name in recomputed(mx, "modules", modules=("moe_act",))}
    assert names == {"aten::silu", "aten::mul"}


@pytest.mark.parametrize(
    "modules,held",
    [
        # layernorm: as none, but the norms' outputs n1 and n2 are made again in backward
        # (their inputs x and r1 stay, the products read them again)
        (("layernorm",), 6 * S + 2 * KV + 4 * F + S - 2 * S),
        # mlp: the block keeps n2 (the MLP's input), not g, silu out, u, m
        (("mlp",), 6 * S + 2 * KV + 4 * F + S - 4 * F),
    ],
)
def test_what_recompute_modules_keep_from_forward_to_backward(modules, held):
    got, r = activations_after_forward("modules", modules)
    assert got == pytest.approx(held, rel=1e-12)
    # each recomputed forward operator runs once more: 2 norms or the MLP's 5, 1 ms each
    none = activations_after_forward("none")[1].iteration_time
    again = 2e-3 if modules == ("layernorm",) else 5e-3
    assert r.iteration_time == pytest.approx(none + again, rel=1e-12)


def test_recompute_modules_are_megatrons_names_with_policy_modules():
    for par, field in (
        ({"recompute": "modules"}, "recompute_modules"),
        ({"recompute": "full", "recompute_modules": ["mlp"]}, "recompute_modules"),
        ({"recompute": "modules", "recompute_modules": ["ffn"]}, "recompute_modules"),
        # a module the model does not have (no MLA): refused by the mesh before it runs
        ({"recompute": "modules", "recompute_modules": ["mla_up_proj"]}, "multi-latent"),
    ):
        cfg = {"num_gpus": 1, "parallelism": {"mode": "mesh", **par}}
        with pytest.raises(ConfigError, match=field):
            Simulation(cfg, trace=llama_layer())
