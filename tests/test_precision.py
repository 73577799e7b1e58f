"""Training precision (config `precision`, triosim/trace/precision.py): the bytes FSDP2's
all-gathers and reduce-scatters move and the time the trace's weight casts take, by hand on
a 2-GPU FSDP run of two linear layers stored in float32 and cast to bfloat16 where used (as
the tracer's LLM traces are)."""

from __future__ import annotations

import pytest

from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation
from triosim.trace.model import Operator, Tensor, Trace
from triosim.trace.precision import Precision, PrecisionOptions

RING = {"kind": "ring", "bandwidth": "10 GB/s", "latency": 0}
T_CAST, T_F, T_B, T_CAST_B, T_ACC, T_OPT = 0.4e-3, 1e-3, 2e-3, 0.2e-3, 0.1e-3, 0.5e-3
W = 4e6  # each layer's float32 weight: 1M elements


def two_cast_layers() -> Trace:
    """u0, u1: a float32 weight cast to bfloat16 (aten::to), a linear on the cast; backward:
    the linear's, the cast's (ToCopyBackward0: the gradient back to float32), AccumulateGrad."""
    tensors, ops = {}, []

    def tensor(cat, nbytes, dtype="float32"):
        t = Tensor(len(tensors), (1000, 1000), dtype, float(nbytes), cat)
        tensors[t.id] = t
        return t.id

    def op(name, layer, phase, t, ins, outs, fwd=None):
        ops.append(Operator(len(ops), name, layer, phase, t, ins, outs, 0.0, fwd_id=fwd))
        return len(ops) - 1

    x = tensor("input", 1e6, "bfloat16")
    made = {}
    inp = x
    for u in (0, 1):
        w = tensor("weight", W)
        c = tensor("buffer", W / 2, "bfloat16")
        a = tensor("activation", 1e6, "bfloat16")
        cast = op("aten::to", f"u{u}", "forward", T_CAST, (w,), (c,))
        lin = op("aten::linear", f"u{u}", "forward", T_F, (inp, c), (a,))
        made[u] = (w, c, inp, cast, lin)
        inp = a
    for u in (1, 0):
        w, c, inp, cast, lin = made[u]
        g_in, g_c = tensor("activation", 1e6, "bfloat16"), tensor("buffer", W / 2, "bfloat16")
        g32, g_w = tensor("buffer", W), tensor("gradient", W)
        op("MmBackward0", f"u{u}", "backward", T_B, (inp, c), (g_in, g_c), fwd=lin)
        op("ToCopyBackward0", f"u{u}", "backward", T_CAST_B, (g_c,), (g32,), fwd=cast)
        op("torch::autograd::AccumulateGrad", f"u{u}", "backward", T_ACC, (g32,), (g_w,))
    op("aten::_foreach_add_", "optimizer", "optimizer", T_OPT, (made[0][0], made[1][0]), ())
    return Trace(ops, tensors, {"batch_size": 8}).validate()


def run(params="trace", reduce="trace", mode="fsdp", n=2, **par):
    cfg = {
        "num_gpus": n,
        "batch_size": 8 * n,
        "topology": RING,
        "parallelism": {"mode": mode, **par},
        "communication": {"kind": "textbook"},  # the ring's (N-1)/N x bytes per GPU
        "precision": {"params": params, "reduce": reduce},
    }
    if mode == "fsdp":
        cfg["parallelism"]["wrap_depth"] = 1
    return Simulation(cfg, trace=two_cast_layers()).run()


def _rows(r, name):
    tl = r.timeline
    return tl[(tl.gpu == 0) & (tl.name == name)]


# (params, reduce) -> (all-gather ms, reduce-scatter ms, forward cast ms, backward cast ms,
# iteration ms), each by hand: a gather or reduce-scatter on 2 GPUs moves half the unit in
# its dtype at 10 GB/s (float32 4 MB -> 0.2 ms, bfloat16 2 MB -> 0.1 ms); a cast to the
# gathered dtype runs on the GPU's shard (half), its backward stays where the gradient is
# reduced in float32 and runs on the shard where it is reduced in bfloat16.
# Iteration, bfloat16 / float32 (the others alike): u0 gathered [0, 0.1], cast [0.1, 0.3],
# linear [0.3, 1.3]; u1 (prefetched) cast [1.3, 1.5], linear [1.5, 2.5]; backward u1
# (mode fsdp reshards every unit: gathered again at 1.3, hidden) mm [2.5, 4.5], cast
# [4.5, 4.7], AccumulateGrad [4.7, 4.8], its reduce-scatter [4.8, 5.0]; u0 (gathered again
# at 2.5) [4.8, 7.1], reduce-scatter [7.1, 7.3]; the optimizer on half the weights 0.25
# -> 7.55.
HAND = {
    ("trace", "trace"): (0.2, 0.2, 0.4, 0.2, 3.0 + 2 * 2.3 + 0.2 + 0.25),
    ("bfloat16", "float32"): (0.1, 0.2, 0.2, 0.2, 2.5 + 2 * 2.3 + 0.2 + 0.25),
    ("bfloat16", "bfloat16"): (0.1, 0.1, 0.2, 0.1, 2.5 + 2 * 2.2 + 0.1 + 0.25),
}


