"""Shape-only tracing: the model runs on meta tensors (no memory, no compute) and the trace
has what a real trace of it has: the same operators, layers, phases, pairing, tensors and
FLOPs. Compared against a real CPU trace of the same small model, made here."""

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from tracer import collect  # noqa: E402
from tracer.models import build  # noqa: E402
from triosim.errors import TracerError  # noqa: E402


def trace_of(name, shapes_only, batch=2, **kw):
    torch.manual_seed(0)
    with torch.device("meta" if shapes_only else "cpu"):
        model, make_batch, loss = build(name, small=True, image_size=32, seq_len=16, **kw)
    opt = torch.optim.Adam(model.parameters(), foreach=False)  # the CPU's default
    return collect(model, make_batch, loss, opt, batch_size=batch, warmup=1, measure=1,
                   model_name=name, shapes_only=shapes_only)  # fmt: skip


@pytest.fixture(scope="module")
def gpt2_pair():
    return trace_of("gpt2", False), trace_of("gpt2", True)


def _tensors(t, ids):
    return [(t.tensors[i].shape, t.tensors[i].dtype, t.tensors[i].category, t.tensors[i].name)
            for i in ids]  # fmt: skip


def test_shape_only_trace_has_the_real_traces_operators_pairing_and_flops(gpt2_pair):
    real, shapes = gpt2_pair
    assert len(real.operators) == len(shapes.operators) > 300
    pos_r = {o.id: k for k, o in enumerate(real.operators)}
    pos_s = {o.id: k for k, o in enumerate(shapes.operators)}
    for a, b in zip(real.operators, shapes.operators, strict=True):
        assert (a.name, a.layer, a.phase, a.tp_split) == (b.name, b.layer, b.phase, b.tp_split)
        assert pos_r.get(a.fwd_id) == pos_s.get(b.fwd_id), a.name  # the same pairing
        assert a.flops == b.flops, a.name
    st = Counter(o.phase for o in shapes.operators)
    assert st["backward"] > 80 and st["optimizer"] > 100
    paired = [o for o in shapes.operators if o.fwd_id is not None]
    assert len(paired) > 50
    # attention ran the CPU's fused kernel, as in the real run, not the meta device's math
    assert "aten::scaled_dot_product_attention" in {o.name for o in shapes.operators}
    assert not any("Bmm" in o.name for o in shapes.operators)


def test_shape_only_trace_has_the_real_traces_tensors(gpt2_pair):
    real, shapes = gpt2_pair
    for a, b in zip(real.operators, shapes.operators, strict=True):
        if a.phase != "backward":  # forward and optimizer operators: every tensor
            assert _tensors(real, a.inputs) == _tensors(shapes, b.inputs), a.name
            assert _tensors(real, a.outputs) == _tensors(shapes, b.outputs), a.name
        else:  # backward: the weights read and gradients written (CPU kernels' own
            # temporaries, which a meta run does not make, may differ)
            def fixed(t, ids):
                return sorted(x for x in _tensors(t, ids) if x[2] in ("weight", "gradient"))

            assert fixed(real, a.inputs + a.outputs) == fixed(shapes, b.inputs + b.outputs)
    cats = ("input", "weight", "gradient", "optimizer_state", "buffer")
    for c in cats:
        want = Counter((t.shape, t.dtype, t.name) for t in real.tensors.values() if t.category == c)
        got = Counter(
            (t.shape, t.dtype, t.name) for t in shapes.tensors.values() if t.category == c
        )
        assert want == got, c
    # every parameter, gradient and Adam state is there, by name
    names = {t.name for t in shapes.tensors.values() if t.category == "weight"}
    assert "blocks.0.attn.qkv.weight" in names and "tok.weight" in names
    assert {f"tok.weight.{s}" for s in ("exp_avg", "exp_avg_sq", "step")} <= {
        t.name for t in shapes.tensors.values() if t.category == "optimizer_state"
    }


def test_shape_only_trace_computes_nothing_and_says_so(gpt2_pair):
    _, shapes = gpt2_pair
    assert all(o.time == 0.0 for o in shapes.operators)
    m = shapes.metadata
    assert m["shapes_only"] is True and m["device"] == "meta"
    assert m["measured_iteration_time"] is None and "performance model" in m["time_source"]
    assert m["parameters"] == sum(t.shape[0] * (t.shape[1] if len(t.shape) > 1 else 1)
                                  for t in shapes.tensors.values() if t.category == "weight")  # fmt: skip


def small_cnn():
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))  # fmt: skip

    def make_batch(b, device):
        return torch.randn(b, 3, 8, 8, device=device), torch.randint(0, 5, (b,), device=device)

    return model, make_batch, torch.nn.functional.cross_entropy


def test_shape_only_cnn_matches_and_convolutions_are_tf32():
    traces = []
    for shapes_only in (False, True):
        with torch.device("meta" if shapes_only else "cpu"):
            model, make_batch, loss = small_cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        traces.append(collect(model, make_batch, loss, opt, batch_size=2, warmup=1, measure=1,
                              shapes_only=shapes_only))  # fmt: skip
    real, shapes = traces
    assert [o.name for o in real.operators] == [o.name for o in shapes.operators]
    assert [o.flops for o in real.operators] == [o.flops for o in shapes.operators]
    conv = next(o for o in shapes.operators if o.name == "aten::conv2d")
    assert conv.flops == 2 * 2 * 4 * 3 * 3 * 3 * 8 * 8  # 2 N Cout Cin kh kw H W
    # batch-norm running statistics are buffers, not activations; momentum buffers are states
    cat = {t.name: t.category for t in shapes.tensors.values() if t.name}
    assert cat["1.running_mean"] == cat["1.running_var"] == "buffer"
    assert cat["0.weight.momentum_buffer"] == "optimizer_state"
    # a real CPU trace records float32; the shape-only trace is for a GPU, where cuDNN runs
    # float32 convolutions in TF32 by default (and matrix products in float32)
    assert conv.math == "tf32" and {o.math for o in real.operators if o.name == "aten::conv2d"} == {
        "float32"
    }
    assert next(o for o in shapes.operators if o.name == "aten::linear").math == "float32"


def test_shape_only_needs_meta_parameters():
    model, make_batch, loss = build("gpt2", small=True, seq_len=8)
    with pytest.raises(TracerError, match="meta device"):
        collect(model, make_batch, loss, torch.optim.Adam(model.parameters()), batch_size=2,
                shapes_only=True)  # fmt: skip
