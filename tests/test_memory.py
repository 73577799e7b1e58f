"""The memory model: static bytes per parameter, activation lifetimes, sharding, verdict."""

import pytest

from tests.conftest import chain_trace
from triosim.results.memory import MemoryOptions, static_bytes
from triosim.simulation.wiring import Simulation
from triosim.trace.model import Tensor


def run(trace, n, mode, batch, **cfg):
    par = {"mode": mode, **cfg.pop("par", {})}
    return Simulation(
        {"num_gpus": n, "batch_size": batch, "parallelism": par, **cfg}, trace=trace
    ).run()


def with_adam_states(t):
    """chain_trace plus Adam's two states per weight (what the tracer marks)."""
    for w in list(t.weights()):
        for _ in range(2):
            k = max(t.tensors) + 1
            t.tensors[k] = Tensor(k, w.shape, w.dtype, w.nbytes, "optimizer_state")
    return t


def test_bytes_per_parameter_follow_zero():
    # ZeRO (Rajbhandari et al. 2020, section 3.1): Adam holds 16 bytes per parameter,
    # both in fp32 (4 + 4 + 8) and in mixed precision (2 + 2 + 12)
    p = 1e9
    fp32 = static_bytes(4 * p, 4, "adam", "fp32")
    assert (fp32["weights"], fp32["gradients"], fp32["optimizer_states"]) == (4 * p, 4 * p, 8 * p)
    mixed = static_bytes(4 * p, 4, "adamw", "mixed")
    assert (mixed["weights"], mixed["gradients"], mixed["optimizer_states"]) == (
        2 * p,
        2 * p,
        12 * p,
    )
    assert sum(static_bytes(2 * p, 2, "sgd", "fp32").values()) == 8 * p  # bf16 trace: P = 1e9
    assert sum(static_bytes(4 * p, 4, "momentum", "mixed").values()) == 12 * p


def test_adam_is_recognised_and_held_whole_by_data_parallel():
    t = with_adam_states(chain_trace(batch=8))
    r = run(t, 2, "dp", 16)
    m = r.memory[r.memory.gpu == 0]
    w = t.weight_bytes()
    assert m["weights"].max() == w and m["optimizer_states"].max() == 2 * w
    assert m["gradients"].max() == pytest.approx(w)  # all of them, just before the step
    assert m["gradients"].iloc[-1] == 0  # freed by the optimizer step (set_to_none)


def test_saved_activations_follow_their_lifetimes():
    # dp on 1 of 2 GPUs at the traced batch: acts are act_bytes each. Forward op i reads act i
    # and writes act i+1; backward op i reads act i+1 and writes an input gradient. The input
    # (act 0) dies after forward op 0; acts 1..4 live until their backward op: at the end of
    # the forward pass 4 acts are alive, and the first backward op adds its output: 5.
    a = 1e6
    r = run(chain_trace(batch=8, act_bytes=a, layers=4), 2, "dp", 16)
    assert r.memory.groupby("gpu")["activations"].max().tolist() == [5 * a, 5 * a]


def test_data_parallel_peak_does_not_change_with_the_number_of_gpus():
    t = chain_trace(batch=8)
    peaks = {n: max(run(t, n, "dp", 8 * n).peak_memory.values()) for n in (2, 4, 8)}
    assert peaks[2] == peaks[4] == peaks[8]


def test_tensor_parallel_divides_split_weights():
    t = chain_trace(batch=8)  # every linear layer is split
    for n in (2, 4):
        r = run(t, n, "tp", 8)
        assert r.memory.groupby("gpu")["weights"].max().tolist() == [t.weight_bytes() / n] * n


def test_1f1b_holds_fewer_micro_batches_than_gpipe():
    # 2 stages of 2 layers, M = 8 micro-batches of act_bytes / 8: GPipe's stage 0 keeps the
    # saved activations (acts 1 and 2) of all 8 micro-batches, plus one input gradient in
    # backward: 8 x 2 + 1 = 17 units; 1F1B keeps at most S = 2 micro-batches in flight
    unit = 8e6 / 8
    t = chain_trace(batch=8, act_bytes=8e6, layers=4)
    gpipe = run(t, 2, "gpipe", 8, par={"microbatches": 8}).memory
    onefb = run(t, 2, "1f1b", 8, par={"microbatches": 8}).memory
    assert gpipe[gpipe.gpu == 0]["activations"].max() == pytest.approx(17 * unit)
    assert onefb[onefb.gpu == 0]["activations"].max() <= 5 * unit


