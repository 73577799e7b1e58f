"""The calibrated model times alike operators once (perfmodel.features.op_signature: a
shape-only trace's replicated layers). Truth: `predict`, called afresh for every
operator; the cache must give its answer bit for bit, wherever a field it reads differs."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from perfmodel import CalibratedModel, Target
from perfmodel.calibrated import predict
from perfmodel.features import op_signature
from perfmodel.kinds import op_kind
from triosim.hardware import catalogue as hardware
from triosim.trace.model import Tensor, Trace, load

ROOT = Path(__file__).resolve().parents[1]
TRACES = [
    ROOT / "traces" / "modelled" / "h100-sxm" / "llama3-8b-s2048-b8.trace.json.gz",
    ROOT / "traces" / "cpu" / "resnet18-b8.trace.json.gz",
    ROOT / "traces" / "h100" / "gpt2-s512-b8.trace.json.gz",
]
TARGETS = [
    Target(gpu="H100-SXM"),
    Target(gpu="H100-SXM", batch_size=2),
    Target(gpu="H200", batch_size=1, tp=4),
    Target(gpu="A100", batch_size=0.5, tp=2),
]


@pytest.fixture(scope="module", params=TRACES, ids=lambda p: p.name.split(".")[0])
def trace(request):
    return load(request.param)


def test_every_operator_gets_predicts_own_answer_at_every_target(trace):
    m = CalibratedModel(trace, identity=False)
    cal = m.calibration
    for target in TARGETS:
        gpu = hardware.gpu(target.gpu)
        got = [m.time(op, target) for op in trace.operators]
        assert got == [predict(cal, trace, op, gpu, target) for op in trace.operators]


def test_a_shape_only_traces_replicated_layers_are_alike():
    # Llama 3 8B, shape-only: 2 of its 32 layers traced, replicated 16 times
    t = load(TRACES[0])
    classes = {op_signature(t, op) for op in t.operators}
    layered = [op for op in t.operators if op.layer.startswith("layers.")]
    per_layer = {op_signature(t, op) for op in layered}
    layers = {op.layer.split(".")[1] for op in layered}
    assert len(layers) == 32 and len(per_layer) <= len(layered) // 16
    assert len(classes) < len(t.operators) // 5


def _two_ops(trace: Trace, op, **change):
    """`trace` with a copy of `op` (new id, new tensors of the same fields) changed by
    `change` (operator fields, or `tensor_nbytes`, `tensor_shape`, `tensor_category`,
    `tensor_dtype` for its first tensor)."""
    tensors = dict(trace.tensors)
    top = max(tensors) + 1
    ids = {}
    for k, tid in enumerate(dict.fromkeys(op.inputs + op.outputs)):
        t = tensors[tid]
        if k == 0:
            t = dataclasses.replace(
                t,
                nbytes=change.pop("tensor_nbytes", t.nbytes),
                shape=change.pop("tensor_shape", t.shape),
                category=change.pop("tensor_category", t.category),
                dtype=change.pop("tensor_dtype", t.dtype),
            )
        ids[tid] = top + k
        tensors[top + k] = dataclasses.replace(t, id=top + k, name=None, storage=None)
    new_id = max(o.id for o in trace.operators) + 1
    twin = dataclasses.replace(
        op,
        id=new_id,
        layer=op.layer + ".twin",
        inputs=tuple(ids[i] for i in op.inputs),
        outputs=tuple(ids[i] for i in op.outputs),
        **change,
    )
    return Trace([*trace.operators, twin], tensors, trace.metadata), twin


@functools.cache
def _llama() -> Trace:
    return load(TRACES[0])


CHANGES = st.sampled_from(
    [
        {},
        {"flops": 3.0e9},
        {"flops": None},
        {"tp_split": True},
        {"math": "tf32"},
        {"time": 1.5e-3},
        {"name": "aten::gelu"},
        {"tensor_nbytes": 12345.0},
        {"tensor_shape": (3,)},
        {"tensor_shape": ()},
        {"tensor_category": "weight"},
        {"tensor_dtype": "float16"},
        {"phase": "optimizer"},
        {"phase": "forward"},
    ]
)


@settings(max_examples=60, deadline=None)
@example(k=5, change={"phase": "optimizer"}, target=TARGETS[0])
@example(k=5, change={"flops": 3.0e9}, target=TARGETS[0])
@example(k=5, change={"math": "tf32"}, target=TARGETS[0])
@given(k=st.integers(0, 10_000), change=CHANGES, target=st.sampled_from(TARGETS))
def test_a_changed_twin_is_timed_as_predict_times_it(k, change, target):
    # an operator and a twin differing in one field the model may read: each gets
    # predict's time for itself (a field left out of the signature would hand the twin
    # its original's time); the same twin without a change is alike and timed once
    base = _llama()
    op = base.operators[k % len(base.operators)]
    t, twin = _two_ops(base, op, **dict(change))
    m = CalibratedModel(t, identity=False)
    gpu = hardware.gpu(target.gpu)
    assert m.time(op, target) == predict(m.calibration, t, op, gpu, target)
    assert m.time(twin, target) == predict(m.calibration, t, twin, gpu, target)
    first = (
        t.tensors[next(iter(dict.fromkeys(op.inputs + op.outputs)), None)]
        if (op.inputs or op.outputs)
        else None
    )
    moved = any(
        getattr(first, f.removeprefix("tensor_"), v) != v
        if f.startswith("tensor_")
        else getattr(op, f) != v
        for f, v in change.items()
    )
    assert (op_signature(t, op) == op_signature(t, twin)) == (not moved)


def test_names_ids_and_storage_are_not_read():
    # what the signature leaves out: the operator's id and layer, its tensors' ids, names
    # and storage; predict must not read them either
    t = load(TRACES[0])
    m = CalibratedModel(t, identity=False)
    target = TARGETS[2]
    gpu = hardware.gpu(target.gpu)
    for op in t.operators[::97]:
        t2, twin = _two_ops(t, op)
        assert op_signature(t2, twin) == op_signature(t, op)
        assert predict(m.calibration, t2, twin, gpu, target) == m.time(op, target)


def test_a_view_and_a_redefined_gpu_are_timed_again(monkeypatch):
    t = load(TRACES[0])
    m = CalibratedModel(t, identity=False)
    op = next(o for o in t.operators if o.flops)
    target = Target(gpu="H100-SXM")
    before = m.time(op, target)
    # a view over tensors of other sizes (one GPU's shard) times them anew
    tensors = {k: dataclasses.replace(v, nbytes=v.nbytes * 7) for k, v in t.tensors.items()}
    view = m.view(Trace(t.operators, tensors, t.metadata))
    assert view.time(op, target) != before
    assert m.time(op, target) == before
    # a GPU of that name redefined (half the bandwidth and compute) is looked up again
    g = hardware.gpu("H100-SXM")
    slow = dataclasses.replace(
        g,
        memory_bandwidth=g.memory_bandwidth / 2,
        peak_flops={k: v / 2 for k, v in g.peak_flops.items()},
    )
    monkeypatch.setitem(hardware.GPUS, "H100-SXM", slow)
    assert m.time(op, target) > before


def test_tensors_met_twice_are_told_from_two_tensors():
    # an in-place operator reads and writes one tensor; its twin over two equal tensors
    # moves twice the bytes: not alike
    ts = {
        0: Tensor(0, (1024,), "float32", 4096.0, "activation"),
        1: Tensor(1, (1024,), "float32", 4096.0, "activation"),
    }
    from triosim.trace.model import Operator

    a = Operator(0, "aten::add_", "l", "forward", 0.0, (0, 0), (0,))
    b = Operator(1, "aten::add_", "l", "forward", 0.0, (0, 1), (1,))
    t = Trace([a, b], ts, {"batch_size": 1})
    assert op_signature(t, a) != op_signature(t, b)


def test_a_backward_operator_is_told_apart_by_its_forward_operator():
    # a backward operator's bytes are its forward operator's: twins of a backward operator
    # whose forward operators differ (its first tensor 3x the bytes) are not alike
    t = _llama()
    bwd = next(  # a memory-bound one (its time is its bytes')
        o
        for o in t.operators
        if o.phase == "backward" and o.fwd_id is not None and op_kind(o)[0] == "elementwise_bwd"
    )
    t1, fwd_twin = _two_ops(
        t,
        t.op(bwd.fwd_id),
        tensor_nbytes=3 * t.tensors[next(iter(dict.fromkeys(t.op(bwd.fwd_id).inputs)))].nbytes,
    )
    t2, bwd_twin = _two_ops(t1, bwd, fwd_id=fwd_twin.id)
    m = CalibratedModel(t2, identity=False)
    target = TARGETS[1]
    gpu = hardware.gpu(target.gpu)
    assert op_signature(t2, bwd_twin) != op_signature(t2, bwd)
    first, twin = m.time(bwd, target), m.time(bwd_twin, target)
    assert twin == predict(m.calibration, t2, bwd_twin, gpu, target) != first


@pytest.mark.parametrize("change", [{"flops": 7.0e12}, {"math": "float32"}])
def test_a_matmul_twin_of_other_flops_or_math_is_not_its_original(change):
    # a compute-bound operator: its time follows its FLOPs and the units its math runs on
    t = _llama()
    op = next(o for o in t.operators if o.name == "aten::linear" and o.flops)
    t2, twin = _two_ops(t, op, **change)
    m = CalibratedModel(t2, identity=False)
    target = TARGETS[0]
    gpu = hardware.gpu(target.gpu)
    first, second = m.time(op, target), m.time(twin, target)
    assert second == predict(m.calibration, t2, twin, gpu, target) != first


def test_which_tensor_is_written_tells_two_operators_apart():
    # both read x (small) and y (large); one writes x back, the other y: not alike
    ts = {
        0: Tensor(0, (16,), "float32", 64.0, "activation"),
        1: Tensor(1, (1 << 20,), "float32", 4.0 * (1 << 20), "activation"),
    }
    from triosim.trace.model import Operator

    a = Operator(0, "aten::add_", "l", "forward", 0.0, (0, 1), (0,))
    b = Operator(1, "aten::add_", "l", "forward", 0.0, (0, 1), (1,))
    t = Trace([a, b], ts, {"batch_size": 1, "gpu": "H100-SXM"})
    m = CalibratedModel(t, identity=False)
    target = TARGETS[0]
    gpu = hardware.gpu(target.gpu)
    assert op_signature(t, a) != op_signature(t, b)
    assert [m.time(a, target), m.time(b, target)] == [
        predict(m.calibration, t, o, gpu, target) for o in (a, b)
    ]
    assert m.time(a, target) != m.time(b, target)


def test_the_traces_batch_or_dtype_changed_is_timed_again():
    t = load(TRACES[0])
    m = CalibratedModel(t, identity=False)
    op = next(o for o in t.operators if o.flops and o.phase == "forward")
    target = Target(gpu="H100-SXM", batch_size=8)
    gpu = hardware.gpu(target.gpu)
    before = m.time(op, target)
    t.metadata["batch_size"] = 2 * t.metadata["batch_size"]  # the same target: half the work
    after = m.time(op, target)
    assert after == predict(m.calibration, t, op, gpu, target) != before
