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
# gathered dtype runs on the GPU's shard (half); its backward (the gradient back to float32,
# per micro-batch) is gone once the weights are gathered in bfloat16 (FSDP2 accumulates
# the unsharded gradient in bfloat16 and casts at the reduce-scatter).
# Iteration, bfloat16 / float32: u0 gathered [0, 0.1], cast [0.1, 0.3], linear [0.3, 1.3];
# u1 (prefetched) cast [1.3, 1.5], linear [1.5, 2.5]; backward u1 (mode fsdp reshards every
# unit: gathered again at 1.3, hidden) mm [2.5, 4.5], AccumulateGrad [4.5, 4.6], its
# reduce-scatter [4.6, 4.8]; u0 (gathered again at 2.5) [4.6, 6.7], reduce-scatter
# [6.7, 6.9]; the optimizer on half the weights 0.25 -> 7.15. As traced, 0.2 ms gathers and
# the casts whole: 8.05.
HAND = {
    ("trace", "trace"): (0.2, 0.2, 0.4, 0.2, 3.0 + 2 * 2.3 + 0.2 + 0.25),
    ("bfloat16", "float32"): (0.1, 0.2, 0.2, 0.0, 2.5 + 2 * 2.1 + 0.2 + 0.25),
    ("bfloat16", "bfloat16"): (0.1, 0.1, 0.2, 0.0, 2.5 + 2 * 2.1 + 0.1 + 0.25),
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
    # bfloat16 weights need no cast (0 ms), nor the gradient (accumulated into float32
    # inside the product: gradient_accumulation_fusion)
    for reduce, ms in (("float32", 0.8), ("bfloat16", 0.4)):
        r = run("bfloat16", reduce, mode="ddp", bucket_size=1e9, first_bucket_size=1e9)
        ar = _rows(r, "allreduce")
        assert (ar.end - ar.start).tolist() == pytest.approx([ms * 1e-3], rel=1e-9)
        casts = _rows(r, "aten::to")
        assert (casts.end - casts.start).tolist() == [0.0, 0.0]
        back = _rows(r, "ToCopyBackward0")
        assert (back.end - back.start).tolist() == [0.0, 0.0]


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


def _static(par, mode="mesh", memory=None, reduce="float32"):
    """GPU 0's largest weights, gradients, optimizer states and buffers under `par` with
    bfloat16 parameters and `reduce`, Adam's states."""
    cfg = {
        "num_gpus": 2,
        "batch_size": 16,
        "topology": RING,
        "parallelism": {"mode": mode, **par},
        "communication": {"kind": "textbook"},
        "precision": {"params": "bfloat16", "reduce": reduce},
        "memory": {"optimizer": "adam", **(memory or {})},
    }
    m = Simulation(cfg, trace=two_cast_layers()).run().memory
    g0 = m[m.gpu == 0].max()
    return [float(g0[k]) for k in ("weights", "gradients", "optimizer_states", "buffers")]


P = 2 * W / 4  # the two float32 weights' parameters: 2M


def test_memory_holds_the_weights_as_the_layout_does_at_the_precision_set():
    """`memory.precision: auto` by hand, P = 2M parameters, Adam (8 bytes of states each):
    - Megatron's distributed optimizer on d = 2 GPUs (--bf16, grad_reduce_in_fp32): bfloat16
      weights 2P = 4 MB, the float32 gradient buffer 4P = 8 MB, the float32 main copy and
      Adam's states sharded: (4 + 8) P / 2 = 12 MB: 6 + 12/d = 12 bytes per parameter, the
      "bf16 param, fp32 grads" row of Megatron's dist_optimizer.md (counted as float32
      weights, its "fp32 param" row 8 + 8/d: 8 MB of weights, 8 of states);
    - without it (DDP): 2P weights, 4P float32 gradients, 12P main copy and states = 18
      bytes per parameter (4 + 8 + 24 MB);
    - FSDP keeps its shards as stored (FSDP2 gathers in bfloat16): float32 weights and
      gradients and the states, each halved: 4 + 4 + 8 MB;
    - `mixed` named: ZeRO's 2 + 2 + 12 whatever the layout (DDP: 4 + 4 + 24 MB);
    - DDP's gradients in bfloat16: 2P = 4 MB; with `reduce: trace`, as stored: 8 MB."""
    dist = {"dp_replicate": 2, "distributed_optimizer": True, "bucket_size": 1e9}
    w, g, s, buf = _static({**dist, "first_bucket_size": 1e9})
    assert (w, g, s, buf) == pytest.approx((4e6, 0.0, 12e6, 8e6), rel=1e-12)
    w, g, s, _ = _static({"bucket_size": 1e9, "first_bucket_size": 1e9}, mode="ddp")
    assert (w, g, s) == pytest.approx((4e6, 8e6, 24e6), rel=1e-12)
    w, g, s, _ = _static({"wrap_depth": 1}, mode="fsdp")
    assert (w, g, s) == pytest.approx((4e6, 4e6, 8e6), rel=1e-12)
    w, g, s, _ = _static({}, mode="ddp", memory={"precision": "mixed"})
    assert (w, g, s) == pytest.approx((4e6, 4e6, 24e6), rel=1e-12)
    # gradients in the reduce dtype: bfloat16 2P = 4 MB; `trace`, as stored (float32) 8 MB
    ddp = {"bucket_size": 1e9, "first_bucket_size": 1e9}
    assert _static(ddp, mode="ddp", reduce="bfloat16")[1] == pytest.approx(4e6, rel=1e-12)
    assert _static(ddp, mode="ddp", reduce="trace")[1] == pytest.approx(8e6, rel=1e-12)


def fp8_trace():
    """A block's linear (`layers.0.w`: a weight operand), an attention-like product of two
    activations in the block, and the output projection outside any block; 1 ms forward,
    2 ms backward each; activations of 4 MB in and 2 MB out."""
    tensors, ops = {}, []

    def tensor(cat, nbytes):
        t = Tensor(len(tensors), (1000, 1000), "bfloat16", float(nbytes), cat)
        tensors[t.id] = t
        return t.id

    x = tensor("input", 4e6)
    made = []
    # layers.0.v reads layers.0.w's input (as wk reads wq's): cast once, by w
    for layer, second in (("layers.0.w", "weight"), ("layers.0.v", "weight"),
                          ("layers.0.attention", "activation"), ("output", "weight")):  # fmt: skip
        b = tensor(second, 4e6)
        y = tensor("activation", 2e6)
        name = "aten::linear" if second == "weight" else "aten::matmul"
        ops.append(Operator(len(ops), name, layer, "forward", 1e-3, (x, b), (y,), 0.0))
        made.append((len(ops) - 1, layer, x, b))
        if layer != "layers.0.w":
            x = y
    for k, layer, inp, b in reversed(made):
        g = tensor("activation", 4e6)
        ops.append(
            Operator(
                len(ops), "MmBackward0", layer, "backward", 2e-3, (inp, b), (g,), 0.0, fwd_id=k
            )
        )
        # the linear's other autograd nodes, as the tracer records them (attributed to the
        # linear): the output gradient's view and the weight's transpose, no kernel
        gv, gt = tensor("activation", 2e6), tensor("buffer", 4e6)
        for name, out in (("ViewBackward0", gv), ("TBackward0", gt)):
            ops.append(
                Operator(len(ops), name, layer, "backward", 0.0, (g,), (out,), 0.0, fwd_id=k)
            )
    meta = {"batch_size": 8, "gpu": "H100-SXM"}
    return Trace(ops, tensors, meta).validate()


def test_fp8_products_by_hand():
    # H100 SXM: bfloat16 989.4 TFLOP/s, float8 1,978.9: an FP8 product takes 989.4 /
    # 1978.9 of its bfloat16 time, plus its operand's cast-transpose (2 bytes read, 2
    # written per bfloat16 element: twice the tensor's bytes) at 3.35 TB/s: forward the
    # 4 MB input (once: a second product of the same input casts nothing), backward the
    # 2 MB output gradient. The attention's product and the output projection stay as
    # traced.
    # The linear's view and transpose nodes launch no kernel: no cast of theirs (each was
    # charged the output gradient's cast-transpose, 4 per Llama linear instead of 1).
    cfg = {"num_gpus": 1, "perfmodel": {"kind": "trace"}, "precision": {"matmul": "float8"}}
    r = Simulation(cfg, trace=fp8_trace()).run()
    tl = r.timeline[r.timeline.kind == "compute"]
    views = tl[tl.name.isin(["ViewBackward0", "TBackward0"])]
    assert len(views) == 8 and (views.end - views.start).tolist() == [0.0] * 8
    tl = tl[~tl.index.isin(views.index)]
    took = {(row.layer, row.phase): row.end - row.start for row in tl.itertuples()}
    ratio = 989.4 / 1978.9
    assert took["layers.0.w", "forward"] == pytest.approx(1e-3 * ratio + 8e6 / 3.35e12, rel=1e-12)
    assert took["layers.0.w", "backward"] == pytest.approx(2e-3 * ratio + 4e6 / 3.35e12, rel=1e-12)
    assert took["layers.0.v", "forward"] == pytest.approx(1e-3 * ratio, rel=1e-12)  # cast by w
    assert took["layers.0.v", "backward"] == pytest.approx(2e-3 * ratio + 4e6 / 3.35e12, rel=1e-12)
    for layer in ("layers.0.attention", "output"):
        assert took[layer, "forward"] == pytest.approx(1e-3, rel=1e-12)
        assert took[layer, "backward"] == pytest.approx(2e-3, rel=1e-12)


def test_fp8_on_a_gpu_without_fp8_units_is_refused():
    cfg = {"num_gpus": 1, "gpu": "A100-80GB", "perfmodel": {"kind": "roofline"},
           "precision": {"matmul": "float8"}}  # fmt: skip
    with pytest.raises(ConfigError, match="precision.matmul"):
        Simulation(cfg, trace=fp8_trace()).run()


def test_fp8_covers_the_experts_grouped_gemms_by_hand():
    """An MoE layer's routed experts (a batched product over their stacked weights, as the
    tracer records a grouped GEMM) run in FP8 like the linears (TransformerEngine's
    GroupedLinear): 2 GPUs, EP 2, top-1, the traced batch on each; the experts' forward
    (4 ms) and backward (8 ms) at 989.4 / 1978.9 of that, plus the cast-transpose of the
    routed tokens (forward) and of their gradient (backward): 2 x T x hidden x 2 bytes at
    3.35 TB/s each."""
    from tests.test_expert_parallel import TB, TIMES, T

    ratio = 989.4 / 1978.9
    cast = 2 * T * TB / 3.35e12
    took = {}
    for fp8 in (False, True):
        r = _ep_run(fp8)
        tl = r.timeline
        ex = tl[(tl.kind == "compute") & tl.layer.str.endswith("experts") & (tl.gpu == 0)]
        took[fp8] = {row.phase: row.end - row.start for row in ex.itertuples()}
    assert took[False] == pytest.approx(
        {"forward": TIMES["experts"], "backward": TIMES["experts_bwd"]}
    )
    assert took[True]["forward"] == pytest.approx(TIMES["experts"] * ratio + cast, rel=1e-12)
    assert took[True]["backward"] == pytest.approx(TIMES["experts_bwd"] * ratio + cast, rel=1e-12)


def _ep_run(fp8: bool):
    from tests.test_expert_parallel import moe_trace

    cfg = {
        "num_gpus": 2,
        "batch_size": 4,
        "parallelism": {"mode": "ep"},
        "topology": {"kind": "fully_connected", "bandwidth": 1e10},
        "perfmodel": {"kind": "trace"},
        **({"precision": {"matmul": "float8"}} if fp8 else {}),
    }
    return Simulation(cfg, trace=moe_trace()).run()
