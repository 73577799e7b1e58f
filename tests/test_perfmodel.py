import dataclasses

import numpy as np
import pytest

from perfmodel import LinearRegressionModel, Roofline, Target, TraceTime, op_features
from tests.conftest import chain_trace
from triosim.common.errors import ConfigError
from triosim.hardware import catalogue as hardware
from triosim.trace.model import Trace


def test_weights_keep_size_when_batch_doubles(chain):
    fwd = chain.operators[0]  # reads input (batch-scaled) and a weight
    f1, b1 = op_features(chain, fwd, Target(batch_size=chain.batch_size))
    f2, b2 = op_features(chain, fwd, Target(batch_size=2 * chain.batch_size))
    w = chain.tensors[fwd.inputs[1]].nbytes
    act = chain.tensors[fwd.inputs[0]].nbytes + chain.tensors[fwd.outputs[0]].nbytes
    assert b1 == pytest.approx(w + act) and b2 == pytest.approx(w + 2 * act)
    assert f2 == pytest.approx(2 * f1)
    opt = chain.operators[-1]  # optimizer: weights and gradients only
    assert op_features(chain, opt, Target(batch_size=64)) == op_features(chain, opt)


def test_per_op_regression_recovers_known_coefficients():
    # time = a + b * batch for every op, a and b known: the fit must recover them
    traces = []
    for batch in (4, 8, 16, 32):
        t = chain_trace(batch=batch)
        for k, op in enumerate(t.operators):
            op.time = 1e-5 * (k + 1) + 2e-6 * (k + 2) * batch
        traces.append(t)
    m = LinearRegressionModel(traces[0], extra_traces=traces[1:])
    a = np.array([1e-5 * (k + 1) for k in range(len(traces[0].operators))])
    b = np.array([2e-6 * (k + 2) for k in range(len(traces[0].operators))])
    assert np.allclose(m.per_op[:, 0], a) and np.allclose(m.per_op[:, 1], b)
    op = traces[0].operators[3]
    assert m.time(op, Target(batch_size=64)) == pytest.approx(1e-5 * 4 + 2e-6 * 5 * 64)
    assert m.report["leave_one_trace_out_pct"] < 1e-6


def test_single_trace_scales_by_flop_ratio_around_overhead():
    t = chain_trace()
    for op in t.operators:  # time = 5 us launch + flops / 1e12
        op.time = 5e-6 + (op.flops or 0) / 1e12
    m = LinearRegressionModel(t)
    assert m.overhead == pytest.approx(5e-6, rel=1e-6)
    op = t.operators[0]
    want = 5e-6 + (op.time - 5e-6) * 2
    assert m.time(op, Target(batch_size=2 * t.batch_size)) == pytest.approx(want, rel=1e-6)
    assert m.time(op) == op.time  # traced setting: the measured time


