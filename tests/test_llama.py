"""Llama-3-style models (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, bf16
compute with fp32 master weights) and extrapolating a trace of k layers to L layers."""

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from perfmodel.modelled import model_times  # noqa: E402
from tracer import collect  # noqa: E402
from tracer.layers import replicate  # noqa: E402
from tracer.models import LLAMA, build  # noqa: E402
from triosim.common.errors import TracerError  # noqa: E402

# Published parameter counts: Llama 3 8B "8.03B", Llama 3 70B "70.6B", Llama 3.2 1B "1.24B"
# (Meta's model cards), i.e. 8,030,261,248, 70,553,706,496 and 1,235,814,400 from the configs;
# Llama 3.1 405B's config (16,384 wide, 126 layers, FFN 53,248) gives 405,853,388,800.
PUBLISHED = {
    "llama3-8b": (8.03e9, 8_030_261_248),
    "llama3-70b": (70.6e9, 70_553_706_496),
    "llama3.2-1b": (1.24e9, 1_235_814_400),
    "llama3.1-405b": (405.9e9, 405_853_388_800),  # Meta: "405B"; its config: 405.85 B
    "llama2-7b": (6.74e9, 6_738_415_616),  # Meta: "7B"; Hugging Face's card: 6.74 B
}


def hand_count(dim, layers, heads, kv_heads, ffn, vocab, tied):
    hd = dim // heads
    attention = dim * heads * hd + 2 * dim * kv_heads * hd + heads * hd * dim
    per_layer = attention + 3 * dim * ffn + 2 * dim  # wq wk wv wo, w1 w2 w3, two RMSNorms
    return vocab * dim * (1 if tied else 2) + layers * per_layer + dim  # + the final norm


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_the_published_one(name):
    with torch.device("meta"):  # no memory: 70B parameters would need 282 GB
        model, _, _ = build(name)
    n = sum(p.numel() for p in model.parameters())
    rounded, exact = PUBLISHED[name]
    assert n == exact == hand_count(**LLAMA[name])
    assert round(n / 1e9, 2 if n < 1e10 else 1) == pytest.approx(rounded / 1e9)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights


