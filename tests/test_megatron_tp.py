"""Tensor parallelism on layers: Megatron's collectives (and the paper's channel split),
counted per GPU in the timeline and timed against hand calculations."""

import math
from pathlib import Path

import pytest

from tests.conftest import GO_TRACES, chain_trace
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation
from triosim.trace.model import Operator, Tensor, Trace, load

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
F32 = 4


def run(trace, n, topology=None, batch_size=None, **par):
    top = topology or {"kind": "ring", "bandwidth": 10 * GB, "latency": 0.0}
    s = Simulation(
        {
            "num_gpus": n,
            "batch_size": batch_size,
            "topology": top,
            "parallelism": {"mode": "tp", **par},
            "communication": {"kind": "textbook"},
        },
        trace=trace,
    )  # hand: alpha-beta
    r = s.run()
    r.extrapolator = s.extrapolator
    return r


def comm(r, gpu=0):
    tl = r.timeline
    return tl[(tl.kind == "comm") & (tl.gpu == gpu)]


def ring_time(op, nbytes, n, bw):
    """Textbook ring times with no latency: all-reduce 2(n-1)/n, the others (n-1)/n."""
    return (2 if op == "allreduce" else 1) * (n - 1) / n * nbytes / bw


# -- a small GPT-style trace with known answers ------------------------------------------------
def transformer_trace(L=2, b=4, s=16, h=32, V=64, P=32):
    """tok + pos embeddings (tied head), L pre-norm blocks (ln1, qkv, attention, proj, add,
    ln2, fc1, gelu, fc2, add), ln_f, head, reshape, cross-entropy; each linear's backward is
    four autograd operators (view, addmm or mm, t, view) paired with it, as PyTorch records
    a 3-D linear. Every operator of kind k takes TIME[k] seconds; FLOPs are time x 1e12."""
    tensors, ops = {}, []

    def T(shape, cat, dtype="float32"):
        t = Tensor(
            len(tensors),
            tuple(shape),
            dtype,
            float(math.prod(shape) * (8 if dtype == "int64" else F32)),
            cat,
        )
        tensors[t.id] = t
        return t.id

    def op(name, layer, phase, ins, outs, split=False, fwd=None):
        k = TIME_KEY(name)
        ops.append(
            Operator(
                len(ops),
                name,
                layer,
                phase,
                TIME[k],
                tuple(ins),
                tuple(outs),
                TIME[k] * 1e12,
                fwd_id=fwd,
                tp_split=split,
            )
        )
        return ops[-1].id

    def linear_bwd(fid, layer, x, w, dx_shape, head=False):
        g1 = T((b * s, tensors[w].shape[0]), "activation")
        op("ViewBackward0", layer, "backward", [x], [g1], fwd=fid)
        gw = T(tensors[w].shape, "gradient")
        g2 = T((b * s, dx_shape[-1]), "activation")
        op(
            "MmBackward0" if head else "AddmmBackward0",
            layer,
            "backward",
            [g1, w],
            [g2, gw],
            split=True,
            fwd=fid,
        )
        op("TBackward0", layer, "backward", [gw], [T(tensors[w].shape, "gradient")], fwd=fid)
        dx = T(dx_shape, "activation")
        op("ViewBackward0", layer, "backward", [g2], [dx], fwd=fid)
        return dx

    ids, targets = T((b, s), "input", "int64"), T((b, s), "input", "int64")
    w_tok, w_pos = T((V, h), "weight"), T((P, h), "weight")
    pos_ids = T((s,), "activation", "int64")
    f_arange = op("aten::arange", "", "forward", [], [pos_ids])
    e_tok = T((b, s, h), "activation")
    f_tok = op("aten::embedding", "tok", "forward", [w_tok, ids], [e_tok], split=True)
    e_pos = T((s, h), "activation")
    f_pos = op("aten::embedding", "pos", "forward", [w_pos, pos_ids], [e_pos], split=True)
    x = T((b, s, h), "activation")
    f_add0 = op("aten::add", "", "forward", [e_tok, e_pos], [x])
    blocks = []
    for i in range(L):
        rec = {}
        p = f"blocks.{i}"

        def ln(name, inp, rec=rec, p=p):
            w, bb, out = T((h,), "weight"), T((h,), "weight"), T((b, s, h), "activation")
            rec[name] = (op("aten::layer_norm", f"{p}.{name}", "forward", [inp, w, bb], [out]), inp)
            return out

        def linear(name, inp, d_in, d_out, rec=rec, p=p):
            w, bb, out = (
                T((d_out, d_in), "weight"),
                T((d_out,), "weight"),
                T((b, s, d_out), "activation"),
            )
            rec[name] = (
                op("aten::linear", f"{p}.{name}", "forward", [inp, w, bb], [out], split=True),
                inp,
                w,
            )
            return out

        x_in = x
        a = ln("ln1", x)
        q = linear("attn.qkv", a, h, 3 * h)
        y = T((b, s, h), "activation")
        rec["attn"] = (op("aten::scaled_dot_product_attention", f"{p}.attn", "forward", [q], [y]),)
        pr = linear("attn.proj", y, h, h)
        x1 = T((b, s, h), "activation")
        rec["add1"] = (op("aten::add", p, "forward", [x_in, pr], [x1]),)
        c = ln("ln2", x1)
        f = linear("mlp.fc1", c, h, 4 * h)
        g = T((b, s, 4 * h), "activation")
        rec["gelu"] = (op("aten::gelu", f"{p}.mlp", "forward", [f], [g]),)
        m = linear("mlp.fc2", g, 4 * h, h)
        x = T((b, s, h), "activation")
        rec["add2"] = (op("aten::add", p, "forward", [x1, m], [x]),)
        blocks.append(rec)
    w_f, b_f, z = T((h,), "weight"), T((h,), "weight"), T((b, s, h), "activation")
    f_lnf = op("aten::layer_norm", "ln_f", "forward", [x, w_f, b_f], [z])
    logits = T((b, s, V), "activation")
    f_head = op("aten::linear", "head", "forward", [z, w_tok], [logits], split=True)
    l2, t2 = T((b * s, V), "activation"), T((b * s,), "input", "int64")
    f_resh = op("aten::reshape", "loss", "forward", [logits], [l2])
    op("aten::reshape", "loss", "forward", [targets], [t2])
    loss = T((), "activation")
    f_ce = op("aten::cross_entropy_loss", "loss", "forward", [l2, t2], [loss])
    # backward, in reverse
    g = T((b * s, V), "activation")
    op("NllLossBackward0", "loss", "backward", [loss], [g], fwd=f_ce)
    g3 = T((b, s, V), "activation")
    op("ViewBackward0", "loss", "backward", [g], [g3], fwd=f_resh)
    dz = linear_bwd(f_head, "head", g3, w_tok, (b, s, h), head=True)
    dx = T((b, s, h), "activation")
    op(
        "NativeLayerNormBackward0",
        "ln_f",
        "backward",
        [dz, w_f],
        [dx, T((h,), "gradient")],
        fwd=f_lnf,
    )
    for i in reversed(range(L)):
        rec = blocks[i]
        p = f"blocks.{i}"
        op("AddBackward0", p, "backward", [dx], [], fwd=rec["add2"][0])
        fid, inp, w = rec["mlp.fc2"]
        dg = linear_bwd(fid, f"{p}.mlp.fc2", dx, w, tensors[inp].shape)
        df = T(tensors[inp].shape, "activation")
        op("GeluBackward0", f"{p}.mlp", "backward", [dg], [df], fwd=rec["gelu"][0])
        fid, inp, w = rec["mlp.fc1"]
        dc = linear_bwd(fid, f"{p}.mlp.fc1", df, w, tensors[inp].shape)
        fid_ln, _ = rec["ln2"]
        dx1 = T((b, s, h), "activation")
        op("NativeLayerNormBackward0", f"{p}.ln2", "backward", [dc], [dx1], fwd=fid_ln)
        op("AddBackward0", p, "backward", [dx1], [], fwd=rec["add1"][0])
        fid, inp, w = rec["attn.proj"]
        dy = linear_bwd(fid, f"{p}.attn.proj", dx1, w, tensors[inp].shape)
        dq = T((b, s, 3 * h), "activation")
        op(
            "ScaledDotProductAttentionBackward0",
            f"{p}.attn",
            "backward",
            [dy],
            [dq],
            fwd=rec["attn"][0],
        )
        fid, inp, w = rec["attn.qkv"]
        da = linear_bwd(fid, f"{p}.attn.qkv", dq, w, tensors[inp].shape)
        fid_ln, _ = rec["ln1"]
        dx = T((b, s, h), "activation")
        op("NativeLayerNormBackward0", f"{p}.ln1", "backward", [da], [dx], fwd=fid_ln)
    de = T((s, h), "activation")
    op("AddBackward0", "", "backward", [dx], [de], fwd=f_add0)
    op(
        "EmbeddingBackward0",
        "pos",
        "backward",
        [de, pos_ids],
        [T((P, h), "gradient")],
        split=True,
        fwd=f_pos,
    )
    op(
        "EmbeddingBackward0",
        "tok",
        "backward",
        [dx, ids],
        [T((V, h), "gradient")],
        split=True,
        fwd=f_tok,
    )
    weights = [t for t in tensors.values() if t.category == "weight"]
    op("aten::_foreach_add_", "optimizer", "optimizer", [w.id for w in weights], [])
    del f_arange
    return Trace(ops, tensors, {"batch_size": b}).validate()