def test_out_of_memory_is_flagged_and_the_run_still_completes():
    t = chain_trace(batch=8)
    ok = run(t, 2, "dp", 16)
    assert ok.out_of_memory() == [] and "yes" in ok.summary()  # an H100 has 80 GB
    tight = run(t, 2, "dp", 16, memory={"capacity": "40 MB", "reserve": "10 MB"})
    assert tight.iteration_time == ok.iteration_time
    assert tight.out_of_memory() == [0, 1] and "OUT OF MEMORY" in tight.summary()
    assert tight.summary_dict()["fits_in_memory"] is False
    cpu = chain_trace(batch=8)
    cpu.metadata["gpu"] = "cpu"
    assert run(cpu, 2, "dp", 16).out_of_memory() is None  # unknown capacity: no verdict


def test_memory_options_are_validated():
    from triosim.common.errors import ConfigError
    from triosim.config.loading import from_dict

    with pytest.raises(ConfigError, match="memory.optimizer.*one of auto"):
        from_dict({"trace": "x", "memory": {"optimizer": "lamb"}})
    with pytest.raises(ConfigError, match="memory.reserve.*a size"):
        from_dict({"trace": "x", "memory": {"reserve": "2 GB/s"}})
    assert from_dict({"trace": "x", "memory": {"reserve": "2 GiB"}}).memory == MemoryOptions(
        reserve=2**30 * 2
    )


def block_trace(blocks=3, a=1e6, saved_inside=False):
    """Blocks of two forward ops (linear x -> h, relu h -> y) whose backward reads x and h
    (what autograd saves); y is the next block's x. With `saved_inside`, each block's
    backward also reads an a-byte tensor no operator wrote, which autograd saved inside
    the linear (as rms_norm's composite saves its float32 intermediates)."""
    from triosim.trace.model import Operator, Trace

    tensors, ops = {}, []

    def tensor(cat, nbytes):
        k = len(tensors)
        tensors[k] = Tensor(k, (8, 8), "float32", nbytes, cat)
        return k

    x = tensor("input", a)
    saved = []
    for b in range(blocks):
        w = tensor("weight", 4e6)
        h, y = tensor("activation", a), tensor("activation", a)
        ops.append(
            Operator(len(ops), "aten::linear", f"block{b}", "forward", 1e-3, (x, w), (h,), 1e9)
        )
        ops.append(
            Operator(len(ops), "aten::relu", f"block{b}", "forward", 0.5e-3, (h,), (y,), 1e6)
        )
        saved.append((b, x, h, w, len(ops) - 2))
        x = y
    for b, xb, hb, w, fwd in reversed(saved):
        g, gx = tensor("gradient", 4e6), tensor("activation", a)
        inside = (tensor("activation", a),) if saved_inside else ()
        ops.append(
            Operator(
                len(ops),
                "AddmmBackward0",
                f"block{b}",
                "backward",
                2e-3,
                (xb, hb, w, *inside),
                (gx, g),
                2e9,
                fwd_id=fwd,
            )
        )
    return Trace(ops, tensors, {"batch_size": 8, "gpu": "H100-SXM"}).validate()


def test_full_recomputation_trades_memory_for_the_forward_time():
    # 3 blocks: without recomputation the forward keeps every x and h (the last y, never
    # read, is freed at once): 6 tensors, and the first backward op adds its input gradient:
    # 7. With full recomputation only the block inputs x stay (3); block 2's h and y come back
    # (5), y goes, its backward adds a gradient (5). The time grows by the recomputed
    # forward: 3 x 1.5 ms
    a = 1e6
    t = block_trace(3, a)
    plain = run(t, 2, "dp", 16)
    again = run(t, 2, "dp", 16, par={"recompute": "full"})
    assert again.iteration_time - plain.iteration_time == pytest.approx(3 * 1.5e-3, rel=1e-9)
    peak = [r.memory.groupby("gpu")["activations"].max().max() for r in (plain, again)]
    assert peak[0] == pytest.approx(7 * a) and peak[1] == pytest.approx(5 * a)


