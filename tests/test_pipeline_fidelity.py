"""Pipelines: crash-free stage cuts that weigh boundary transfers, one send stream per
direction, and recomputation (activation checkpointing), against hand-computed timelines."""

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extrapolators.modes.pipeline import balanced_cuts
from tests.conftest import GO_TRACES, chain_trace
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation

GB = 1e9
FAST = {"kind": "ring", "bandwidth": 1e30, "latency": 0.0}


def run(trace, n, mode, topology=None, batch_size=None, one_stream=False, **par):
    s = Simulation(
        {
            "num_gpus": n,
            "batch_size": batch_size,
            "parallelism": {"mode": mode, **par},
            "topology": topology or FAST,
            "communication": {"kind": "textbook"},
        },
        trace=trace,
    )
    if one_stream:
        s.extrapolator.split_send_streams = False
    r = s.run()
    r.extrapolator = s.extrapolator
    return r


# -- the cut search ----------------------------------------------------------------------------
def brute_force(costs, parts, boundary):
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        worst = max(
            (boundary[a] if a > 0 else 0.0) + sum(costs[a:b]) + (boundary[b] if b < n else 0.0)
            for a, b in itertools.pairwise(bounds)
        )
        best = min(best, worst)
    return best


def group_costs(costs, starts, boundary):
    n = len(costs)
    bounds = [*starts, n]
    return [
        (boundary[a] if a > 0 else 0.0) + sum(costs[a:b]) + (boundary[b] if b < n else 0.0)
        for a, b in itertools.pairwise(bounds)
    ]


magnitudes = st.one_of(
    st.just(0.0),
    st.floats(1e-300, 1e-200),
    st.floats(0.0, 10.0),
    st.floats(1e200, 1e300),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), costs=st.lists(magnitudes, min_size=1, max_size=9))
def test_cuts_are_always_parts_nonempty_groups_and_optimal(data, costs):
    n = len(costs)
    parts = data.draw(st.integers(1, n))
    with_boundary = data.draw(st.booleans())
    boundary = [data.draw(magnitudes) for _ in range(n + 1)] if with_boundary else [0.0] * (n + 1)
    starts = balanced_cuts(costs, parts, boundary if with_boundary else None)
    assert len(starts) == parts and starts[0] == 0
    assert all(a < b for a, b in itertools.pairwise(starts)) and starts[-1] < n
    got = max(group_costs(costs, starts, boundary))
    best = brute_force(costs, parts, boundary)
    assert got <= best * (1 + 1e-9) + 1e-300


def test_one_stage_never_gets_an_extra_cut_from_rounding():
    # these eight costs made the former bisection return two groups for one part (its
    # upper bound, numpy's pairwise sum, was below the loop's running sum): IndexError
    costs = [
        0.04171753663098261,
        38.586494126072004,
        6.111744524341742,
        6.641418567485056,
        66.02765449276848,
        8.475896722401388e-05,
        0.5819025790346892,
        0.0007359235998979757,
    ]
    assert balanced_cuts(costs, 1) == [0]
    t = chain_trace(layers=8, t_opt=0)
    for op in t.operators:
        op.time = costs[op.id] if op.phase == "forward" else 0.0
    r = run(t, 1, "gpipe")
    assert r.iteration_time == pytest.approx(sum(costs), rel=1e-12)


def layered_chain(ms, layers):
    """A chain of len(ms) operators, forward ms[k] ms (backward twice that), in `layers`:
    (trace, forward ops, backward op of each forward op id)."""
    t = chain_trace(layers=len(ms), t_fwd=1e-3, t_bwd=2e-3, t_opt=0)
    fwd = [op for op in t.operators if op.phase == "forward"]
    bwd = {op.fwd_id: op for op in t.operators if op.phase == "backward"}
    for op, k, layer in zip(fwd, ms, layers, strict=True):
        op.time, bwd[op.id].time = k * 1e-3, 2 * k * 1e-3
        op.layer = bwd[op.id].layer = layer
    return t, fwd, bwd