TIME = {
    "embedding": 30e-6,
    "linear": 100e-6,
    "sdpa": 200e-6,
    "ln": 20e-6,
    "add": 10e-6,
    "gelu": 15e-6,
    "ce": 40e-6,
    "reshape": 5e-6,
    "arange": 5e-6,
    "bwd_split": 180e-6,
    "bwd_view": 4e-6,
    "bwd": 25e-6,
    "opt": 300e-6,
}


def TIME_KEY(name):
    if name.startswith("aten::"):
        kind = name[6:]
        return {
            "embedding": "embedding",
            "linear": "linear",
            "layer_norm": "ln",
            "add": "add",
            "gelu": "gelu",
            "cross_entropy_loss": "ce",
            "reshape": "reshape",
            "arange": "arange",
            "scaled_dot_product_attention": "sdpa",
            "_foreach_add_": "opt",
        }[kind]
    if name in ("AddmmBackward0", "MmBackward0", "EmbeddingBackward0"):
        return "bwd_split"
    if name in ("ViewBackward0", "TBackward0"):
        return "bwd_view"
    return "bwd"


# -- Megatron collectives ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_megatron_collectives_per_layer_on_a_small_transformer(n):
    L, b, s, h = 2, 4, 16, 32
    t = transformer_trace(L=L, b=b, s=s, h=h)
    c = comm(run(t, n))
    bsh, tokens = b * s * h * F32, b * s * F32
    fwd, bwd = c[c.phase == "forward"], c[c.phase == "backward"]
    assert (c.name == "allreduce").all()
    # forward: the word embedding's output, 2 per block (proj, fc2), the loss's 3 statistics
    assert sorted(fwd.nbytes) == sorted([bsh] + [bsh] * 2 * L + [tokens] * 3)
    assert list(fwd[fwd.nbytes == bsh].layer) == [
        "tok",
        *[f"blocks.{i}.{x}" for i in range(L) for x in ("attn.proj", "mlp.fc2")],
    ]
    assert (fwd[fwd.nbytes == tokens].layer == "loss").all()
    # backward: the head's input gradient, 2 per block (fc1, qkv), once per layer although
    # each linear's backward is four autograd operators; nothing for token ids or positions
    assert list(bwd.layer) == [
        "head",
        *[f"blocks.{i}.{x}" for i in reversed(range(L)) for x in ("mlp.fc1", "attn.qkv")],
    ]
    assert (bwd.nbytes == bsh).all()


