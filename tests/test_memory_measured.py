"""Memory against measurement: the tracer's measured peak (hand-calculated on a model whose
allocations are known), the trace's storages, the model's PyTorch lifetime rules written out
by hand, and the shipped CPU traces' measured peaks."""

import gzip
import json
from pathlib import Path

import pytest

from triosim.common.errors import TraceError
from triosim.simulation.wiring import Simulation
from triosim.trace.model import Operator, Tensor, Trace, load, save

ROOT = Path(__file__).resolve().parents[1]
A = 1e6  # bytes of each batch-scaled tensor in the hand traces
MS = 1e-3


def run_single(trace, batch: int = 8):
    return Simulation(
        {"num_gpus": 1, "batch_size": batch, "parallelism": {"mode": "single"}}, trace=trace
    ).run()


def activations_at(result, t):
    """Activation bytes in the state that holds at time t (after every change at t)."""
    m = result.memory
    return float(m[m.time <= t + 1e-15].iloc[-1]["activations"])


def loss_trace(view_storage: bool = False, shapes_only: bool = False):
    """op0 fc forward: x, w -> h (h is the model's output; with view_storage, op0b reshapes
    h into hv, a view: same storage); op1 loss forward: h -> l, and saves s inside (the
    log-softmax cross_entropy keeps); op2 loss backward (fwd_id op1) reads s, writes gh;
    op3 fc backward reads gh and x, writes w's gradient. Every op takes 1 ms."""
    tensors = {}

    def tensor(cat, nbytes, storage=None):
        k = len(tensors)
        tensors[k] = Tensor(k, (8, 8), "float32", nbytes, cat, storage=storage)
        return k

    x, w = tensor("input", A), tensor("weight", 4e6)
    h = tensor("activation", A, storage=7 if view_storage else None)
    ops = [Operator(0, "aten::linear", "fc", "forward", MS, (x, w), (h,), 1e9)]
    out = h
    if view_storage:
        out = tensor("activation", A, storage=7)
        ops.append(Operator(len(ops), "aten::reshape", "fc", "forward", MS, (h,), (out,)))
    l_, s, gh, g = (
        tensor("activation", 4),
        tensor("activation", A),
        tensor("activation", A),
        tensor("gradient", 4e6),
    )
    f = len(ops)
    ops += [
        Operator(f, "aten::cross_entropy_loss", "loss", "forward", MS, (out,), (l_,), 1e6),
        Operator(f + 1, "NllLossBackward0", "loss", "backward", MS, (s,), (gh,), 1e6, fwd_id=f),
        Operator(f + 2, "AddmmBackward0", "fc", "backward", MS, (gh, x), (g,), 2e9, fwd_id=0),
    ]
    meta = {"batch_size": 8, "gpu": "H100-SXM", "shapes_only": shapes_only}
    return Trace(ops, tensors, meta).validate()


@pytest.mark.parametrize("shapes_only", [False, True], ids=["measured", "shape-only"])
def test_a_tensor_saved_inside_a_forward_op_is_born_with_it_and_the_output_is_held(shapes_only):
    # the same rule for a shape-only trace: its tracer names only what operators read and
    # return, so a tensor a backward op reads first is one autograd saved (docs/memory.md)
    r = run_single(loss_trace(shapes_only=shapes_only))
    # [1, 2) ms, the loss forward: x, h and s (saved inside it) and l: 3 A + 4 bytes; s would
    # be missing (2 A + 4) if it were born only at its backward reader
    assert activations_at(r, 1.5 * MS) == 3 * A + 4
    # [3, 4) ms, the last backward op: x, gh, and h, held by the loop (`out = model(x)`)
    # although its last reader ended at 2 ms: 3 A (2 A if h were freed after the loss)
    assert activations_at(r, 3.5 * MS) == 3 * A
    # [2, 3) ms: x, h, s, gh: the peak, 4 A
    assert r.memory["activations"].max() == 4 * A


def test_views_are_one_allocation():
    # h and its reshape hv share storage 7: one A, not two, at every instant
    r = run_single(loss_trace(view_storage=True))
    assert activations_at(r, 0.5 * MS) == 2 * A  # x, h
    assert activations_at(r, 1.5 * MS) == 2 * A  # x, h = hv
    assert r.memory["activations"].max() == 4 * A  # as without the view


def test_storage_round_trips_and_is_validated(tmp_path):
    t = loss_trace(view_storage=True)
    back = load(save(t, tmp_path / "t.trace.json"))
    assert [x.storage for x in back.tensors.values()] == [x.storage for x in t.tensors.values()]
    doc = json.loads((tmp_path / "t.trace.json").read_text())
    doc["tensors"]["rows"][0][6] = "seven"
    (tmp_path / "bad.trace.json").write_text(json.dumps(doc))
    with pytest.raises(TraceError, match="storage.*expected an integer"):
        load(tmp_path / "bad.trace.json")