def test_no_cut_between_the_loss_and_what_it_reads():
    """Four operators in their own layers, forward 1, 1, 1, 3 ms (backward twice that): two
    layers, the head, then the loss reading the head's output. Between layers the best
    two-stage cut is 3 + 3 + 3 | 9 (the loss alone: its stage would receive the logits);
    the loss stays with the head, as every framework runs it: 3 + 3 | 3 + 9."""
    t, fwd, bwd = layered_chain((1, 1, 1, 3), ("layers.0", "layers.1", "output", "loss"))
    r = run(t, 2, "gpipe")
    assert r.extrapolator.pipe.starts == [0, 2]
    assert r.iteration_time == pytest.approx((2 + 4 + 8 + 4) * 1e-3, rel=1e-9)
    fwd[3].layer = bwd[fwd[3].id].layer = "criterion"  # (not the loss: cut before it)
    assert run(t, 2, "gpipe").extrapolator.pipe.starts == [0, 3]


def test_an_auxiliary_loss_does_not_undo_the_cuts_between_layers():
    """Eight 1 ms operators: layers.0 the first three, layers.1 the next four, then the
    loss, which also reads the first operator's output (an auxiliary loss): no cut is left
    between the loss and what it reads, so the cuts stay between layers (3 | 5 ms), not
    between any two operators (4 | 4, inside layers.1)."""
    t = chain_trace(layers=8, t_fwd=1e-3, t_bwd=2e-3, t_opt=0)
    fwd = [op for op in t.operators if op.phase == "forward"]
    bwd = {op.fwd_id: op for op in t.operators if op.phase == "backward"}
    for k, op in enumerate(fwd):
        op.layer = bwd[op.id].layer = "layers.0" if k < 3 else "layers.1" if k < 7 else "loss"
    fwd[7].inputs = (*fwd[7].inputs, fwd[0].outputs[0])
    assert run(t, 2, "gpipe").extrapolator.pipe.starts == [0, 3]


@pytest.mark.skipif(not GO_TRACES.exists(), reason="shared/reference traces absent")
@pytest.mark.parametrize("model", ["vgg13", "resnet50"])
def test_imported_h100_traces_on_one_stage_and_one_gpu_replicas(model):
    from triosim.trace.go_csv import import_triosim_csv

    t = import_triosim_csv(GO_TRACES / model)
    ring = {"kind": "ring", "bandwidth": "65 GB/s", "latency": 0}
    single = run(t, 1, "single", ring).iteration_time
    assert run(t, 1, "gpipe", ring).iteration_time == pytest.approx(single, rel=1e-12)
    assert run(t, 1, "1f1b", ring, microbatches=2).iteration_time > 0
    dp = run(t, 2, "dp", ring, batch_size=2 * t.batch_size).iteration_time
    hybrid = run(t, 2, "hybrid", ring, batch_size=2 * t.batch_size, dp=2, inner="gpipe")
    assert hybrid.iteration_time == pytest.approx(dp, rel=1e-12)


# -- cuts that weigh the boundary transfer --------------------------------------------------------
def test_partition_avoids_a_huge_activation_at_the_compute_balanced_cut():
    # four equal layers (1 ms forward, 2 ms backward): compute alone cuts 2 | 2, exactly where
    # layer 1's 1 GB output crosses (200 ms there and back at 10 GB/s); layer 0's 1 MB output
    # costs 0.2 ms, layer 2's 2 MB 0.4 ms, to the stages on both sides of the cut
    t = chain_trace(layers=4, t_fwd=1e-3, t_bwd=2e-3, t_opt=0, act_bytes=1e6, batch=8)
    t.tensors[4].nbytes = 1e9  # the output of layer 1 (tensor ids: input 0, then w, a per layer)
    t.tensors[6].nbytes = 2e6  # the output of layer 2
    bw, lat = 10 * GB, 1e-6
    r = run(t, 2, "gpipe", {"kind": "ring", "bandwidth": bw, "latency": lat})
    assert r.extrapolator.pipe.starts == [0, 1]  # stages 3.2 | 9.2 ms (cut at 3: 9.4 | 3.4)
    # M = 1: F0, send 1 MB, F1 F2 F3, B3 B2 B1, send 1 MB back, B0
    x = 1e6 / bw + lat
    assert r.iteration_time == pytest.approx(1e-3 + x + 3e-3 + 6e-3 + x + 2e-3, rel=1e-9)
    # the compute-balanced cut, forced, pays the 1 GB twice
    forced = run(t, 2, "gpipe", {"kind": "ring", "bandwidth": bw, "latency": lat}, stages=[2])
    y = 1e9 / bw + lat
    assert forced.iteration_time == pytest.approx(2e-3 + y + 2e-3 + 4e-3 + y + 4e-3, rel=1e-9)


