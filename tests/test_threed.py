"""3D parallelism (dp x tp x pp) and interleaved pipelines, against the modes they compose and
hand-computed timelines on the textbook (alpha-beta ring) model."""

import pytest

from extrapolators.execution.tasks import Collective, Send
from extrapolators.modes.schedules import SCHEDULES, register_schedule, schedule
from tests.conftest import chain_trace
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation

FAST = {"kind": "ring", "bandwidth": 1e30, "latency": 0.0}  # a free network
RING = {"kind": "ring", "bandwidth": 10e9, "latency": 1e-6}  # one where bytes cost time


def sim(trace, n, mode, topology=FAST, batch_size=None, **par):
    return Simulation(
        {
            "num_gpus": n,
            "batch_size": batch_size,
            "parallelism": {"mode": mode, **par},
            "topology": topology,
            "communication": {"kind": "textbook"},
        },
        trace=trace,
    )


def t_iter(*a, **k) -> float:
    return sim(*a, **k).run().iteration_time


# -- degenerate grids are the modes they compose -----------------------------------------------
@pytest.mark.parametrize("topology", [FAST, RING])
def test_one_axis_grids_equal_the_single_modes(topology):
    t = chain_trace(layers=8)
    same = [
        (("ddp", {}), {"dp": 4}),  # dp_overlap: bucketed, as DDP
        (("dp", {}), {"dp": 4, "dp_overlap": False}),  # one all-reduce after backward
        (("tp", {}), {"tp": 4}),
        (("gpipe", {"microbatches": 4}), {"pp": 4, "microbatches": 4, "schedule": "gpipe"}),
        (("1f1b", {"microbatches": 4}), {"pp": 4, "microbatches": 4, "schedule": "1f1b"}),
    ]
    for (mode, par), grid in same:
        want = t_iter(t, 4, mode, topology, **par)
        got = t_iter(t, 4, "3d", topology, **grid)
        assert got == pytest.approx(want, rel=1e-9), (mode, grid)


@pytest.mark.parametrize(
    ("inner", "grid"),
    [
        ({"inner": "1f1b", "microbatches": 4}, {"pp": 4, "microbatches": 4, "schedule": "1f1b"}),
        ({"inner": "gpipe", "microbatches": 4}, {"pp": 4, "microbatches": 4, "schedule": "gpipe"}),
        ({"inner": "tp"}, {"tp": 4}),
    ],
)
def test_two_axis_grids_without_overlap_equal_hybrid(inner, grid):
    # hybrid: dp replicas of a pipeline or a TP group, gradients all-reduced per position
    # after the whole backward; 3d with dp_overlap false does the same on the same GPUs
    t = chain_trace(layers=8)
    want = t_iter(t, 8, "hybrid", RING, batch_size=16, dp=2, **inner)
    got = t_iter(t, 8, "3d", RING, batch_size=16, dp=2, dp_overlap=False, **grid)
    assert got == pytest.approx(want, rel=1e-9)
    overlapped = t_iter(t, 8, "3d", RING, batch_size=16, dp=2, **grid)
    assert overlapped < got  # DDP-style buckets overlap the reduction with backward


def test_dp_overlap_hides_the_gradient_reduction_behind_backward():
    t = chain_trace(layers=8)
    after = t_iter(t, 4, "3d", RING, dp=4, dp_overlap=False)
    overlapped = t_iter(t, 4, "3d", RING, dp=4)
    assert overlapped < after


# -- the grid on the GPUs ------------------------------------------------------------------------
def groups(n, **par):
    """(TP groups, DP groups, pipeline sends (src, dst)) that the streams really use."""
    s = sim(chain_trace(layers=8), n, "3d", RING, **par)
    tp, dp, sends = set(), set(), set()
    for (g, _), tasks in s.extrapolator.streams().items():
        for task in tasks:
            if isinstance(task, Collective):
                (dp if task.key.startswith("dp:") else tp).add(frozenset(task.group))
            elif isinstance(task, Send):
                sends.add((g, task.dst))
    return tp, dp, sends, s.extrapolator


def fs(*gs):
    return {frozenset(g) for g in gs}


