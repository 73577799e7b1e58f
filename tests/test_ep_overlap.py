"""EP all-to-all overlap (`parallelism.ep_comm_overlap`, Megatron's combined 1F1B): a
steady-state backward step runs with the forward step after it, each one's all-to-alls on
the GPU's "ep" stream beside the other's compute (extrapolators/modes/mesh/template.py,
`paired`). Checked: the merged order by hand, dependencies kept on the timeline, the same
work and bytes as without it, and the refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extrapolators.modes.mesh.template import (
    A2A,
    EPSTART,
    EPWAIT,
    RECV,
    SIGNAL,
    Template,
    paired,
)
from tests.test_ep_tp import trace
from tests.test_expert_parallel import moe_trace
from triosim import Simulation
from triosim.common.errors import ConfigError


def test_a_backward_and_the_next_forward_interleave_by_hand():
    """B: recv, X1, a2a b1, X2, a2a b2, X3, signal; F: recv, Y1, a2a f1, Y2, signal. Both
    receives first; then X1, start b1, Y1, start f1, wait b1, X2, start b2, wait f1, Y2,
    F's signal, wait b2, X3, B's signal; the ep stream runs b1, f1, b2. A lone forward (a
    warm-up) stays as it is."""
    rb, rf = (RECV, 1, "grad", "backward"), (RECV, 0, "act", "forward")
    b1, b2, f1 = (A2A, "l1", "combine-grad"), (A2A, "l0", "dispatch-grad"), (A2A, "l0", "x")
    sb, sf = (SIGNAL, "B0.0"), (SIGNAL, "F2.0")
    warm = ["W"]
    steps = [warm, [rb, "X1", b1, "X2", b2, "X3", sb], [rf, "Y1", f1, "Y2", sf]]
    order = [("F", 1, 0), ("B", 0, 0), ("F", 2, 0)]
    out = Template()
    got = list(paired(steps, order, out))
    assert got[0] == warm
    assert got[1] == [
        rb, rf, "X1", (EPSTART, 0), "Y1", (EPSTART, 1), (EPWAIT, 0), "X2", (EPSTART, 2),
        (EPWAIT, 1), "Y2", sf, (EPWAIT, 2), "X3", sb,
    ]  # fmt: skip
    assert out.ep_side == [b1, f1, b2]


def run(overlap: bool, S=2, v=2, M=4, dp="dp_replicate"):
    cfg = {
        "num_gpus": 2 * S,
        "batch_size": 4 * M,
        "parallelism": {
            "mode": "mesh", "pp": S, dp: 2, "ep": 2, "microbatches": M,
            "schedule": "interleaved", "virtual_stages": v, "ep_comm_overlap": overlap,
        },
        "topology": {"kind": "fully_connected", "bandwidth": 1e9, "latency": 1e-6},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "trace"},
    }  # fmt: skip
    return Simulation(cfg, trace=moe_trace(layers=2 * S * v, experts=2)).run()


def test_the_experts_still_wait_for_their_tokens_and_the_work_is_the_same():
    """On the timeline: each expert operator starts after the all-to-all that brings its
    micro-batch's tokens (the dispatch forward, the combine's gradient backward) has ended
    and before the one after it starts; some all-to-all on the ep stream runs beside a
    compute task of the same GPU (the overlap). The same operators, all-to-alls and bytes
    as without the overlap, and here a shorter iteration (the all-to-alls take as long as
    the experts)."""
    r, base = run(True), run(False)
    tl = r.timeline
    for g in range(4):
        mine = tl[tl["gpu"] == g]
        a2a = mine[mine["name"] == "all_to_all"]
        assert set(a2a["stream"]) == {"ep", "compute"}  # paired steps' and lone steps'
        experts = mine[(mine["kind"] == "compute") & mine["layer"].str.endswith("experts")]
        for _, op in experts.iterrows():
            m, layer = int(op["microbatch"]), op["layer"]
            before = "dispatch" if op["phase"] == "forward" else "combine-grad"
            after = "combine" if op["phase"] == "forward" else "dispatch-grad"
            own = a2a[a2a["key"].str.contains(f":m{m}:{layer}:", regex=False)]
            first = own[own["key"].str.endswith(f":{before}")]
            then = own[own["key"].str.endswith(f":{after}")]
            assert len(first) == 1 and len(then) == 1
            assert first["end"].iloc[0] <= op["start"] + 1e-12
            assert then["start"].iloc[0] >= op["end"] - 1e-12
        compute = mine[mine["kind"] == "compute"]
        side = a2a[a2a["stream"] == "ep"]
        assert any(
            ((compute["start"] < e) & (compute["end"] > s)).any()
            for s, e in zip(side["start"], side["end"], strict=True)
        )
    key = ["gpu", "name", "layer", "phase", "microbatch"]
    work = tl[tl["kind"] == "compute"][key].sort_values(key).reset_index(drop=True)
    base_work = base.timeline[base.timeline["kind"] == "compute"][key]
    assert work.equals(base_work.sort_values(key).reset_index(drop=True))
    assert (tl["name"] == "all_to_all").sum() == (base.timeline["name"] == "all_to_all").sum()
    assert r.per_link()["nbytes"].sum() == pytest.approx(base.per_link()["nbytes"].sum())
    assert r.iteration_time < base.iteration_time


@pytest.mark.parametrize(
    "par",
    [
        {"pp": 1, "dp_replicate": 4, "ep": 2, "microbatches": 2},  # no pipeline
        {"pp": 2, "dp_replicate": 2, "ep": 1, "microbatches": 2},  # no all-to-all
        {"pp": 2, "dp_replicate": 2, "ep": 2, "microbatches": 2, "schedule": "gpipe"},
    ],
)
def test_overlap_without_paired_all_to_alls_is_refused(par):
    cfg = {
        "num_gpus": 4,
        "batch_size": 2 * 2 * par["dp_replicate"],  # the traced 2 a micro-batch
        "parallelism": {"mode": "mesh", "ep_comm_overlap": True, **par},
        "perfmodel": {"kind": "trace"},
        "topology": {"kind": "fully_connected", "bandwidth": 1e9},
    }
    with pytest.raises(ConfigError) as e:
        Simulation(cfg, trace=moe_trace(layers=4, experts=2))
    assert e.value.field == "parallelism.ep_comm_overlap"


def test_with_fsdp_the_gathers_follow_the_merged_order():
    """FSDP x EP x PP: the gather stream gathers each unit one entry ahead of the compute,
    in the order the compute enters them; merged steps enter units in a new order, and
    the gathers follow it (in the old order the run stalled: the compute waited for a
    unit the gather stream would fetch only after one the compute had not reached). The
    same operators and all-gathers as without the overlap."""
    r, base = run(True, dp="dp_shard"), run(False, dp="dp_shard")
    for res in (r, base):
        assert (res.timeline["name"] == "all_gather").sum() > 0
    key = ["gpu", "name", "layer", "phase", "microbatch"]
    work = r.timeline[r.timeline["kind"] == "compute"][key].sort_values(key)
    base_work = base.timeline[base.timeline["kind"] == "compute"][key].sort_values(key)
    assert work.reset_index(drop=True).equals(base_work.reset_index(drop=True))
    gathers = r.timeline[r.timeline["name"] == "all_gather"]
    assert len(gathers) == (base.timeline["name"] == "all_gather").sum()


@settings(max_examples=10, deadline=None)
@given(
    tp=st.sampled_from([1, 2]),
    shard=st.booleans(),
    schedule=st.sampled_from(["1f1b", "interleaved"]),
    recompute=st.sampled_from(["none", "full"]),
    accumulation=st.sampled_from([1, 2]),
    tp_overlap=st.booleans(),
)
def test_random_layouts_finish_with_the_same_work(
    tp, shard, schedule, recompute, accumulation, tp_overlap
):
    """Over random layouts (TP with or without its overlap, FSDP or replicas, 1F1B or
    interleaved, recomputation, accumulation) the overlap never stalls a run (the runtime
    raises on work left over) and runs the same operators and collectives."""
    S, M = 2, 4
    par = {
        "mode": "mesh",
        "pp": S,
        "tp": tp,
        ("dp_shard" if shard else "dp_replicate"): 2,
        "ep": 2,
        "microbatches": M,
        "accumulation": accumulation,
        "schedule": schedule,
        "virtual_stages": 2 if schedule == "interleaved" else 1,
        "recompute": recompute,
        "sequence_parallel": tp > 1,
        "tp_comm_overlap": tp_overlap and tp > 1,
    }
    if schedule == "interleaved" and accumulation > 1:
        par["microbatches"] = 2 * S * accumulation  # each schedule a multiple of S
    got = {}
    for overlap in (False, True):
        cfg = {
            "num_gpus": 2 * S * tp,
            "batch_size": 2 * par["microbatches"],
            "parallelism": {**par, "ep_comm_overlap": overlap},
            "topology": {"kind": "fully_connected", "bandwidth": 1e9, "latency": 1e-6},
            "communication": {"kind": "textbook"},
            "perfmodel": {"kind": "roofline"},
        }
        tl = Simulation(cfg, trace=trace(layers=2 * S * 2, experts=2)).run().timeline
        key = ["gpu", "kind", "name", "layer", "phase"]
        got[overlap] = tl[tl["kind"].isin(["compute", "comm"])][key].value_counts().to_dict()
    assert got[True] == got[False]


def shared_run(overlap: bool, **extra):
    cfg = {
        "num_gpus": 2,
        "batch_size": 4,
        # (gradients reduced after the backward pass: no all-reduce sharing the links)
        "parallelism": {"mode": "mesh", "dp_replicate": 2, "ep": 2, "dp_overlap": False,
                        "shared_expert_overlap": overlap, **extra},
        "topology": {"kind": "fully_connected", "bandwidth": 10e9, "latency": 2e-6},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "trace"},
    }  # fmt: skip
    return Simulation(cfg, trace=moe_trace(shared=(2e-3, 3e-3))).run()


def test_shared_experts_beside_the_dispatch_by_hand():
    """2 GPUs, EP 2, top-1: each all-to-all sends half a GPU's tokens, a = T x TB / 2 / B + L
    (0.42 ms). The shared expert (2 ms forward, 3 ms backward) runs while the dispatch (and,
    backward, the combine's gradient) crosses: each of those all-to-alls leaves the
    compute stream's path, 2a shorter in all; the combine and the dispatch's gradient stay
    in line. The same operators either way."""
    from tests.test_expert_parallel import TB, T

    a = T * TB / 2 / 10e9 + 2e-6
    base, r = shared_run(False), shared_run(True)
    assert base.iteration_time - r.iteration_time == pytest.approx(2 * a, rel=1e-9)
    tl = r.timeline
    side = tl[(tl["stream"] == "ep") & (tl["name"] == "all_to_all") & (tl["gpu"] == 0)]
    assert sorted(side["key"].str.rsplit(":", n=1).str[-1]) == ["combine-grad", "dispatch"]
    shared = tl[(tl["gpu"] == 0) & tl["layer"].str.endswith("shared_experts")]
    for _, s in side.iterrows():  # each beside the shared expert of its phase
        phase = "backward" if s["key"].endswith("combine-grad") else "forward"
        mine = shared[shared["phase"] == phase]
        assert mine["start"].iloc[0] == pytest.approx(s["start"])
    key = ["gpu", "name", "layer", "phase"]
    assert (
        tl[tl["kind"] == "compute"][key].value_counts().to_dict()
        == base.timeline[base.timeline["kind"] == "compute"][key].value_counts().to_dict()
    )


@pytest.mark.parametrize(
    "extra, trace_shared",
    [({}, False), ({"ep_comm_overlap": True, "pp": 2, "microbatches": 2}, True)],
)
def test_shared_overlap_needs_shared_experts_and_not_the_ep_overlap(extra, trace_shared):
    cfg = {
        "num_gpus": 4 if extra else 2,
        "batch_size": 8 if extra else 4,  # the traced 2 a micro-batch
        "parallelism": {"mode": "mesh", "dp_replicate": 2, "ep": 2,
                        "shared_expert_overlap": True, **extra},
        "perfmodel": {"kind": "trace"},
        "topology": {"kind": "fully_connected", "bandwidth": 1e9},
    }  # fmt: skip
    trace = moe_trace(layers=2, shared=(1e-3, 1e-3) if trace_shared else None)
    with pytest.raises(ConfigError) as e:
        Simulation(cfg, trace=trace)
    assert e.value.field == "parallelism.shared_expert_overlap"


@settings(max_examples=8, deadline=None)
@given(
    pp=st.sampled_from([1, 2]),
    shard=st.booleans(),
    recompute=st.sampled_from(["none", "full"]),
    layers=st.sampled_from([2, 4]),
)
def test_shared_overlap_on_random_layouts_finishes_with_the_same_work(pp, shard, recompute, layers):
    got = {}
    for overlap in (False, True):
        cfg = {
            "num_gpus": 2 * pp,
            "batch_size": 8,
            "parallelism": {
                "mode": "mesh", "pp": pp, ("dp_shard" if shard else "dp_replicate"): 2,
                "ep": 2, "microbatches": 2, "recompute": recompute,
                "shared_expert_overlap": overlap,
            },
            "topology": {"kind": "fully_connected", "bandwidth": 1e9, "latency": 1e-6},
            "communication": {"kind": "textbook"},
            "perfmodel": {"kind": "roofline"},
        }  # fmt: skip
        tl = Simulation(cfg, trace=moe_trace(layers=layers, shared=(1e-3, 2e-3))).run().timeline
        key = ["gpu", "kind", "name", "layer", "phase"]
        got[overlap] = tl[tl["kind"].isin(["compute", "comm"])][key].value_counts().to_dict()
    assert got[True] == got[False]


def test_a_gradient_bucket_is_reduced_after_the_shared_experts_backward():
    """With DDP's buckets (one a weight here), the shared expert's gradient bucket is
    signalled after its backward operator: moving the combine's gradient beside the
    shared expert must not move the signal ahead of the operator (it did: the bucket was
    all-reduced while its gradient was still being computed)."""
    r = shared_run(True, dp_overlap=True, bucket_size=4e6, first_bucket_size=4e6)
    tl = r.timeline
    g0 = tl[tl["gpu"] == 0]
    shared = g0[g0["layer"].str.endswith("shared_experts") & (g0["phase"] == "backward")]
    reduced = g0[(g0["name"] == "allreduce") & (g0["stream"] == "dp")]
    assert len(reduced) > 0
    assert reduced["start"].min() >= shared["end"].max() - 1e-12