def test_cpu_peak_memory_matches_the_hand_calculation():
    torch = pytest.importorskip("torch")
    from tracer.collect import record

    n, b = 512, 64  # y = x W^T (no bias), loss = sum(y * t), plain SGD: no states
    model = torch.nn.Linear(n, n, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, meta = record(
        model,
        lambda bs, dev: (torch.randn(bs, n), torch.randn(bs, n)),
        lambda out, t: (out * t).sum(),
        opt,
        batch_size=b,
        warmup=1,
        measure=0,
    )
    w, x = 4 * n * n, 4 * b * n
    start = w + 2 * x  # weights, inputs, targets
    assert meta["memory_at_step_start_bytes"] == start
    # alive together in backward: y (held by the loop), y * t (saved? no: sum's backward
    # needs only the shape) ... the gradient of y (x-sized), and W's gradient (w-sized)
    # being written; y * t is freed once summed: so start + y + dy + dW (+ scalars)
    peak = meta["peak_memory_bytes"]
    assert start + 2 * x + w <= peak <= start + 3 * x + w + 1024


def _shipped():
    for f in sorted((ROOT / "traces/cpu").glob("*.trace.json.gz")):
        with gzip.open(f, "rt") as fh:
            meta = json.load(fh)["metadata"]
        yield f, meta


@pytest.mark.parametrize("path", [f for f, _ in _shipped()], ids=lambda p: p.name.split(".")[0])
def test_shipped_cpu_traces_peak_is_predicted_within_5_percent(path):
    # the target, against the measurement the tracer stored in each trace
    t = load(path)
    measured = t.metadata.get("peak_memory_bytes")
    assert measured, "the shipped CPU traces carry their measured peak (re-make them)"
    r = Simulation(
        {"num_gpus": 1, "batch_size": t.metadata["batch_size"], "parallelism": {"mode": "single"}},
        trace=t,
    ).run()
    assert r.peak_memory[0] == pytest.approx(measured, rel=0.05)


def _tiny_cnn_trace(shapes_only: bool):
    """conv(3->16) relu_ maxpool(2) conv(16->64) relu_ flatten linear(4096->10), no biases,
    batch 4 of 3x16x16 images, cross-entropy, plain SGD; traced on the CPU or on meta."""
    torch = pytest.importorskip("torch")
    from tracer.collect import collect

    nn = torch.nn
    torch.manual_seed(0)
    with torch.device("meta" if shapes_only else "cpu"):
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 64, 3, padding=1, bias=False),
            nn.ReLU(inplace=True),
            nn.Flatten(),
            nn.Linear(64 * 8 * 8, 10, bias=False),
        )
    t = collect(
        model,
        lambda b, dev: (
            torch.randn(b, 3, 16, 16, device=dev),
            torch.randint(0, 10, (b,), device=dev),
        ),
        torch.nn.functional.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.1),
        batch_size=4,
        warmup=1,
        measure=1,
        model_name="tiny-cnn",
        shapes_only=shapes_only,
    )
    if shapes_only:
        from perfmodel.modelled import model_times

        t = model_times(t, "H100-SXM", "learned")
    return t


def test_shape_only_peak_holds_the_max_pool_indices_by_hand():
    # The peak is in the second ReLU's backward, before the max-pool's backward reads the
    # indices max_pool2d saved inside itself (int64, never an operator's output). By hand,
    # bytes (batch 4): input 4*3*16*16*4 = 12,288; conv1 out (relu_ in place, saved by the
    # pool) 4*16*16*16*4 = 65,536; pool out (saved by conv2) 4*16*8*8*4 = 16,384; its
    # indices 4*16*8*8*8 = 32,768; conv2 out (relu_ in place, flatten a view) 65,536;
    # logits (held by the loop) 4*10*4 = 160; the flatten's gradient 65,536 (read by the
    # ReLU's backward as a view) and the ReLU's input gradient 65,536 being written:
    # activations 323,744 (the targets died with the loss's backward). Weights
    # (16*3*9 + 64*16*9 + 10*4096) * 4 = 202,432; gradients: the linear's 163,840 (the convs'
    # come later); SGD holds no states. Total 690,016; without the indices 657,248 (what the
    # shape-only trace gave when it did not move births, as VGG's twins did: -13 to -18 %).
    acts = 12_288 + 65_536 + 16_384 + 32_768 + 65_536 + 160 + 65_536 + 65_536
    weights, grads = (16 * 3 * 9 + 64 * 16 * 9 + 10 * 4096) * 4, 10 * 4096 * 4
    assert acts == 323_744 and weights == 202_432
    # the shape-only trace is timed for an H100, whose run also holds PyTorch's two 32 MiB
    # cuBLAS workspaces (triosim.results.workspaces): 690,016 + 67,108,864 bytes
    shape_only = run_single(_tiny_cnn_trace(True), batch=4)
    assert shape_only.peak_memory[0] == acts + weights + grads + 2 * 32 * 2**20
    assert acts + weights + grads == 690_016
    # the CPU trace of the same model (no GPU, no cuBLAS): the same tensors and lifetimes,
    # the same peak, and the tracer's measured CPU peak within 1 % of it
    real = _tiny_cnn_trace(False)
    assert run_single(real, batch=4).peak_memory[0] == 690_016
    assert real.metadata["peak_memory_bytes"] == pytest.approx(690_016, rel=0.01)