def small_trace(layers, foreach=True):
    torch.manual_seed(0)
    with torch.device("meta"):
        model, make_batch, loss = build("llama3-8b", small=True, seq_len=16, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    return collect(
        model,
        make_batch,
        loss,
        opt,
        batch_size=2,
        warmup=1,
        measure=1,
        model_name="llama-small",
        shapes_only=True,
    )


def describe(t):
    """Everything but ids: per operator its name, layer, phase, FLOPs, forward partner (by
    position), tensors (shape, dtype, category, name) and producers (by position)."""
    pos = {o.id: k for k, o in enumerate(t.operators)}
    made = {}
    for k, o in enumerate(t.operators):
        for x in o.outputs:
            if x not in o.inputs:
                made.setdefault(x, k)

    def ts(ids):
        return tuple(
            (
                t.tensors[i].shape,
                t.tensors[i].dtype,
                t.tensors[i].category,
                t.tensors[i].name,
                made.get(i),
            )
            for i in ids
        )

    return [
        (o.name, o.layer, o.phase, o.flops, pos.get(o.fwd_id), ts(o.inputs), ts(o.outputs))
        for o in t.operators
    ]


@pytest.fixture(scope="module")
def two_and_six():
    return small_trace(2), small_trace(6)


def test_two_layers_replicated_to_six_are_a_six_layer_trace(two_and_six):
    two, six = two_and_six
    rep = replicate(two, "layers", 2, 6)
    assert describe(rep) == describe(six)  # operators, pairing, FLOPs, tensors, data flow
    assert rep.weight_bytes() == six.weight_bytes()
    assert rep.metadata["parameters"] == six.metadata["parameters"]
    assert rep.metadata["layers"]["total"] == 6


@pytest.mark.no_cover
def test_replication_has_l_over_k_times_the_per_layer_operators_at_the_same_times(two_and_six):
    two, _ = two_and_six
    timed = model_times(small_trace(2), "H100-SXM")
    rep = model_times(replicate(two, "layers", 2, 6), "H100-SXM")

    def per_layer(t):
        out = {}
        for o in t.operators:
            if o.layer.startswith("layers."):
                i = int(o.layer.split(".")[1])
                out.setdefault(i, []).append((o.name, o.phase, o.time))
        return out

    a, b = per_layer(timed), per_layer(rep)
    assert sorted(a) == [0, 1] and sorted(b) == list(range(6))
    assert sum(len(v) for v in b.values()) == 3 * sum(len(v) for v in a.values())
    for i in range(6):  # each layer: layer i % 2's operators, at the same modelled times
        assert b[i] == a[i % 2]

    def once(t):  # embedding, head, loss and the foreach optimizer steps: once
        return Counter(
            o.name
            for o in t.operators
            if not o.layer.startswith("layers.")
            and (o.phase != "optimizer" or "_foreach_" in o.name)
        )

    assert once(rep) == once(timed) and sum(once(rep).values()) > 20
    # the optimizer reads each step counter on the host once per parameter: 3x the layers'
    items = [o for o in rep.operators if o.name == "aten::item"]
    assert len(items) == 2 * (3 + 3 * 2 * 9)  # twice per parameter: 3 outside, 9 per layer
    # the foreach optimizer steps: 3x the layers' parameters in their lists
    n_two = sum(1 for t in two.tensors.values() if t.category == "weight")
    n_rep = sum(1 for t in rep.tensors.values() if t.category == "weight")
    assert n_rep - 3 == 3 * (n_two - 3)  # embedding, final norm and head are not in a layer


@pytest.mark.no_cover
def test_for_loop_optimizer_replicates_too():
    rep = replicate(small_trace(2, foreach=False), "layers", 2, 4)
    assert describe(rep) == describe(small_trace(4, foreach=False))


def test_replication_refuses_what_it_cannot_do(two_and_six):
    two, _ = two_and_six
    with pytest.raises(TracerError, match="multiple"):
        replicate(two, "layers", 2, 5)
    with pytest.raises(TracerError, match="expected 0..2"):
        replicate(two, "layers", 3, 6)


def test_mixed_precision_as_torchtitan(two_and_six):
    two, _ = two_and_six
    lin = [o for o in two.operators if o.name == "aten::linear"]
    assert lin and {o.math for o in lin} == {"bfloat16"}
    assert {t.dtype for t in two.tensors.values() if t.category == "weight"} == {"float32"}
    states = [t for t in two.tensors.values() if t.category == "optimizer_state" and t.shape]
    assert states and {t.dtype for t in states} == {"float32"}
    # each weight is cast to bf16 where it is used: a fixed-size buffer, not an activation
    casts = [
        o
        for o in two.operators
        if o.name == "aten::to"
        and o.phase == "forward"
        and two.tensors[o.inputs[0]].category == "weight"
    ]
    assert casts and all(two.tensors[o.outputs[0]].category == "buffer" for o in casts)
    assert {two.tensors[o.outputs[0]].name for o in casts} >= {
        "layers.0.attention.wq.weight.bfloat16",
        "tok_embeddings.weight.bfloat16",
    }
    assert {"aten::scaled_dot_product_attention", "aten::rms_norm", "aten::silu"} <= {
        o.name for o in two.operators
    }
    assert two.metadata["optimizer"] == "AdamW"


def test_master_weights_are_made_on_the_device_the_model_runs_on(monkeypatch):
    """trace_model builds the model on CPU; the optimizer must be made after the model is on
    its device, or MasterWeightAdamW's float32 master copies stay on CPU (on CUDA its step
    failed: 'attempting to assign a gradient with device type cuda to a tensor with device
    type cpu'). 'meta' stands in for the GPU; collect is replaced by a spy."""
    import importlib

    from tracer.cli import trace_model

    seen = {}

    def spy(model, make_batch, loss_fn, opt, **run):
        seen["params"] = {p.device for p in model.parameters()}
        seen["masters"] = {m.device for m in opt.masters}
        seen["optimized"] = {p.device for p in opt.params}

    monkeypatch.setattr(importlib.import_module("tracer.collect"), "collect", spy)
    trace_model("llama3-8b", 1, device="meta", small=True, seq_len=8, master_weights=True)
    meta = {torch.device("meta")}
    assert seen == {"params": meta, "masters": meta, "optimized": meta}


def test_layers_replicate_when_the_block_accumulates_its_gradient_in_place():
    """GPT-2 --small --layers 1 on CPU (and llama3-8b --layers 2 on CUDA, by its ET: an
    in-place add_ of the fused RMSNorm backward's result into the incoming gradient): the
    block's input gradient is the buffer it received, added into in place, so the traced
    layers 'read 1 gradient tensor from outside and pass on 0'. Replication must not depend
    on it: the copies share that buffer."""
    from tracer.cli import trace_model

    t = trace_model("gpt2", 2, small=True, seq_len=16, layers=1, warmup=1, measure=1)
    layers = {o.layer.split(".")[1] for o in t.operators if o.layer.startswith("blocks.")}
    assert layers == {"0", "1"}
    per_layer = Counter(o.layer.split(".")[1] for o in t.operators if o.layer.startswith("blocks."))
    assert per_layer["0"] == per_layer["1"] > 0


def storage_partition(t):
    """Which tensor occurrences share a storage, without ids: per operator (by position)
    and per input/output slot, the number of the storage (numbered by first occurrence;
    None for a tensor without one)."""
    number: dict = {}

    def n(i):
        s = t.tensors[i].storage
        return None if s is None else number.setdefault(s, len(number))

    return [(tuple(n(i) for i in o.inputs), tuple(n(i) for i in o.outputs)) for o in t.operators]


def first_read_in_backward(t, layer):
    """Bytes of the batch-scaled storages `layer`'s backward operators read before any
    operator wrote them (a backward operator's own output excluded): what autograd saved
    inside the layer's forward operators, which the memory model gives birth at them."""
    tensors, seen, out = t.tensors, set(), 0

    def key(i):
        return ("s", tensors[i].storage) if tensors[i].storage is not None else ("t", i)

    for o in t.operators:
        for i in o.inputs:
            if tensors[i].scales_with_batch and key(i) not in seen:
                if o.phase == "backward" and o.layer == layer and i not in o.outputs:
                    out += tensors[i].nbytes
                seen.add(key(i))
        seen.update(key(i) for i in o.outputs if tensors[i].scales_with_batch)
    return out


def test_replicated_layers_share_storages_as_traced_layers_do(two_and_six):
    """A copy of the traced layers shares storage where they do (tracer.layer_storage): a
    saved tensor autograd unpacks in backward under a new id is its forward tensor's
    storage, a view its base's. Without, each such tensor of a copy was one more allocation
    born at its forward operator: the shipped Llama 3 8B 128K trace held 1464.4 GB on one
    GPU instead of the fully traced model's."""
    two, six = two_and_six
    rep = replicate(two, "layers", 2, 6)
    assert storage_partition(rep) == storage_partition(six)
    # By hand, per RMSNorm at batch 2, 16 tokens, dim 64: on meta and CPU rms_norm is
    # aten's rms_norm_composite (the fused kernel is CUDA's), whose backward reads what
    # autograd saved inside it: x.float() (pow's and mul's self: a float32 copy of the
    # bfloat16 x, memory of its own though `aten::to` may alias), the normalized
    # x * rsqrt (float32, the weight mul's self) and rsqrt (float32, one per token:
    # rsqrt's result and mul's other, one storage). Read first in backward: x.float()
    # and the normalized 2 x 2 * 16 * 64 * 4 = 16,384 B and rsqrt 2 * 16 * 4 = 128 B.
    # (Before the copies had storages, theirs counted rsqrt twice; before a cast had
    # memory of its own, x.float() was x's storage and not counted.)
    per_norm = 2 * (2 * 16 * 64 * 4) + 2 * 16 * 4
    for i in range(6):
        for norm in ("attention_norm", "ffn_norm"):
            assert first_read_in_backward(rep, f"layers.{i}.{norm}") == per_norm
    from triosim.simulation.wiring import Simulation

    def peak(t):
        cfg = {"num_gpus": 1, "batch_size": 2, "parallelism": {"mode": "single"}}
        return Simulation(cfg, trace=model_times(t, "H100-SXM")).run().peak_memory[0]

    assert peak(rep) == peak(six)