def test_megatron_iteration_time_by_hand():
    n, bw = 4, 10 * GB
    L, b, s, h, V = 2, 4, 16, 32, 64
    t = transformer_trace(L=L, b=b, s=s, h=h, V=V)
    r = run(t, n, {"kind": "ring", "bandwidth": bw, "latency": 0.0})
    # compute per GPU: replicated operators whole; split layers' FLOPs and the operators
    # between column and row layers (attention, GELU) and from head to loss on 1/n; the
    # view/t autograd operators of a layer whole; optimizer on the held share of weights
    tm = TIME
    per_block_fwd = 2 * tm["ln"] + 2 * tm["add"] + (4 * tm["linear"] + tm["sdpa"] + tm["gelu"]) / n
    per_block_bwd = (
        2 * tm["bwd"]
        + 2 * tm["bwd"]  # 2 layer norms, 2 adds
        + (4 * tm["bwd_split"] + tm["bwd"] + tm["bwd"]) / n  # 4 addmm, sdpa, gelu
        + 4 * 3 * tm["bwd_view"]
    )
    fwd = (
        tm["arange"]
        + tm["embedding"] / n
        + tm["embedding"]
        + tm["add"]  # tok split, pos whole
        + L * per_block_fwd
        + tm["ln"]
        + tm["linear"] / n  # ln_f, head
        + (tm["reshape"] + tm["ce"]) / n
        + tm["reshape"]
    )  # logits on 1/n; targets whole
    bwd = (
        tm["bwd"] / n
        + tm["bwd_view"] / n  # NLL, view of the logits
        + tm["bwd_split"] / n
        + 3 * tm["bwd_view"]
        + tm["bwd"]  # head, ln_f
        + L * per_block_bwd
        + tm["bwd"]
        + tm["bwd_split"]
        + tm["bwd_split"] / n
    )  # add, pos, tok
    weights = {
        "tok": V * h,
        "pos": 32 * h,
        "ln": (2 * L + 1) * 2 * h,
        "qkv": 3 * h * h + 3 * h,
        "proj": h * h + h,
        "fc1": 4 * h * h + 4 * h,
        "fc2": 4 * h * h + h,
    }
    total = (
        weights["tok"]
        + weights["pos"]
        + weights["ln"]
        + L * sum(weights[k] for k in ("qkv", "proj", "fc1", "fc2"))
    )
    held = (
        weights["tok"] / n
        + weights["pos"]
        + weights["ln"]
        + L * ((weights["qkv"] + weights["fc1"]) / n + (h * h + 4 * h * h) / n + 2 * h)
    )
    compute = fwd + bwd + tm["opt"] * held / total
    bsh, tokens = b * s * h * F32, b * s * F32
    comm_time = (1 + 4 * L + 1) * ring_time("allreduce", bsh, n, bw) + 3 * ring_time(
        "allreduce", tokens, n, bw
    )
    assert r.per_gpu()["compute"].tolist() == pytest.approx([compute] * n, rel=1e-9)
    assert r.iteration_time == pytest.approx(compute + comm_time, rel=1e-9)