@pytest.mark.parametrize("params,reduce", list(HAND))
def test_fsdp_moves_and_casts_in_the_precision_set(params, reduce):
    gather, scatter, cast, cast_b, iteration = HAND[params, reduce]
    r = run(params, reduce)
    ag, rs = _rows(r, "all_gather"), _rows(r, "reduce_scatter")
    assert len(ag) == 4 and len(rs) == 2  # each unit before its forward and its backward
    assert (ag.end - ag.start).tolist() == pytest.approx([gather * 1e-3] * 4, rel=1e-9)
    assert (rs.end - rs.start).tolist() == pytest.approx([scatter * 1e-3] * 2, rel=1e-9)
    casts = _rows(r, "aten::to")
    assert (casts.end - casts.start).tolist() == pytest.approx([cast * 1e-3] * 2, rel=1e-9)
    back = _rows(r, "ToCopyBackward0")
    assert (back.end - back.start).tolist() == pytest.approx([cast_b * 1e-3] * 2, rel=1e-9)
    assert r.iteration_time == pytest.approx(iteration * 1e-3, rel=1e-9)


def test_fsdp_holds_its_gathered_units_in_the_gathered_dtype():
    # the two gathered units beside the GPU's own half: 2 x 4 MB / 2 in float32, 2 x 2 MB / 2
    # in bfloat16; the stored shards (master weights) stay float32: 4 MB
    for params, buf in (("trace", 4e6), ("bfloat16", 2e6)):
        m = run(params).memory
        g0 = m[m.gpu == 0].max()
        assert g0["buffers"] == pytest.approx(buf, rel=1e-12)
        assert g0["weights"] == pytest.approx(W, rel=1e-12)


def test_ddp_reduces_in_the_reduce_dtype_and_holds_weights_in_the_params_dtype():
    # DDP on 2 GPUs, one bucket of both gradients: the ring all-reduce sends 2 (N-1)/N x
    # bytes per GPU: 8 MB in float32 -> 0.8 ms, 4 MB in bfloat16 -> 0.4 ms; Megatron's
    # bfloat16 weights need no cast (0 ms), the gradient cast to float32 stays
    for reduce, ms in (("float32", 0.8), ("bfloat16", 0.4)):
        r = run("bfloat16", reduce, mode="ddp", bucket_size=1e9, first_bucket_size=1e9)
        ar = _rows(r, "allreduce")
        assert (ar.end - ar.start).tolist() == pytest.approx([ms * 1e-3], rel=1e-9)
        casts = _rows(r, "aten::to")
        assert (casts.end - casts.start).tolist() == [0.0, 0.0]
        back = _rows(r, "ToCopyBackward0")
        want = T_CAST_B if reduce == "float32" else 0.0
        assert (back.end - back.start).tolist() == pytest.approx([want] * 2, abs=1e-15)


def test_the_casts_found_are_the_weight_casts_and_their_backward():
    t = two_cast_layers()
    p = Precision(t, PrecisionOptions("bfloat16", "float32"))
    assert sorted(p.weight_casts) == [0, 2] and sorted(p.grad_casts) == [5, 8]
    assert p.gathered(1) == 2e6 and p.reduced(1) == 4e6
    assert Precision(t).weight_casts == set()  # `trace`: nothing changes
    assert Precision(t, PrecisionOptions("float16")).weight_casts == set()  # cast to bf16


def test_a_mode_without_weights_to_gather_refuses_a_precision():
    cfg = {
        "num_gpus": 4,
        "topology": RING,
        "parallelism": {"mode": "hop"},
        "precision": {"params": "bfloat16"},
    }
    with pytest.raises(ConfigError, match="precision"):
        Simulation(cfg, trace=two_cast_layers())
    with pytest.raises(ConfigError, match="precision.params"):
        Simulation({**cfg, "precision": {"params": "fp8"}}, trace=two_cast_layers())


def test_megatrons_distributed_optimizer_reduces_in_float32_and_gathers_bfloat16():
    # Megatron (--bf16, grad_reduce_in_fp32) on 2 GPUs: one bucket of both gradients
    # reduce-scattered in float32, (N-1)/N x 8 MB -> 0.4 ms; the updated parameters
    # all-gathered after the step in bfloat16, (N-1)/N x 4 MB -> 0.2 ms; the contiguous
    # gradient buffer held all iteration in float32: 8 MB (in bfloat16: 4 MB)
    par = {"dp_replicate": 2, "distributed_optimizer": True, "bucket_size": 1e9}
    for reduce, rs_ms, buf in (("float32", 0.4, 8e6), ("bfloat16", 0.2, 4e6)):
        r = run("bfloat16", reduce, mode="mesh", first_bucket_size=1e9, **par)
        rs, ag = _rows(r, "reduce_scatter"), _rows(r, "all_gather")
        assert (rs.end - rs.start).tolist() == pytest.approx([rs_ms * 1e-3], rel=1e-9)
        assert (ag.end - ag.start).tolist() == pytest.approx([0.2e-3], rel=1e-9)
        m = r.memory
        assert m[m.gpu == 0]["buffers"].max() == pytest.approx(buf, rel=1e-12)
