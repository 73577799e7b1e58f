"""The TrioSim CSV importer adds what the CSV lacks: forward/backward pairing (fwd_id),
FLOPs from the recorded shapes and a math mode; trace_stats / fidelity_warnings say how
much of it a trace carries. Every expected number is worked out by hand in the test."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from extrapolators.modes.base import gradient_ready
from triosim.common.errors import ConfigError
from triosim.trace import flops
from triosim.trace.go_csv import import_triosim_csv
from triosim.trace.model import fidelity_warnings, load, save, trace_stats


def go_traces() -> Path | None:
    """shared/reference/triosim-go-traces: $TRIOSIM_SHARED, <repo>/shared, <repo>/../shared."""
    repo = Path(__file__).resolve().parents[1]
    env = os.environ.get("TRIOSIM_SHARED")
    for shared in ([Path(env)] if env else []) + [repo / "shared", repo.parent / "shared"]:
        p = shared / "reference" / "triosim-go-traces"
        if p.is_dir():
            return p
    return None


GO = go_traces()
needs_go = pytest.mark.skipif(
    GO is None,
    reason="shared/reference/triosim-go-traces absent (set TRIOSIM_SHARED to the shared folder)",
)

# A small network in the original CSV format, batch 2:
#   conv1 (3->4, 3x3, bias) -> relu_ -> conv2 (4->4, 3x3) and conv3 (4->4, 1x1) both on the
#   relu output -> add_ -> max_pool2d 2x2 -> linear (64->5) -> cross_entropy_loss.
# Backward as the Go tracer writes it: the residual add has no row; AddmmBackward0 reads only
# the transposed view (id 20) of the linear weight (id 11), which shares its storage (111);
# conv2's backward (weight 5) runs BEFORE conv3's (weight 7), so "the latest forward conv"
# would pair it wrongly; conv1's input gradient is the undefined tensor 0 (no elements).
TRACE = """OperatorID,OperatorName,Operator_input,Operator_output,Operator_cudatime,Operator_cudatimenooverlap,InputSize,OutputSize,gpuid,stage,tpflag
1,aten::conv2d,[1; 2; 3],[4],10,10,[],[],0,forward,1
2,aten::relu_,[4],[4],5,5,[],[],0,forward,0
3,aten::conv2d,[4; 5],[6],20,20,[],[],0,forward,1
4,aten::conv2d,[4; 7],[8],8,8,[],[],0,forward,1
5,aten::add_,[6; 8],[6],3,3,[],[],0,forward,0
6,aten::max_pool2d,[6],[9],4,4,[],[],0,forward,0
7,aten::linear,[10; 11; 12],[13],6,6,[],[],0,forward,1
8,aten::cross_entropy_loss,[13; 14],[15],2,2,[],[],0,forward,0
9,aten::ones_like,[15],[16],1,1,[],[],0,forward,0
10,autograd::engine::evaluate_function: NllLossBackward0,[16; 13; 14],[17],2,2,[],[],0,backward,0
11,autograd::engine::evaluate_function: LogSoftmaxBackward0,[17; 18],[19],2,2,[],[],0,backward,0
12,autograd::engine::evaluate_function: AddmmBackward0,[20],[21],9,9,[],[],0,backward,1
13,autograd::engine::evaluate_function: MaxPool2DWithIndicesBackward0,[22; 6; 23],[24],4,4,[],[],0,backward,0
14,autograd::engine::evaluate_function: ConvolutionBackward0,[24; 4; 5],[25; 26],30,30,[],[],0,backward,1
15,autograd::engine::evaluate_function: ConvolutionBackward0,[24; 4; 7],[27; 28],12,12,[],[],0,backward,1
16,autograd::engine::evaluate_function: ReluBackward0,[29; 30],[31],5,5,[],[],0,backward,0
17,autograd::engine::evaluate_function: ConvolutionBackward0,[31; 1; 2],[0; 32; 33],11,11,[],[],0,backward,1
18,aten::_foreach_add_,[2; 3; 5; 7; 11; 12; 32; 33; 26; 28; 34; 35],[],7,7,[],[],0,optimizer,0
"""
_TENSORS = [  # id, shape, elements, bytes each, type, storage
    (0, "[]", 0, 0, "weight", 0),
    (1, "[2, 3, 8, 8]", 384, 4, "input", 101),
    (2, "[4, 3, 3, 3]", 108, 4, "weight", 102),
    (3, "[4]", 4, 4, "bias", 103),
    (4, "[2, 4, 8, 8]", 512, 4, "output", 104),
    (5, "[4, 4, 3, 3]", 144, 4, "weight", 105),
    (6, "[2, 4, 8, 8]", 512, 4, "output", 106),
    (7, "[4, 4, 1, 1]", 16, 4, "weight", 107),
    (8, "[2, 4, 8, 8]", 512, 4, "output", 108),
    (9, "[2, 4, 4, 4]", 128, 4, "output", 109),
    (10, "[2, 64]", 128, 4, "input", 109),
    (11, "[5, 64]", 320, 4, "weight", 111),
    (12, "[5]", 5, 4, "bias", 112),
    (13, "[2, 5]", 10, 4, "output", 113),
    (14, "[2]", 2, 8, "target", 114),
    (15, "[]", 1, 4, "output", 115),
    (16, "[]", 1, 4, "output", 116),
    (17, "[2, 5]", 10, 4, "output", 117),
    (18, "[2, 5]", 10, 4, "result", 118),
    (19, "[2, 5]", 10, 4, "output", 119),
    (20, "[64, 5]", 320, 4, "input", 111),
    (21, "[2, 64]", 128, 4, "output", 121),
    (22, "[2, 4, 4, 4]", 128, 4, "grad_output", 122),
    (23, "[2, 4, 4, 4]", 128, 8, "indices", 123),
    (24, "[2, 4, 8, 8]", 512, 4, "output", 124),
    (25, "[2, 4, 8, 8]", 512, 4, "output", 125),
    (26, "[4, 4, 3, 3]", 144, 4, "output", 126),
    (27, "[2, 4, 8, 8]", 512, 4, "output", 127),
    (28, "[4, 4, 1, 1]", 16, 4, "output", 128),
    (29, "[2, 4, 8, 8]", 512, 4, "input", 129),
    (30, "[2, 4, 8, 8]", 512, 4, "result", 104),
    (31, "[2, 4, 8, 8]", 512, 4, "output", 131),
    (32, "[4, 3, 3, 3]", 108, 4, "output", 132),
    (33, "[4]", 4, 4, "output", 133),
    (34, "[5, 64]", 320, 4, "output", 134),
    (35, "[5]", 5, 4, "output", 135),
]
TENSOR = (
    "Index,TensorID,TensorShape,TensorNumElement,TensorEachByte,TensorType,TensorStorgeid,gpuid\n"
    + "".join(
        f'{i},{t},"{s}",{n},{b},{k},{st},0\n' for i, (t, s, n, b, k, st) in enumerate(_TENSORS)
    )
)


@pytest.fixture
def small(tmp_path):
    (tmp_path / "trace.csv").write_text(TRACE)
    (tmp_path / "tensor.csv").write_text(TENSOR)
    return tmp_path


def test_backward_ops_are_paired_with_their_forward_op(small):
    t = import_triosim_csv(small)
    got = {o.id: o.fwd_id for o in t.operators if o.phase == "backward"}
    # NllLoss and LogSoftmax both differentiate cross_entropy_loss (8); the linear's backward
    # is found through the weight's storage; conv2 (3) by its weight although conv3 (4) is
    # later; the relu by order; conv1 (1) by its weight
    assert got == {10: 8, 11: 8, 12: 7, 13: 6, 14: 3, 15: 4, 16: 2, 17: 1}
    for o in t.operators:
        if o.fwd_id is not None:
            assert o.layer == t.op(o.fwd_id).layer  # "op<forward id>"
    assert t.op(14).layer == "op3"


def test_pairing_without_storage_column_falls_back_to_tensor_ids_and_order(small):
    # no storage ids: the AddmmBackward0 still pairs with the only linear, by name and order
    rows = list(csv.reader(TENSOR.splitlines()))
    with open(small / "tensor.csv", "w", newline="") as f:
        csv.writer(f).writerows(r[:6] + r[7:] for r in rows)  # drop TensorStorgeid
    t = import_triosim_csv(small)
    assert t.op(12).fwd_id == 7 and t.op(14).fwd_id == 3 and t.op(15).fwd_id == 4


def test_ddp_gradients_of_the_linear_layer_are_ready_at_its_backward_op(small):
    t = import_triosim_csv(small)
    ready = gradient_ready(t)
    pos = {o.id: i for i, o in enumerate(t.operators)}
    last_bwd = pos[17]
    # linear weight (11, 320 x 4 B) and bias (12, 5 x 4 B): ready after AddmmBackward0 (12);
    # without pairing the CSV gives them no backward op at all, so they waited for the end
    assert ready[11] == ready[12] == pos[12]
    assert ready[5] == pos[14] and ready[7] == pos[15]
    at_end = sum(t.tensors[w].nbytes for w, p in ready.items() if p == last_bwd)
    # only conv1's weight and bias, whose backward op is the last one: (108 + 4) x 4 B
    assert at_end == (108 + 4) * 4


def test_flops_from_shapes_against_hand_calculation(small):
    t = import_triosim_csv(small)
    f = {o.id: o.flops for o in t.operators}
    conv1 = 2 * 2 * 4 * 8 * 8 * 3 * 3 * 3  # 2 N Cout Hout Wout Cin kh kw = 27648
    conv2 = 2 * 2 * 4 * 8 * 8 * 4 * 3 * 3  # 36864
    conv3 = 2 * 2 * 4 * 8 * 8 * 4 * 1 * 1  # 4096
    linear = 2 * 2 * 5 * 64  # 2 M N K = 1280
    assert (f[1], f[3], f[4], f[7]) == (conv1, conv2, conv3, linear)
    # backward: input gradient + weight gradient = 2x forward; conv1's input is the batch,
    # which needs no gradient: 1x
    assert (f[17], f[14], f[15], f[12]) == (conv1, 2 * conv2, 2 * conv3, 2 * linear)
    n = 2 * 4 * 8 * 8  # elements of the relu / add output
    assert f[2] == 1 * n and f[5] == 1 * n and f[16] == 1 * n  # relu, add, relu backward
    assert f[6] == (2 * 4 * 4 * 4) * 4  # max pool: a 2x2 window compare per output element
    assert f[13] == n  # its backward scatters into the input gradient
    assert f[8] == 5 * 10 and f[10] == 1 * 10 and f[11] == 4 * 10  # loss on 10 logits
    assert f[9] == 0
    params = 108 + 4 + 144 + 16 + 320 + 5  # _foreach_add_(params, grads): 1 per parameter
    assert f[18] == params
    assert t.op(1).math == "tf32" and t.op(17).math == "tf32"  # cuDNN default on CUDA
    assert t.op(7).math == "float32" and t.op(12).math == "float32"  # matmul default
    assert t.op(2).math == "float32"


def test_flop_formulas_match_torch_flop_counter():
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    def count(fn):
        with FlopCounterMode(display=False) as m:
            fn()
        return m.get_total_flops()

    torch.manual_seed(0)
    # (torch's weight-gradient formula ignores groups, so the backward is compared ungrouped)
    for cin, cout, k, stride, groups, need_input_grad in (
        (3, 8, 3, 1, 1, False),
        (4, 8, 3, 2, 1, True),
        (4, 8, 3, 2, 2, True),
    ):
        x = torch.randn(2, cin, 9, 9, requires_grad=need_input_grad)
        conv = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=1, groups=groups)
        y = None

        def fwd(x=x, conv=conv):
            nonlocal y
            y = conv(x)

        got = count(fwd)
        mine = flops.forward_flops(
            "aten::conv2d", [tuple(x.shape), tuple(conv.weight.shape)], [tuple(y.shape)]
        )
        assert mine == got
        hand = 2 * 2 * cout * y.shape[2] * y.shape[3] * (cin // groups) * k * k
        assert mine == hand
        back = count(lambda y=y: y.sum().backward())
        if groups == 1:
            assert (
                flops.backward_flops("ConvolutionBackward0", mine, input_grad=need_input_grad)
                == back
            )
    for shape in ((6, 64), (2, 3, 64)):
        x = torch.randn(*shape, requires_grad=True)
        lin = torch.nn.Linear(64, 5)
        out = None

        def run(x=x, lin=lin):
            nonlocal out
            out = lin(x)

        got = count(run)
        mine = flops.forward_flops(
            "aten::linear", [tuple(x.shape), tuple(lin.weight.shape)], [tuple(out.shape)]
        )
        assert mine == got == 2 * 6 * 5 * 64
        back = count(lambda out=out: out.sum().backward())
        assert flops.backward_flops("AddmmBackward0", mine) == back
    a, b = torch.randn(3, 4, 7), torch.randn(3, 7, 5)
    assert flops.forward_flops("aten::bmm", [(3, 4, 7), (3, 7, 5)], [(3, 4, 5)]) == count(
        lambda: torch.bmm(a, b)
    )


def test_trace_stats_and_fidelity_warnings(small):
    t = import_triosim_csv(small)
    s = trace_stats(t)
    assert (s["backward_operators"], s["backward_paired"], s["pairing"]) == (8, 8, 1.0)
    assert (s["operators"], s["operators_with_flops"], s["flops_coverage"]) == (18, 18, 1.0)
    assert s["conv_matmul_operators"] == s["conv_matmul_with_math"] == 8
    assert fidelity_warnings(t) == []
    # what the importer used to produce: no pairing, no FLOPs, no math
    for o in t.operators:
        o.fwd_id, o.flops, o.math = None, None, None
    s = trace_stats(t)
    assert (s["backward_paired"], s["pairing"], s["operators_with_flops"]) == (0, 0.0, 0)
    w = fidelity_warnings(t)
    assert len(w) == 2
    assert w[0].startswith("8 of 8 backward operators have no forward pairing")
    assert "DDP overlap" in w[0] and "tensor parallelism" in w[0]
    assert w[1].startswith("18 of 18 operators have no FLOP count (8 of them splittable")
    assert "roofline" in w[1] and "TP sharding" in w[1]
    t.op(1).flops = 1.0  # FLOPs but no math mode on a convolution
    assert any("1 of 1 convolution" in x and "float32" in x for x in fidelity_warnings(t))


def test_gpu_and_math_keywords(small):
    t = import_triosim_csv(small, gpu="h100")
    assert t.metadata["gpu"] == "H100-SXM"
    assert "gpu" not in import_triosim_csv(small).metadata
    with pytest.raises(ConfigError, match="H100-SXM"):  # names the catalogue
        import_triosim_csv(small, gpu="Z9000")
    t = import_triosim_csv(small, math={"matmul": "tf32"})
    assert t.op(7).math == t.op(12).math == "tf32" and t.op(1).math == "tf32"
    assert t.metadata["math"] == {"conv": "tf32", "matmul": "tf32", "other": "float32"}
    t = import_triosim_csv(small, math={"conv": "float32"})
    assert t.op(1).math == "float32"
    with pytest.raises(ConfigError, match="math.vector"):
        import_triosim_csv(small, math={"vector": "tf32"})
    with pytest.raises(ConfigError, match="math.conv"):
        import_triosim_csv(small, math={"conv": "tf64"})


def test_imported_trace_round_trips_with_new_columns(small, tmp_path):
    t = import_triosim_csv(small, gpu="H100")
    back = load(save(t, tmp_path / "t.trace.json"))
    assert back.operators == t.operators and back.metadata == t.metadata


# An operator table written before fwd_id was filled by the importer and before the
# "math" column existed (format_version 1, the original 8 + 3 columns, or only the 8).
OLD = {
    "format": "triosim-trace",
    "format_version": 1,
    "metadata": {"batch_size": 4, "gpu": "H100-SXM"},
    "tensors": {
        "columns": ["id", "shape", "dtype", "nbytes", "category"],
        "rows": [
            [0, [4, 8], "float32", 2e9, "input"],
            [1, [8, 8], "float32", 1e6, "weight"],
            [2, [4, 8], "float32", 2e9, "activation"],
            [3, [8, 8], "float32", 1e6, "gradient"],
        ],
    },
    "operators": {
        "columns": ["id", "name", "layer", "phase", "time", "inputs", "outputs", "flops"],
        "rows": [
            [0, "aten::linear", "fc", "forward", 0.002, [0, 1], [2], 1e12],
            [1, "AddmmBackward0", "fc", "backward", 0.004, [2, 1], [3], 2e12],
            [2, "aten::_foreach_add_", "optimizer", "optimizer", 0.001, [1, 3], [], None],
        ],
    },
}


def test_old_trace_without_new_columns_loads_and_gives_the_same_results(tmp_path):
    from perfmodel import Roofline, Target

    path = tmp_path / "old.trace.json"
    path.write_text(json.dumps(OLD))
    old = load(path)
    assert [o.math for o in old.operators] == [None, None, None]
    assert [o.fwd_id for o in old.operators] == [None, None, None]
    new = load(save(old, tmp_path / "new.trace.json"))  # re-saved with every column
    assert new.operators == old.operators
    # roofline with no math column: the trace's dtype (float32) peaks, as before.
    # linear on H100: max(1e12 / 67e12, 4.001e9 / 3.35e12) = 14.925 ms roof vs 2 ms measured,
    # efficiency 7.4627; on A100-40GB: max(1e12 / 19.5e12, 4.001e9 / 1555e9) = 51.282 ms
    eff = (1e12 / 67e12) / 0.002
    want = (1e12 / 19.5e12) / eff
    for t in (old, new):
        r = Roofline(t)
        assert r.time(t.operators[0], Target(gpu="A100-40GB")) == pytest.approx(want, rel=1e-12)
        assert r.iteration_time() == pytest.approx(0.007, rel=1e-12)
    # the same simulated iteration from both files
    from triosim.simulation.wiring import Simulation

    times = [Simulation({"num_gpus": 1}, trace=t).run().iteration_time for t in (old, new)]
    assert times[0] == times[1] == pytest.approx(0.007)


@needs_go
def test_go_vgg13_every_backward_op_paired_and_linear_gradients_ready_early():
    t = import_triosim_csv(GO / "vgg13", gpu="H100")
    s = trace_stats(t)
    assert s["backward_paired"] == s["backward_operators"] == 35
    assert s["operators_with_flops"] == s["operators"] == 77
    assert fidelity_warnings(t) == []
    addmm = [o for o in t.operators if o.name.endswith("AddmmBackward0")]
    linears = [o.id for o in t.operators if o.name == "aten::linear"]
    assert [o.fwd_id for o in addmm] == linears[::-1]
    ready = gradient_ready(t)
    last = max(i for i, o in enumerate(t.operators) if o.phase == "backward")
    at_end = sum(t.tensors[w].nbytes for w, p in ready.items() if p == last)
    # was 494.6 MB (all three linear layers); now only the first conv: (64*3*3*3 + 64) x 4 B
    assert at_end == (64 * 3 * 3 * 3 + 64) * 4
    # forward FLOPs of convolutions and linears: 2 x batch x multiply-adds of VGG-13
    convs = [
        (3, 64, 224),
        (64, 64, 224),
        (64, 128, 112),
        (128, 128, 112),
        (128, 256, 56),
        (256, 256, 56),
        (256, 512, 28),
        (512, 512, 28),
        (512, 512, 14),
        (512, 512, 14),
    ]
    macs = (
        sum(ci * co * 9 * h * h for ci, co, h in convs) + 25088 * 4096 + 4096 * 4096 + 4096 * 1000
    )
    got = sum(o.flops for o in t.operators if o.name in ("aten::conv2d", "aten::linear"))
    assert got == 2 * 128 * macs


@needs_go
def test_go_resnet50_pairs_agree_with_weights_and_storage():
    d = GO / "resnet50"
    t = import_triosim_csv(d)
    s = trace_stats(t)
    assert s["backward_paired"] == s["backward_operators"] == 160
    stor = {
        int(r["TensorID"]): int(r["TensorStorgeid"]) for r in csv.DictReader(open(d / "tensor.csv"))
    }
    for o in t.operators:
        if o.fwd_id is None:
            continue
        f = t.op(o.fwd_id)
        if "Convolution" in o.name or "BatchNorm" in o.name:  # reads its forward op's weight
            assert f.inputs[1] in o.inputs
        if "ReluBackward" in o.name:  # its saved result is the forward relu's output storage
            assert stor[o.inputs[1]] == stor[f.outputs[0]]
    fwd = [o.fwd_id for o in t.operators if o.fwd_id is not None]
    assert fwd == sorted(fwd, reverse=True)  # autograd ran them in reverse forward order


def test_accumulate_grad_nodes_need_no_forward_pairing():
    # the shipped ResNet-18 CPU trace: its 62 unpaired backward ops are all AccumulateGrad
    # nodes (one per weight tensor), which no forward op made; every other backward op is
    # paired, so the trace has nothing to warn about pairing
    from triosim.simulation.wiring import load_any_trace

    t = load_any_trace(Path(__file__).resolve().parents[1] / "traces/cpu/resnet18-b8.trace.json.gz")
    bwd = [o for o in t.operators if o.phase == "backward"]
    acc = [o for o in bwd if o.name.endswith("torch::autograd::AccumulateGrad")]
    # one per parameter tensor: 20 convolutions (17 + 3 downsample), 20 batch norms x
    # (weight, bias), the classifier's weight and bias
    assert len(acc) == 20 + 20 * 2 + 2 and all(o.fwd_id is None for o in acc)
    s = trace_stats(t)
    assert (s["backward_operators"], s["backward_paired"]) == (len(bwd) - 62, len(bwd) - 62)
    assert not any("forward pairing" in w for w in fidelity_warnings(t))