def test_megatron_on_the_real_gpt2_trace_moves_4_activations_per_block():
    t = load(ROOT / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz")  # 2 blocks, h 64, s 128
    for batch in (8, 16):
        c = comm(run(t, 4, batch_size=batch))
        bsh, tokens = batch * 128 * 64 * F32, batch * 128 * F32
        fwd, bwd = c[c.phase == "forward"], c[c.phase == "backward"]
        assert (c.name == "allreduce").all()
        assert sorted(fwd.nbytes) == sorted([tokens] * 3 + [bsh] * (1 + 2 * 2))
        assert sorted(bwd.nbytes) == [bsh] * (1 + 2 * 2)
        assert set(bwd.layer) == {
            "head",
            "blocks.0.attn.qkv",
            "blocks.0.mlp.fc1",
            "blocks.1.attn.qkv",
            "blocks.1.mlp.fc1",
        }
        assert not {"tok", "pos"} & set(bwd.layer)  # no gradient of ids or positions
        assert "pos" not in set(fwd.layer)  # position embeddings are replicated


def test_examples_tp_yaml_backward_allreduces_once_per_column_layer():
    s = Simulation(ROOT / "examples" / "tp.yaml")
    c = comm(s.run())
    # the defect: 19 backward all-reduces (4 per qkv and per fc1, plus ids and positions)
    assert (c.phase == "backward").sum() == 5 and (c.phase == "forward").sum() == 8


# -- sequence parallelism ------------------------------------------------------------------------
def test_sequence_parallel_collectives_and_bytes():
    n, L, b, s, h = 4, 2, 4, 16, 32
    t = transformer_trace(L=L, b=b, s=s, h=h)
    plain = comm(run(t, n))
    r = run(t, n, sequence_parallel=True)
    c = comm(r)
    bsh, tokens = b * s * h * F32, b * s * F32
    fwd, bwd = c[c.phase == "forward"], c[c.phase == "backward"]
    count = lambda d, name, nb: int(((d.name == name) & (d.nbytes == nb)).sum())  # noqa: E731
    # forward: per block 2 all-gathers (qkv, fc1 inputs) + 2 reduce-scatters (proj, fc2
    # outputs); the head all-gathers its input; the word embedding all-reduces (positions are
    # added before the scatter); the loss's 3 statistics
    assert count(fwd, "all_gather", bsh) == 2 * L + 1
    assert count(fwd, "reduce_scatter", bsh) == 2 * L
    assert count(fwd, "allreduce", bsh) == 1 and count(fwd, "allreduce", tokens) == 3
    assert len(fwd) == 2 * L + 1 + 2 * L + 1 + 3
    # backward: per block 2 output-gradient all-gathers (proj, fc2), 2 input re-gathers and
    # 2 input-gradient reduce-scatters (qkv, fc1); the head: re-gather + reduce-scatter; the
    # embedding's gradient all-gathered; then the LayerNorm weights and row biases all-reduced
    ln_and_row_bias = ((2 * L + 1) * 2 * h + L * 2 * h) * F32
    assert count(bwd, "all_gather", bsh) == 2 * L + 2 * L + 1 + 1
    assert count(bwd, "reduce_scatter", bsh) == 2 * L + 1
    assert count(bwd, "allreduce", ln_and_row_bias) == 1
    assert len(bwd) == 4 * L + 2 + 2 * L + 1 + 1
    # a block's forward bytes on the wire as without sequence parallelism (AR = RS + AG)
    wire = lambda d: sum(ring_time(o, nb, n, 1.0) for o, nb in zip(d.name, d.nbytes, strict=True))  # noqa: E731
    blocks = lambda d: d[(d.phase == "forward") & d.layer.str.startswith("blocks.")]  # noqa: E731
    assert wire(blocks(c)) == pytest.approx(wire(blocks(plain)), rel=1e-12)
    assert len(blocks(c)) == 2 * len(blocks(plain)) == 4 * L
    # LayerNorms and residual adds run on 1/n of the sequence
    tl = r.timeline[(r.timeline.gpu == 0) & (r.timeline.kind == "compute")]
    ln = tl[tl.name == "aten::layer_norm"]
    assert (ln.end - ln.start).tolist() == pytest.approx([TIME["ln"] / n] * (2 * L + 1), rel=1e-9)


# -- the paper's channel split -------------------------------------------------------------------
def test_channel_split_collectives_and_time_by_hand():
    n, bw = 4, 10 * GB
    f, bk, opt, act, layers = 1e-3, 2e-3, 0.5e-3, 1e6, 4
    t = chain_trace(layers=layers, t_fwd=f, t_bwd=bk, t_opt=opt, act_bytes=act, batch=8)
    r = run(t, n, {"kind": "ring", "bandwidth": bw, "latency": 0.0}, tp_style="channel")
    c = comm(r)
    # every layer all-gathers its output in forward and reduce-scatters its input gradient
    # in backward, except the first layer, whose input (the model's) has no gradient
    assert list(zip(c.phase, c.name, strict=True)) == (
        [("forward", "all_gather")] * layers + [("backward", "reduce_scatter")] * (layers - 1)
    )
    assert (c.nbytes == act).all()
    # every op of the chain is a split layer: compute = all / n (optimizer: every weight split)
    compute = (layers * (f + bk) + opt) / n
    comm_time = (2 * layers - 1) * ring_time("all_gather", act, n, bw)
    assert r.iteration_time == pytest.approx(compute + comm_time, rel=1e-9)


def test_channel_split_shards_backward_operators_after_the_first_layer_gradient():
    t = transformer_trace(L=1)
    r = run(t, 2, tp_style="channel")
    tl = r.timeline[(r.timeline.gpu == 0) & (r.timeline.kind == "compute")]
    bwd = tl[tl.phase == "backward"]
    # NLL backward comes before any layer's backward: whole; layer norm backward after: 1/2
    nll = bwd[bwd.name == "NllLossBackward0"]
    ln = bwd[bwd.name == "NativeLayerNormBackward0"]
    assert (nll.end - nll.start).tolist() == pytest.approx([TIME["bwd"]])
    assert (ln.end - ln.start).tolist() == pytest.approx([TIME["bwd"] / 2] * 3)
    fwd = tl[(tl.phase == "forward") & (tl.name == "aten::layer_norm")]
    assert (fwd.end - fwd.start).tolist() == pytest.approx([TIME["ln"]] * 3)  # replicated


def test_tp_options_are_validated():
    t = chain_trace()
    with pytest.raises(ConfigError, match="parallelism.tp_style.*megatron, channel"):
        run(t, 2, tp_style="rows")
    with pytest.raises(ConfigError, match="parallelism.sequence_parallel"):
        run(t, 2, tp_style="channel", sequence_parallel=True)


def test_no_collective_for_a_gradient_that_does_not_exist():
    # four linears on the model's input: pairs (0, 1) and (2, 3); layer 0's input gradient is
    # never computed, so only layer 2's is all-reduced in backward
    t = chain_trace(layers=4, batch=8)
    c = comm(run(t, 2))
    assert list(zip(c.phase, c.layer, strict=True)) == [
        ("forward", "layer1"),
        ("forward", "layer3"),
        ("backward", "layer2"),
    ]


@pytest.mark.skipif(not GO_TRACES.exists(), reason="shared/reference traces absent")
def test_vgg13_megatron_within_5_percent_of_the_hand_calculation():
    # the hand calculation for the H100 VGG-13 trace (65 GB/s ring, no latency):
    # compute = replicated + split / N; 5 conv pairs + the classifier pair all-reduce their
    # activations (the first column layer's input is the image: nothing in backward)
    from triosim.trace.go_csv import import_triosim_csv

    t = import_triosim_csv(GO_TRACES / "vgg13")
    ring = {"kind": "ring", "bandwidth": "65 GB/s", "latency": 0}
    for n, want_ms in ((2, 117.5), (4, 129.3), (8, 135.1)):
        r = run(t, n, ring)
        assert r.iteration_time * 1e3 == pytest.approx(want_ms, rel=0.05)
        # a missing flatten: the classifier's input is made by no traced operator, yet has a
        # gradient (it is an activation, not the model's input): all-reduced in backward
        assert "op28" in set(comm(r)[lambda d: d.phase == "backward"].layer)


# -- Llama traces at every precision, and Megatron's degree rules ----------------------------------
MODELLED = ROOT / "traces" / "modelled"


def _tp_plan(trace_path, n, **extra):
    cfg = {
        "trace": str(trace_path),
        "num_gpus": n,
        "batch_size": 8,
        "gpu": "H100-SXM",
        "perfmodel": {"kind": "calibrated"},
        "parallelism": {"mode": "tp"},
        "topology": {"kind": "switch", "bandwidth": "450 GB/s"},
        **extra,
    }
    return Simulation(cfg).extrapolator.tpx  # the TP plan of mode tp (the mesh's tp dimension)


def _collectives(ex):
    out: dict = {}
    for where in (ex.before, ex.after):
        for tasks in where.values():
            for c in tasks:
                out[c.op, c.nbytes, c.phase] = out.get((c.op, c.nbytes, c.phase), 0) + 1
    return out


@pytest.mark.filterwarnings("ignore")
def test_tp_follows_a_weight_through_its_casts_on_torchtitan_precision_llama():
    """The shipped Llama 3 8B traces (2 of 32 layers traced and replicated, batch 8 x 2048
    tokens, bf16 compute): torchtitan's (float32 weights cast to bfloat16 where used: each
    linear reads the cast, which TP refused) and Megatron's (bfloat16 weights). Both split
    alike. By hand (Megatron, per layer 2 all-reduces forward after wo and w2, 2 backward for
    the inputs of Q/K/V and of gate/up; the word embedding 1 forward, the head 1 backward;
    b.s.h = 8 x 2048 x 4096 x 2 bytes; the loss 3 x 4.b.s)."""
    titan = _tp_plan(MODELLED / "h100-sxm" / "llama3-8b-s2048-b8.trace.json.gz", 8)
    megatron = _tp_plan(MODELLED / "h100-sxm" / "llama3-8b-bf16-s2048-b8.trace.json.gz", 8)
    bsh = 8 * 2048 * 4096 * 2
    want = {
        ("allreduce", bsh, "forward"): 2 * 32 + 1,
        ("allreduce", bsh, "backward"): 2 * 32 + 1,
        ("allreduce", 4 * 8 * 2048, "forward"): 3,
    }
    assert _collectives(titan) == want
    assert _collectives(megatron) == want
    assert titan.optimizer_fraction() == pytest.approx(megatron.optimizer_fraction(), rel=1e-12)
    T = titan.trace.tensors
    assert {T[t].category for t in titan.sharded_weights()} == {"weight"}  # the parameters
    casts = [
        op
        for op in titan.ops("forward")
        if op.name == "aten::to" and T[op.inputs[0]].name == "layers.0.attention.wq.weight"
    ]
    assert casts and titan.roles[casts[0].id] == "sharded"  # each GPU casts its shard


@pytest.mark.no_cover
@pytest.mark.filterwarnings("ignore")
def test_sequence_parallel_reduces_the_norm_weights_only_on_torchtitan_precision_llama():
    """Sequence parallelism all-reduces the gradients of the weights that saw part of the
    sequence: Llama 3 8B's RMSNorm weights (2 per layer x 32 + the final one, 4,096 each),
    in the weights' dtype (float32 in torchtitan's trace, bfloat16 in Megatron's). The
    float32 weights' bfloat16 casts are not sequence-parallel operators: each GPU casts the
    weights it holds (before: 30 GB, every weight's gradient, all-reduced)."""
    path = MODELLED / "h100-sxm" / "llama3-8b-s2048-b8.trace.json.gz"
    sp = {"parallelism": {"mode": "tp", "sequence_parallel": True}}
    for trace, size in ((path, 4), (path.with_name("llama3-8b-bf16-s2048-b8.trace.json.gz"), 2)):
        ex = _tp_plan(trace, 8, **sp)
        grads = [c for cs in ex.before.values() for c in cs if c.key.endswith("sequence-grads")]
        assert [c.nbytes for c in grads] == [(2 * 32 + 1) * 4096 * size]


@pytest.mark.filterwarnings("ignore")
def test_the_degree_must_divide_the_attention_and_key_value_heads():
    """Megatron-LM asserts num_attention_heads % tp == 0 and num_query_groups % tp == 0.
    GPT-2 small has 12 heads (its QKV's 2,304 outputs divide by 8, so only the heads
    refuse 8); Llama 3 8B 32 query heads in 8 key/value groups."""
    gpt2 = MODELLED / "a100-80gb" / "gpt2-s512-b8.trace.json.gz"
    llama = MODELLED / "h100-sxm" / "llama3-8b-s2048-b8.trace.json.gz"
    assert _tp_plan(gpt2, 4, gpu="A100-80GB").roles  # 12 % 4 == 0
    with pytest.raises(ConfigError, match=r"'num_gpus' = 8 .*12 attention heads"):
        _tp_plan(gpt2, 8, gpu="A100-80GB")
    with pytest.raises(ConfigError, match=r"'num_gpus' = 16 .*8 key/value heads.*32 query"):
        _tp_plan(llama, 16)
    three_d = {"parallelism": {"mode": "3d", "dp": 1, "tp": 16, "pp": 1}}
    with pytest.raises(ConfigError, match=r"'parallelism.tp' = 16 .*8 key/value heads"):
        _tp_plan(llama, 16, **three_d)
    hybrid = {"parallelism": {"mode": "hybrid", "dp": 2, "inner": "tp"}}
    with pytest.raises(ConfigError, match=r"'parallelism.dp' = 2 .*16 GPUs.*8 key/value"):
        _tp_plan(llama, 32, **hybrid)


def test_tp_comm_overlap_runs_each_collective_beside_its_operator():
    """Megatron's --tp-comm-overlap (mesh `tp_comm_overlap`): a TP all-gather or
    reduce-scatter beside a linear layer runs while the layer's product does: on GPU 0
    each such collective starts at its operator's start,
    and the operator after the layer's product starts at the later of the two ends (a
    layer's backward collectives start at its first backward operator). The same collectives
    move the same bytes; the iteration is shorter, and no shorter than its compute."""
    t = transformer_trace()
    base = {"mode": "mesh", "tp": 4, "sequence_parallel": True}
    slow = {"kind": "ring", "bandwidth": 0.1 * GB, "latency": 0.0}  # collectives > products
    plain = run(t, 4, slow, **base)
    r = run(t, 4, slow, **base, tp_comm_overlap=True)
    tl = r.timeline[r.timeline.gpu == 0]
    side = tl[tl.stream == "tp"]
    compute = tl[tl.kind == "compute"].sort_values("start").reset_index(drop=True)
    assert len(side) > 0
    for row in side[side.kind == "comm"].itertuples():
        mine = compute[(compute.layer == row.layer) & (compute.phase == row.phase)]
        assert ((mine.start - row.start).abs() <= 1e-15).any()  # started with its layer's op
        later = mine[mine.start >= row.start - 1e-15]
        product = later.loc[(later.end - later.start).idxmax()]  # the layer's product
        nxt = compute[compute.start >= product.end - 1e-15]
        nxt = nxt[nxt.index != product.name]
        if len(nxt):  # what follows the product waits for the collective too
            assert nxt.start.min() >= max(product.end, row.end) - 1e-15

    def moved(res):
        x = res.timeline[(res.timeline.gpu == 0) & (res.timeline.kind == "comm")]
        return sorted(zip(x.name, x.nbytes, strict=True))

    assert moved(r) == moved(plain)
    assert r.per_gpu()["compute"].iloc[0] <= r.iteration_time < plain.iteration_time