def test_tp_innermost_placement():
    # 8 GPUs, dp 2 x tp 2 x pp 2, tp-pp-dp: GPU = d * 4 + p * 2 + t
    tp, dp, sends, ex = groups(8, dp=2, tp=2, pp=2, microbatches=2)
    assert tp == fs({0, 1}, {2, 3}, {4, 5}, {6, 7})
    assert dp == fs({0, 4}, {1, 5}, {2, 6}, {3, 7})
    # pipeline sends go between corresponding TP ranks of consecutive stages, both ways
    assert sends == {(0, 2), (2, 0), (1, 3), (3, 1), (4, 6), (6, 4), (5, 7), (7, 5)}
    chains = [[ex.layout.at[p, d, 0, 0, t] for p in (0, 1)] for d in (0, 1) for t in (0, 1)]
    assert chains == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_dp_innermost_and_explicit_placements():
    # dp-pp-tp: GPU = t * 4 + p * 2 + d
    tp, dp, sends, _ = groups(8, dp=2, tp=2, pp=2, microbatches=2, placement="dp-pp-tp")
    assert tp == fs({0, 4}, {2, 6}, {1, 5}, {3, 7})
    assert dp == fs({0, 1}, {2, 3}, {4, 5}, {6, 7})
    assert sends == {(0, 2), (2, 0), (1, 3), (3, 1), (4, 6), (6, 4), (5, 7), (7, 5)}
    # an explicit list in tp-pp-dp grid order
    order = [7, 6, 5, 4, 3, 2, 1, 0]
    tp, dp, sends, _ = groups(8, dp=2, tp=2, pp=2, microbatches=2, placement=order)
    assert tp == fs({7, 6}, {5, 4}, {3, 2}, {1, 0})
    assert dp == fs({7, 3}, {6, 2}, {5, 1}, {4, 0})
    assert (7, 5) in sends and (5, 7) in sends and (7, 6) not in sends


def test_placement_changes_the_time_where_groups_share_links():
    t = chain_trace(layers=8)
    a = t_iter(t, 8, "3d", RING, dp=2, tp=2, pp=2, microbatches=2)
    b = t_iter(t, 8, "3d", RING, dp=2, tp=2, pp=2, microbatches=2, placement="dp-pp-tp")
    assert a != b


@pytest.mark.parametrize(
    ("par", "match"),
    [
        ({"dp": 3}, r"parallelism.dp.*dividing num_gpus \(8\)"),
        ({"dp": 2, "tp": 2, "pp": 4}, r"parallelism.pp.*dp x tp x pp = num_gpus \(8\)"),
        ({"placement": "pp-first"}, r"parallelism.placement"),
        ({"placement": [0, 1, 2]}, r"parallelism.placement.*8 GPU ids"),
        (
            {"pp": 8, "microbatches": 4, "schedule": "interleaved", "virtual_stages": 2},
            r"parallelism.microbatches.*multiple of the pipeline depth \(8\)",
        ),
        ({"pp": 8, "schedule": "zero-bubble"}, r"parallelism.schedule.*interleaved"),
        ({"pp": 8, "virtual_stages": 2}, r"parallelism.virtual_stages.*'interleaved'"),
    ],
)
def test_errors_name_the_field(par, match):
    with pytest.raises(ConfigError, match=match):
        sim(chain_trace(layers=16), 8, "3d", batch_size=16, **par)


def test_memory_hooks_hold_the_stage_share_of_the_tp_shard():
    # 8 layers of 4 MB on dp 2 x tp 2 x pp 2: a stage has 4 layers, each split in 2
    t = chain_trace(layers=8)
    s = sim(t, 8, "3d", RING, dp=2, tp=2, pp=2, microbatches=2)
    r = s.run()
    assert r.memory.groupby("gpu")["weights"].max().tolist() == [4 * 4e6 / 2] * 8
    assert s.extrapolator.op_batch() == 8 / 2 / 2  # a replica's batch over its micro-batches