def test_balanced_cuts_fall_between_layers_as_frameworks_split_models():
    """Four operators, forward 1, 1, 3, 3 ms (backward twice that), in two layers
    (layers.0: the first two, layers.1: the others): between any two operators the best
    two-stage cut is 1 + 1 + 3 | 3 (15 | 9 ms with backward); between layers it is 1 + 1 |
    3 + 3 (6 | 18 ms), where torchtitan's split points and Megatron's layers per stage cut.
    With one operator a layer (layer0 .. layer3) the first cut is back."""
    t, fwd, bwd = layered_chain(
        (1, 1, 3, 3), ("layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b")
    )
    r = run(t, 2, "gpipe")
    assert r.extrapolator.pipe.starts == [0, 2]
    assert r.iteration_time == pytest.approx((2 + 6 + 12 + 4) * 1e-3, rel=1e-9)
    for k, op in enumerate(fwd):
        op.layer = bwd[op.id].layer = f"layer{k}"
    assert run(t, 2, "gpipe").extrapolator.pipe.starts == [0, 3]
    # more stages than layers: between any two operators, as before
    for op in fwd:
        op.layer = bwd[op.id].layer = "layers.0.x"
    assert run(t, 4, "gpipe").extrapolator.pipe.starts == [0, 1, 2, 3]


@pytest.mark.skipif(not GO_TRACES.exists(), reason="shared/reference traces absent")
def test_vgg13_gpipe_cuts_avoid_the_16_gb_activations():
    from triosim.trace.go_csv import import_triosim_csv

    t = import_triosim_csv(GO_TRACES / "vgg13")
    bw = 65e9
    r = run(t, 4, "gpipe", {"kind": "ring", "bandwidth": bw, "latency": 0})
    e = r.extrapolator
    assert max(e.pipe.boundary) < 1e9  # both 1.64 GB outputs (first two convolutions) stay inside
    # one micro-batch: every forward, then every backward, one after the other, each
    # boundary crossed twice; then stage 0's optimizer share
    ops = t.operators
    fb = sum(op.time for op in ops if op.phase != "optimizer")
    share = e.weights.stage_bytes[0] / t.weight_bytes()
    opt = sum(op.time for op in ops if op.phase == "optimizer") * share
    want = fb + sum(2 * b / bw for b in e.pipe.boundary) + opt
    assert r.iteration_time == pytest.approx(want, rel=1e-9)


@pytest.mark.skipif(not GO_TRACES.exists(), reason="shared/reference traces absent")
@pytest.mark.parametrize("mode,recompute", [("gpipe", "all"), ("1f1b", "except_last")])
def test_vgg13_cuts_avoid_the_16_gb_activations_with_recompute_too(mode, recompute):
    # charging a cut to the upstream stage only, recomputation made the first stage (conv1
    # alone, cheap) worth sending its 1.64 GB output: the cut costs the receiver as much
    from triosim.trace.go_csv import import_triosim_csv

    t = import_triosim_csv(GO_TRACES / "vgg13")
    top = {"kind": "ring", "bandwidth": 65e9, "latency": 0}
    r = run(t, 4, mode, top, microbatches=4, recompute=recompute)
    assert max(r.extrapolator.pipe.boundary) < 1e9


# -- send streams ------------------------------------------------------------------------------
@pytest.mark.parametrize("bw", [0.5 * GB, 2 * GB, 20 * GB])
@pytest.mark.parametrize("S,M", [(2, 4), (4, 8)])
def test_1f1b_with_a_send_stream_per_direction_is_never_slower(bw, S, M):
    t = chain_trace(layers=2 * S, batch=4 * M, act_bytes=4e6, t_opt=0)
    top = {"kind": "ring", "bandwidth": bw, "latency": 1e-6}
    two = run(t, S, "1f1b", top, microbatches=M).iteration_time
    one = run(t, S, "1f1b", top, microbatches=M, one_stream=True).iteration_time
    assert two <= one * (1 + 1e-12)