def test_what_a_recomputed_op_saved_inside_itself_is_born_with_its_recomputation():
    # The blocks above, each backward also reading s_b, saved inside block b's linear.
    # Without recomputation s_b lives from the linear to its backward: at block 2's relu
    # x0 h0 x1 h1 x2 h2 y2 and s0 s1 s2 are alive (10), and so at the first backward op
    # (y2 gone, its input gradient added). With full recomputation the first forward runs
    # without saving: s_b is born when block b's linear is recomputed, so at block 2's
    # recomputed relu x0 x1 x2 h2 y2 and s2 (6); born at the first forward, s0 and s1 were
    # alive there too (8).
    a = 1e6
    t = block_trace(3, a, saved_inside=True)
    plain = run(t, 2, "dp", 16)
    again = run(t, 2, "dp", 16, par={"recompute": "full"})
    peak = [r.memory.groupby("gpu")["activations"].max().max() for r in (plain, again)]
    assert peak[0] == pytest.approx(10 * a) and peak[1] == pytest.approx(6 * a)


def test_a_capacity_no_gpu_has_and_a_reserve_over_it_are_refused_before_running():
    from triosim.common.errors import ConfigError

    t = chain_trace(batch=8)
    # a bare number is bytes: `capacity: 80` meant 80 GB
    with pytest.raises(ConfigError, match="memory.capacity.*at least 1 MiB.*'80 GB'"):
        Simulation({"num_gpus": 2, "batch_size": 16, "memory": {"capacity": 80}}, trace=t)
    # the default 1 GiB reserve is more than a 0.1 GB GPU: nothing left for tensors
    with pytest.raises(ConfigError, match="memory.reserve.*less than the GPU's memory"):
        Simulation({"num_gpus": 2, "batch_size": 16, "memory": {"capacity": "0.1 GB"}}, trace=t)
    assert run(t, 2, "dp", 16, memory={"capacity": "2 GB"}).out_of_memory() == []


def test_recompute_depth_sets_the_recomputed_blocks():
    """`recompute_depth` is the layer-name depth of a recomputed block: under a common
    prefix (`model.block0`, ...; torchtitan's `layers.N` is depth 2) depth 2 gives the
    three blocks of the test above (peak 5 tensors), depth 1 one block holding all three
    (the first forward keeps only its input, the recomputed one all of them again: 7, as
    without recomputation); the time grows by the recomputed forward either way."""
    import dataclasses

    from triosim.trace.model import Trace

    a = 1e6
    t = block_trace(3, a)
    ops = [dataclasses.replace(op, layer=f"model.{op.layer}") for op in t.operators]
    t = Trace(ops, t.tensors, t.metadata).validate()
    plain = run(t, 2, "dp", 16)
    for depth, tensors in ((2, 5), (1, 7)):
        par = {"recompute": "full", "recompute_depth": depth}
        again = run(t, 2, "dp", 16, par=par)
        assert again.iteration_time - plain.iteration_time == pytest.approx(3 * 1.5e-3, rel=1e-9)
        assert again.memory.groupby("gpu")["activations"].max().max() == pytest.approx(tensors * a)


def test_a_cast_in_its_sources_storage_is_new_memory():
    """The tracer gives `aten::to`'s output its input's storage id (its schema says it may
    alias; it does only when no conversion is needed). A bfloat16 activation of 1 MB cast
    to float32 (2 MB, the same storage id) and both read by backward: 3 MB held when the
    forward pass ends, not the storage's largest tensor (2 MB)."""
    from triosim.trace.model import Operator, Trace

    x = Tensor(0, (8, 8), "bfloat16", 1e6, "activation", storage=7)
    y = Tensor(1, (8, 8), "float32", 2e6, "activation", storage=7)
    i = Tensor(2, (8, 8), "bfloat16", 1e6, "input")
    g = Tensor(3, (8, 8), "float32", 2e6, "activation")
    ops = [
        Operator(0, "aten::relu", "a", "forward", 1e-3, (2,), (0,), 0.0),
        Operator(1, "aten::to", "a", "forward", 1e-3, (0,), (1,), 0.0),
        Operator(2, "MulBackward0", "a", "backward", 1e-3, (0, 1), (3,), 0.0, fwd_id=1),
    ]
    t = Trace(ops, {x.id: x, y.id: y, i.id: i, g.id: g}, {"batch_size": 8}).validate()
    r = Simulation({"num_gpus": 1}, trace=t).run()
    m = r.memory
    during_cast = m[m.time < 2e-3].activations.iloc[-1]
    assert during_cast == pytest.approx(1e6 + 2e6)  # x and its copy (the input is gone)