# -- interleaving ----------------------------------------------------------------------------
@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_cuts_the_bubble_by_v(v):
    # S = 4 stages, M = 8 micro-batches of 1 sample (batch 8), S * v equal layers, t_f = 1 ms
    # and t_b = 2 ms per layer at batch 8, so f = 1/8 ms and b = 2/8 ms per layer and
    # micro-batch; free network, no optimizer.
    # 1F1B, a stage of v layers: F = v f, B = v b; every stage is busy M (F + B); the first
    # micro-batch reaches the last stage after (S - 1) F and its gradient comes back after
    # (S - 1) B, so T = (M + S - 1)(F + B) = M v (f + b) + (S - 1) v (f + b).
    # Interleaved, a chunk of one layer: every stage is busy M v (f + b); the fill and drain
    # are (S - 1) chunk-steps each way: T = M v (f + b) + (S - 1)(f + b): the bubble / v.
    S, M = 4, 8
    f, b = 1e-3 / 8, 2e-3 / 8
    t = chain_trace(layers=S * v, t_opt=0, batch=8)
    onefb = t_iter(t, S, "3d", pp=S, microbatches=M, schedule="1f1b")
    inter = t_iter(t, S, "3d", pp=S, microbatches=M, schedule="interleaved", virtual_stages=v)
    assert onefb == pytest.approx(M * v * (f + b) + (S - 1) * v * (f + b), rel=1e-9)
    assert inter == pytest.approx(M * v * (f + b) + (S - 1) * (f + b), rel=1e-9)
    # the interleaved mode is the same plan
    mode = t_iter(t, S, "interleaved", microbatches=M, virtual_stages=v)
    assert mode == pytest.approx(inter, rel=1e-12)


def test_interleaved_order_is_megatrons():
    # S = 2, v = 2, M = 4: stage 0 warms up (2 - 0 - 1) * 2 + (2 - 1) * 2 = 4 chunk-steps:
    # micro-batches 0, 1 through chunk 0, then 0, 1 through chunk 1
    seq = schedule("interleaved")(0, 2, 4, 2)
    assert seq[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    # then 1F1B: backward starts with the last chunk
    assert seq[4:6] == [("F", 2, 0), ("B", 0, 1)]
    last = schedule("interleaved")(1, 2, 4, 2)
    assert last[:3] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1)]  # warm-up (v - 1) * S = 2
    for s in (0, 1):
        steps = schedule("interleaved")(s, 2, 4, 2)
        assert sorted(steps) == sorted((k, m, j) for k in "FB" for m in range(4) for j in (0, 1))


def test_a_registered_schedule_is_used_by_name():
    @register_schedule("test-gpipe-reversed")
    def backwards_first_in_order(s, S, M, v):
        return [("F", m, 0) for m in range(M)] + [("B", m, 0) for m in range(M)]

    try:
        t = chain_trace(layers=8, t_opt=0)
        got = t_iter(t, 4, "3d", pp=4, microbatches=4, schedule="test-gpipe-reversed")
        want = t_iter(t, 4, "gpipe", microbatches=4)
        assert got == pytest.approx(want, rel=1e-9)  # same time on equal stages
    finally:
        SCHEDULES.pop("test-gpipe-reversed")


# -- 1F1B against GPipe ----------------------------------------------------------------------------
def test_1f1b_takes_gpipes_time_on_equal_stages_with_a_lower_activation_peak():
    # 2 stages of 2 layers, M = 8; T = (M + S - 1)(F + B) for both, F = 2 f, B = 2 b with
    # f = 1/8 ms, b = 2/8 ms: 9 x 6/8 ms. Memory (as the pipeline modes): GPipe's stage 0
    # keeps the saved activations of all 8 micro-batches plus one gradient: 17 units;
    # 1F1B at most S = 2 micro-batches in flight.
    unit = 8e6 / 8
    t = chain_trace(batch=8, act_bytes=8e6, layers=4, t_opt=0)
    g = sim(t, 2, "3d", pp=2, microbatches=8, schedule="gpipe").run()
    o = sim(t, 2, "3d", pp=2, microbatches=8, schedule="1f1b").run()
    assert g.iteration_time == pytest.approx(9 * 6e-3 / 8, rel=1e-9)
    assert o.iteration_time == pytest.approx(9 * 6e-3 / 8, rel=1e-9)
    peak = {r: m[m.gpu == 0]["activations"].max() for r, m in (("g", g.memory), ("o", o.memory))}
    assert peak["g"] == pytest.approx(17 * unit)
    assert peak["o"] <= 5 * unit