def test_1f1b_one_stream_holds_a_gradient_behind_an_activation():
    # a micro-batch's 1 MB activation takes 1 ms at 1 GB/s, longer than its 0.375 ms of
    # compute a stage: on one stream each gradient send waits behind an activation send
    t = chain_trace(layers=4, batch=32, act_bytes=8e6, t_opt=0)
    top = {"kind": "ring", "bandwidth": 1 * GB, "latency": 0.0}
    two = run(t, 4, "1f1b", top, microbatches=8)
    one = run(t, 4, "1f1b", top, microbatches=8, one_stream=True)
    assert two.iteration_time < one.iteration_time * 0.99
    streams = set(two.timeline.stream)
    assert {"send_fwd", "send_bwd"} <= streams and "comm" not in streams


# -- recomputation -------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute,extra", [("none", 0), ("except_last", 2), ("all", 3)])
def test_gpipe_recompute_hand_timeline(recompute, extra):
    # 2 stages of one layer, M = 2: F = 1 ms, B = 2 ms a micro-batch per stage. Without
    # recomputation the last backward ends at 3F + 3B. With it, each stage re-runs F just
    # after a micro-batch's gradient arrives: 'all' puts three of the four re-runs on the
    # critical path (6F + 3B); 'except_last' re-runs micro-batch 0 only (5F + 3B)
    F, B = 1e-3, 2e-3
    t = chain_trace(layers=2, t_fwd=2 * F, t_bwd=2 * B, t_opt=0, batch=8)
    r = run(t, 2, "gpipe", microbatches=2, recompute=recompute)
    assert r.iteration_time == pytest.approx(3 * F + 3 * B + extra * F, rel=1e-9)
    rec = r.timeline[r.timeline.phase == "recompute"]
    per_gpu = rec.assign(d=rec.end - rec.start).groupby("gpu").d.sum()
    redone = {"none": 0, "except_last": 1, "all": 2}[recompute]  # micro-batches re-run
    for g in (0, 1):
        assert per_gpu.get(g, 0.0) == pytest.approx(redone * F, rel=1e-9)
        busy = r.per_gpu().loc[g, "compute"]
        assert busy == pytest.approx(2 * F + 2 * B + redone * F, rel=1e-9)


def test_1f1b_recompute_adds_the_stage_forward_per_recomputed_microbatch():
    t = chain_trace(layers=4, batch=16, t_opt=0)
    base = run(t, 2, "1f1b", microbatches=4)
    rec = run(t, 2, "1f1b", microbatches=4, recompute="except_last")
    stage_fwd = 2 * 1e-3 / 4  # two 1 ms layers a stage, at a quarter of the batch
    got = rec.per_gpu()["compute"] - base.per_gpu()["compute"]
    assert got.tolist() == pytest.approx([3 * stage_fwd] * 2, rel=1e-9)


def test_recompute_is_validated():
    from triosim.common.errors import ConfigError

    with pytest.raises(ConfigError, match="parallelism.recompute.*none, except_last, all"):
        run(chain_trace(), 2, "gpipe", recompute="always")


def test_uniform_split_puts_equal_numbers_of_layers_in_each_chunk():
    """Megatron's default split: 6 operators, the first outside any numbered layer (a stem,
    `conv1`: its digit is not a layer number), then layers.0 to layers.3 (layers.3 has two), 1 ms each but layers.0's
    10 ms: balanced cuts would isolate layers.0; uniform gives 2 layers a chunk (layers.0-1
    with the embedding | layers.2-3), whatever the times. Refused beside `stages`, and with
    more chunks than layers."""
    t = chain_trace(layers=6, t_fwd=1e-3, t_bwd=2e-3, t_opt=0)
    fwd = [op for op in t.operators if op.phase == "forward"]
    bwd = {op.fwd_id: op for op in t.operators if op.phase == "backward"}
    names = ("conv1", "layers.0.a", "layers.1.a", "layers.2.a", "layers.3.a", "layers.3.b")
    for op, layer in zip(fwd, names, strict=True):
        op.layer = bwd[op.id].layer = layer
    fwd[1].time = 10e-3
    assert run(t, 2, "gpipe").extrapolator.pipe.starts == [0, 2]  # conv1 + layers.0 | rest
    assert run(t, 2, "gpipe", split="uniform").extrapolator.pipe.starts == [0, 3]
    assert run(t, 4, "gpipe", split="uniform").extrapolator.pipe.starts == [0, 2, 3, 4]
    with pytest.raises(ConfigError, match="parallelism.split"):
        run(t, 2, "gpipe", split="uniform", stages=["layers.2"])
    with pytest.raises(ConfigError, match="at least 5 numbered layers"):
        run(t, 5, "gpipe", split="uniform")