def test_operators_that_launch_nothing_do_not_pin_the_launch_overhead_to_zero():
    # the 10th percentile of time per kernel bounds the overhead; an operator with no
    # kernel (time 0) says nothing about a launch. With a third of the operators such (as
    # an optimizer's item() calls are), the overhead is still the 5 us every launch costs.
    import warnings

    t = chain_trace()
    ops = []
    for op in t.operators:
        op.time = 5e-6 + (op.flops or 0) / 1e12
        ops.append(op)
    extra = [
        dataclasses.replace(op, id=1000 + k, time=0.0, kernels=0, flops=None)
        for k, op in enumerate(t.operators[: len(t.operators) // 2])
    ]
    t = Trace(ops + extra, t.tensors, t.metadata).validate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division by a zero kernel count
        m = LinearRegressionModel(t)
    assert m.overhead == pytest.approx(5e-6, rel=1e-6)


def test_save_load(tmp_path, chain):
    m = LinearRegressionModel(chain)
    back = LinearRegressionModel.load(m.save(tmp_path / "m.json"), chain)
    op = chain.operators[1]
    assert back.time(op, Target(batch_size=3)) == m.time(op, Target(batch_size=3))


def test_trace_time_only_at_traced_setting(chain):
    m = TraceTime(chain)
    assert m.time(chain.operators[0]) == chain.operators[0].time
    with pytest.raises(ConfigError, match="regression"):
        m.time(chain.operators[0], Target(batch_size=99))


@pytest.mark.parametrize("gpu", ["A40", "A100-40GB", "A100-80GB", "H100-SXM", "H200"])
def test_roofline_bounded_by_both_roofs(chain, gpu):
    m = Roofline(chain)
    g = hardware.gpu(gpu)
    for op in chain.operators:
        flops, nbytes = op_features(chain, op, Target(gpu=gpu))
        t = m.time(op, Target(gpu=gpu))
        assert t >= flops / g.flops_for("float32") * (1 - 1e-12)
        assert t >= nbytes / g.memory_bandwidth * (1 - 1e-12)


def test_roofline_reproduces_traced_gpu_totals(chain):
    # every chain op takes far longer than its H100 roof (efficiency < 1, nothing capped),
    # so each kind's fitted efficiency returns its traced total exactly
    m = Roofline(chain)
    for kind in ("aten::linear", "AddmmBackward0", "aten::_foreach_add_"):
        ops = [op for op in chain.operators if op.name == kind]
        assert 0 < m.efficiency[kind] < 1
        assert sum(m.time(op) for op in ops) == pytest.approx(sum(op.time for op in ops), rel=1e-12)
    assert m.iteration_time() == pytest.approx(chain.total_time, rel=1e-12)
    faster = m.iteration_time(Target(gpu="H200"))
    assert faster <= m.iteration_time(Target(gpu="A40"))


def test_unknown_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="gpu"):
        hardware.gpu("Z9000")


def test_per_kind_regression_recovers_coefficients_across_unaligned_traces():
    # three traces of one model (same weights and layers) whose operator lists do not line
    # up (one has no optimizer op); every linear op obeys
    # time = 3 us + FLOPs / 2e12 + bytes / 5e11, so the per-kind fit must find it
    traces = []
    for t_opt, batch in ((0.5e-3, 4), (0.0, 8), (0.5e-3, 16)):
        t = chain_trace(layers=3, batch=batch, act_bytes=1e5 * batch, t_opt=t_opt)
        for k, op in enumerate(t.operators):
            op.flops = 1e9 * (k + 1) * batch
            f, b = op_features(t, op)
            op.time = 3e-6 + f / 2e12 + b / 5e11
        traces.append(t)
    m = LinearRegressionModel(traces[0], extra_traces=traces[1:])
    assert m.per_op is None and "aten::linear" in m.per_kind
    intercept, (cf, cb) = m.per_kind["aten::linear"]
    assert intercept == pytest.approx(3e-6, rel=1e-3)
    assert cf == pytest.approx(1 / 2e12, rel=1e-3) and cb == pytest.approx(1 / 5e11, rel=1e-3)
    op = traces[0].operators[0]
    f, b = op_features(traces[0], op, Target(batch_size=32))
    assert m.time(op, Target(batch_size=32)) == pytest.approx(3e-6 + f / 2e12 + b / 5e11, rel=1e-3)


def test_an_extra_trace_of_another_model_is_refused():
    deeper = chain_trace(layers=5, batch=16)
    with pytest.raises(ConfigError, match=r"perfmodel.extra_traces\[0\].*same model"):
        LinearRegressionModel(chain_trace(layers=3, batch=8), extra_traces=[deeper])


def test_roofline_save_load(tmp_path, chain):
    m = Roofline(chain)
    back = Roofline.load(m.save(tmp_path / "r.json"), chain)
    for op in chain.operators:
        assert back.time(op, Target(gpu="A40")) == m.time(op, Target(gpu="A40"))


def test_an_optimizer_step_reading_a_scalar_takes_its_time_at_any_batch():
    """The optimizer's element-wise operators read 0-d tensors (a step count, a learning
    rate, a loss) that a trace may class as activations: a 0-d tensor has no batch
    dimension, so the step is not scaled with the batch (it was: ResNet-18's on 4 GPUs
    took a quarter of its traced time, and DDP's iteration 8 % too little)."""
    import dataclasses

    from perfmodel import Target, make_model
    from tests.conftest import chain_trace
    from triosim.trace.model import Tensor, Trace

    t = chain_trace(batch=8, layers=2)
    scalar = Tensor(len(t.tensors), (), "float32", 4.0, "activation")
    assert not scalar.scales_with_batch
    assert Tensor(0, (8, 3), "float32", 96.0, "activation").scales_with_batch
    tensors = {**t.tensors, scalar.id: scalar}
    ops = [
        dataclasses.replace(op, inputs=(*op.inputs, scalar.id)) if op.phase == "optimizer" else op
        for op in t.operators
    ]
    t = Trace(ops, tensors, t.metadata).validate()
    step = next(op for op in t.operators if op.phase == "optimizer")
    model = make_model("regression", t)
    times = [model.time(step, Target(batch_size=b)) for b in (2, 8, 32)]
    assert times == pytest.approx([step.time] * 3, rel=1e-12)


def test_the_catalogue_name_of_the_traced_gpu_is_the_traced_gpu():
    """A real trace records the device's own name ("NVIDIA H100 80GB HBM3"); `gpu: H100-SXM`
    names the same GPU, so the regression model scales it to another batch as with no
    `gpu` at all (it refused: "a target on the traced GPU"), and another GPU is refused."""
    from pathlib import Path

    from triosim.trace.model import load

    t = load(Path(__file__).resolve().parents[1] / "traces/h100/resnet50-b128.trace.json.gz")
    assert t.metadata["gpu"] == "NVIDIA H100 80GB HBM3"
    m = LinearRegressionModel(t)
    op = next(o for o in t.operators if o.name == "aten::conv2d")
    at = m.time(op, Target(batch_size=64))
    assert m.time(op, Target(gpu="H100-SXM", batch_size=64)) == at != op.time
    with pytest.raises(ConfigError, match="roofline"):
        m.time(op, Target(gpu="A100-80GB", batch_size=64))
