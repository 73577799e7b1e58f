"""DualPipeV (`schedule: dualpipev`): DeepSeek's V-shaped pipeline (dualpipe/dualpipev.py
in deepseek-ai/DualPipe): stage s holds model chunks s and 2S - 1 - s, micro-batches enter at
stage 0 and come back to it, some backwards leave their weight gradients to a later W step,
and its forward-backward pairs overlap their all-to-alls with `ep_comm_overlap`. Checked: the order and the placement by hand, every step once
(hypothesis), the iteration by hand and against a schedule walked step by step outside the
simulator, no send at the turn, the pairs it overlaps, the refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extrapolators.modes.mesh.template import A2A, EPSTART, EPWAIT, SIGNAL, Template, paired
from extrapolators.modes.schedules import (
    Placement,
    overlapped,
    placement_of,
    schedule,
    split_steps,
)
from tests.conftest import chain_trace
from tests.test_expert_parallel import moe_trace
from triosim import Simulation
from triosim.common.errors import ConfigError

FREE = {"kind": "ring", "bandwidth": 1e30, "latency": 0.0}  # a free network


def run(trace, S, M, name="dualpipev", v=2, **par):
    cfg = {
        "num_gpus": S,
        "parallelism": {"mode": "3d", "pp": S, "microbatches": M, "schedule": name,
                        "virtual_stages": v, **par},
        "topology": FREE,
        "communication": {"kind": "textbook"},
    }  # fmt: skip
    with pytest.warns(Warning):  # (the free network's implausible bandwidth)
        return Simulation(cfg, trace=trace).run()


def test_the_order_is_dualpipevs_by_hand():
    """S = 2, M = 4 (the repository's phases: 1 nF0, 2 nF0F1, 3 nB1W1F1, 4 nF0B1F1B0, 5
    nB1F1B0, 6 nB1B0 (its later half zero-bubble), 7 nWB0, 8 nW; a zero-bubble B leaves
    its W to the next W step, oldest first). Stage 0: F0 x 2 (S - s - 1 = 1, twice), F0 F1,
    B1 W1 F1, then (M - 2S + s + 1 = 1) F0 B1 F1 B0, B1 F1 B0, B1 B0 (the B0 zero-bubble:
    i = (s + 1) // 2 = 0 on an even stage, after its B1), W B0, W. Stage 1 (the last): no
    warm-up, F0 F1 twice, then twice F0 B1 F1 B0 (the first F0 B1 not overlapped), B1 B0
    twice (the second pair zero-bubble: i = 1 on an odd stage, before its B1), their two
    Ws. Overlapped pairs: F0 with B1, F1 with B0."""
    s0 = schedule("dualpipev")(0, 2, 4, 2)
    want0 = (
        "F0.0 F0.1 F0.2 F1.0 B1.0 W1.0 F1.1 F0.3 B1.1 F1.2 B0.0 B1.2 F1.3 B0.1 B1.3 B0.2 "
        "W0.2 B0.3 W0.3"
    )
    assert " ".join(f"{k}{j}.{m}" for k, m, j in s0) == want0
    assert overlapped("dualpipev", 0, 2, 4, 2) == {7, 9, 12}
    s1 = schedule("dualpipev")(1, 2, 4, 2)
    want1 = (
        "F0.0 F1.0 F0.1 F1.1 F0.2 B1.0 F1.2 B0.0 F0.3 B1.1 F1.3 B0.1 B1.2 B0.2 B1.3 B0.3 W1.3 W0.3"
    )
    assert " ".join(f"{k}{j}.{m}" for k, m, j in s1) == want1
    assert overlapped("dualpipev", 1, 2, 4, 2) == {6, 8, 10}


def test_the_v_placement_by_hand():
    """Four stages, eight chunks: stage 0 holds 0 and 7, stage 3 holds 3 and 4 (the turn);
    the loop placement (Megatron's interleaving) holds j x S + s."""
    v = placement_of("dualpipev", 4, 2)
    assert [v.stage_chunks(s) for s in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [v.stage(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    loop = placement_of("interleaved", 4, 2)
    assert [loop.stage_chunks(s) for s in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def check_steps(steps, M, v):
    """Each forward and backward (micro-batch, local chunk) once; a W at most once, after
    its B."""
    fb = [x for x in steps if x[0] != "W"]
    assert sorted(fb) == sorted((k, m, j) for k in "FB" for m in range(M) for j in range(v))
    at = {step: i for i, step in enumerate(steps)}
    assert len(at) == len(steps)
    assert all(at["B", m, j] < i for (k, m, j), i in at.items() if k == "W")
    return at


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(0, 6), st.sampled_from(["loop", "v"]))
def test_every_step_once_and_placement_inverts(S, extra, shape):
    """Every stage runs each forward and backward once, a W at most once and after its B;
    a chunk's stage holds it; each micro-batch's chunk-1 forward comes after its chunk-0
    forward and its chunk-0 backward after its chunk-1 backward on the last stage (the
    turn needs no send: the stream's order is the dependency)."""
    M = 2 * S + extra
    p = Placement(S, 2, shape)
    for c in range(2 * S):
        assert c in p.stage_chunks(p.stage(c))
    for s in range(S):
        steps = schedule("dualpipev")(s, S, M, 2)
        at = check_steps(steps, M, 2)
        pairs = overlapped("dualpipev", s, S, M, 2)
        assert all(steps[k][0] != steps[k + 1][0] for k in pairs)  # a forward with a backward
        if s == S - 1:
            for m in range(M):
                assert at["F", m, 0] < at["F", m, 1] and at["B", m, 1] < at["B", m, 0]


def walked(S, M, f, b, w=0.5, name="dualpipev", v=2) -> float:
    """The iteration of a schedule walked step by step, outside the simulator: each step
    starts when its stage is free and the step it needs has ended (a chunk's forward: the
    chunk before's forward of the micro-batch; its backward: the chunk after's backward,
    or its own forward for the last chunk; a W: its own B); a free network. A backward
    takes b, or b (1 - w) where a W step takes the other b w."""
    p, C = placement_of(name, S, v), S * v
    orders = [schedule(name)(s, S, M, v) for s in range(S)]
    splits = [split_steps(o)[0] for o in orders]
    done, free, pos = {}, [0.0] * S, [0] * S
    while any(pos[s] < len(orders[s]) for s in range(S)):
        moved = False
        for s in range(S):
            while pos[s] < len(orders[s]):
                kind, m, j = orders[s][pos[s]]
                c = p.chunk(s, j)
                if kind == "F":
                    need, t = (("F", m, c - 1) if c > 0 else None), f
                elif kind == "B":
                    need = ("B", m, c + 1) if c < C - 1 else ("F", m, c)
                    t = b * (1 - w) if (m, j) in splits[s] else b
                else:
                    need, t = ("B", m, c), b * w
                if need is not None and need not in done:
                    break
                start = max(free[s], done.get(need, 0.0))
                free[s] = done[kind, m, c] = start + t
                pos[s] += 1
                moved = True
        assert moved, "the schedule waits on itself"
    return max(free)


def test_the_iteration_by_hand():
    """S = 2, M = 4, one layer a chunk (f = 1/4 ms forward, b = 2/4 ms backward per
    micro-batch of one sample, half of it the weight's gradient: the layers are products
    of a weight; a free network). Walked by hand in units of f: stage 0 runs F c0 m0-2 to
    3; stage 1 F c1 m0 [1, 2], F c2 m0 [2, 3], ...; stage 0 F c3 m0 [3, 4], its B (input
    only) [4, 5], W [5, 6], F c3 m1 [6, 7], F c0 m3 [7, 8], B c3 m1 [8, 10], ...; stage 1's
    last B c2 m3 and B c1 m3 are input-only [21, 22], [22, 23], its Ws [23, 25]; stage 0's
    B c0 m2 [21, 22], W [22, 23], B c0 m3 (needs B c1 m3: 23) [23, 24], W [24, 25]. 25 f =
    6.25 ms: less than the interleaved schedule of the same four chunks (M v (f + b) + (S -
    1)(f + b) = 27 f) and 1F1B's (M + S - 1)(F + B) = 30 f."""
    t = chain_trace(layers=4, t_opt=0, batch=4)
    f = 1e-3 / 4
    assert walked(2, 4, f, 2 * f) == pytest.approx(25 * f, rel=1e-12)
    assert run(t, 2, 4).iteration_time == pytest.approx(25 * f, rel=1e-9)
    assert run(t, 2, 4, "interleaved").iteration_time == pytest.approx(27 * f, rel=1e-9)
    assert run(t, 2, 4, "1f1b", v=1).iteration_time == pytest.approx(30 * f, rel=1e-9)


@settings(max_examples=8, deadline=None)
@given(st.integers(2, 4), st.integers(0, 3))
def test_the_iteration_is_the_walked_schedule(S, extra):
    """Any depth and micro-batch count: the simulated iteration is the walked one, and
    every micro-batch crosses 2S - 2 stage boundaries each way (2S - 1 between chunks, one
    of them inside the last stage: no send there)."""
    M = 2 * S + extra
    t = chain_trace(layers=2 * S, t_opt=0, batch=M)
    f = 1e-3 / M
    r = run(t, S, M)
    assert r.iteration_time == pytest.approx(walked(S, M, f, 2 * f), rel=1e-9)
    sends = r.timeline[r.timeline["name"].str.startswith("send to")]
    assert len(sends) == 2 * (2 * S - 2) * M


def test_pairs_named_by_the_schedule_are_the_ones_merged():
    """With `pairs`, `paired` merges exactly the steps named (a forward with the backward
    after it, the forward's segments first), not the 1F1B steady state's backward with the
    forward after it."""
    f1, b1 = (A2A, "l0", "dispatch"), (A2A, "l1", "combine-grad")
    steps = [["B"], ["Y1", f1, "Y2", (SIGNAL, "F")], ["X1", b1, "X2", (SIGNAL, "B")], ["Z"]]
    order = [("B", 0, 1), ("F", 3, 0), ("B", 1, 1), ("F", 2, 1)]
    out = Template()
    got = list(paired(steps, order, out, pairs={1}))
    assert got[0] == ["B"] and got[2] == ["Z"]
    assert got[1] == [
        "Y1", (EPSTART, 0), "X1", (EPSTART, 1), (EPWAIT, 0), "Y2", (SIGNAL, "F"), (EPWAIT, 1),
        "X2", (SIGNAL, "B"),
    ]  # fmt: skip
    assert out.ep_side == [f1, b1]


def moe(overlap: bool, S=2, M=4):
    cfg = {
        "num_gpus": 2 * S,
        "batch_size": 4 * M,
        "parallelism": {
            "mode": "mesh", "pp": S, "dp_replicate": 2, "ep": 2, "microbatches": M,
            "schedule": "dualpipev", "virtual_stages": 2, "ep_comm_overlap": overlap,
        },
        "topology": {"kind": "fully_connected", "bandwidth": 1e9, "latency": 1e-6},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "trace"},
    }  # fmt: skip
    return Simulation(cfg, trace=moe_trace(layers=4 * S, experts=2)).run()


def test_overlapped_pairs_keep_the_work_and_hide_all_to_alls():
    """An MoE model, EP 2, DualPipeV with and without ep_comm_overlap: the same compute
    tasks and all-to-alls; with it some all-to-all runs on the ep stream beside compute,
    and the iteration is shorter."""
    r, base = moe(True), moe(False)
    key = ["gpu", "name", "layer", "phase", "microbatch"]
    tl, bt = r.timeline, base.timeline
    work = tl[tl["kind"] == "compute"][key].sort_values(key).reset_index(drop=True)
    assert work.equals(bt[bt["kind"] == "compute"][key].sort_values(key).reset_index(drop=True))
    assert (tl["name"] == "all_to_all").sum() == (bt["name"] == "all_to_all").sum()
    assert ((tl["name"] == "all_to_all") & (tl["stream"] == "ep")).any()
    assert r.iteration_time < base.iteration_time


@pytest.mark.parametrize(
    "par, field",
    [
        ({"virtual_stages": 1}, "parallelism.virtual_stages"),
        ({"virtual_stages": 4}, "parallelism.virtual_stages"),
        ({"microbatches": 3}, "parallelism.microbatches"),
    ],
)
def test_refusals_name_the_field(par, field):
    t = chain_trace(layers=8, t_opt=0, batch=8)
    cfg = {"pp": 2, "microbatches": 4, "virtual_stages": 2, **par}
    with pytest.raises(ConfigError) as e:
        Simulation(
            {"num_gpus": 2, "parallelism": {"mode": "3d", "schedule": "dualpipev", **cfg}},
            trace=t,
        ).run()
    assert e.value.field == field
