"""Expert parallelism on the mesh (extrapolators/modes/mesh/experts.py): the expert mesh
folded out of each stage's GPUs as Megatron-Core folds it, the layouts that had no form
before (context parallelism with EP, FSDP with EP and pipeline stages), mode ep as the mesh
it stands for, and symmetric runs equal to exact ones."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extrapolators.modes.mesh.dims import Mesh
from extrapolators.modes.mesh.experts import ExpertMesh
from tests.test_ep_tp import EXPERT, ROUTER, WO, WQ, B, L, trace
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation

MIXTRAL = str(
    Path(__file__).resolve().parents[1]
    / "traces/modelled/h100-sxm/mixtral-8x7b-s4096-b1.trace.json.gz"
)


def run(tr, n, par, batch=None, symmetry="off"):
    cfg = {
        "num_gpus": n,
        "batch_size": batch or n,
        "parallelism": par,
        "topology": {"kind": "fully_connected", "bandwidth": B, "latency": L},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "roofline"},
        "memory": {"precision": "mixed", "optimizer": "adam"},
        "symmetry": symmetry,
    }
    if isinstance(tr, str):
        cfg["trace"], tr = tr, None
    sim = Simulation(cfg, trace=tr)
    return sim, sim.run()


# -- the fold --------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    shape=st.tuples(*[st.sampled_from([1, 2, 3]) for _ in range(5)]),
    data=st.data(),
)
def test_the_expert_mesh_regroups_each_stage_as_megatron_core_does(shape, data):
    """Megatron-Core's expert rank generator ("tp-ep-dp" over a stage's s GPUs, numbered in
    the dense order tp, cp, dp): local index i has expert-TP rank i % etp, EP rank (i //
    etp) % ep, expert-DP rank i // (etp x ep). So the EP groups, expert-TP groups and
    expert replicas each partition every stage, into groups of ep, etp and s / (ep x etp)
    GPUs, and two GPUs share an EP group exactly when they share both other ranks."""
    mesh = Mesh(*shape)
    s = mesh.stage_size
    divisors = [(e, t) for e in range(1, s + 1) for t in range(1, s + 1) if s % (e * t) == 0]
    ep, etp = data.draw(st.sampled_from(divisors))
    fold = ExpertMesh(mesh, ep, etp)
    stages = {
        p: [x for x in itertools.product(*map(range, shape)) if x[0] == p] for p in range(shape[0])
    }
    for p, xs in stages.items():
        assert sorted(mesh.local(x) for x in xs) == list(range(s))
        assert all(mesh.from_local(p, mesh.local(x)) == x for x in xs)
        for which, size in (("ep_group", ep), ("etp_group", etp), ("edp_group", s // (ep * etp))):
            groups = {getattr(fold, which)(x) for x in xs}
            assert all(len(g) == size for g in groups)
            assert sorted(y for g in groups for y in g) == sorted(xs)  # a partition
        for x, y in itertools.combinations(xs, 2):
            (tx, _, dx), (ty, _, dy) = fold.ranks(x), fold.ranks(y)
            assert (y in fold.ep_group(x)) == (tx == ty and dx == dy)
            i = mesh.local(x)
            assert fold.ranks(x) == (i % etp, i // etp % ep, i // (etp * ep))


# -- layouts that had no form before ----------------------------------------------------------
@pytest.mark.no_cover
def test_context_parallelism_with_expert_parallelism_by_hand():
    """Mixtral 8x7B (shape-only trace: 32 MoE layers, top-2, hidden 4096, bf16 dispatch) on
    4 GPUs as cp 2 x dp_replicate 2 with ep 4: a replica's sequence (batch 2 over 2
    replicas) is split over its 2 CP ranks, so each GPU routes 4096 / 2 = 2048 tokens to 2
    experts each: its all-to-all buffer is 2048 x 2 x 4096 x 2 = 33,554,432 bytes, 4 per MoE
    layer (dispatch, combine and their gradients) over an EP group of all 4 GPUs (EP folds
    out of the CP and data-parallel GPUs); ring attention runs over each CP pair."""
    sim, r = run(MIXTRAL, 4, {"mode": "mesh", "cp": 2, "dp_replicate": 2, "ep": 4}, batch=2)
    tl = r.timeline
    a2a = tl[(tl.gpu == 0) & (tl.name == "all_to_all")]
    assert len(a2a) == 4 * 32
    assert a2a["nbytes"].to_numpy() == pytest.approx(2048 * 2 * 4096 * 2)
    for key in set(a2a.key):
        assert set(tl[tl.key == key].gpu) == {0, 1, 2, 3}
    assert sim.extrapolator.expert_group(0, "ep") == (0, 1, 2, 3)
    cp = tl[(tl.gpu == 0) & (tl.stream == "cp") & (tl.kind == "comm")]
    assert len(cp) > 0 and set(cp.name) == {"send to 1"}
    assert "cp 2" in sim.extrapolator.describe() and "ep 4" in sim.extrapolator.describe()


def test_fsdp_with_experts_and_pipeline_stages_by_hand():
    """FSDP x EP x PP (refused before): mode ep's fsdp with pp 2 on 8 GPUs (4 per stage:
    dp_shard 4, ep 2, so each expert has 2 replicas). GPU 0 (stage 0, layers.0: units
    attention (wq, wo) and feed_forward (router, experts)) gathers the dense part of each
    unit over its stage's 4 GPUs and the experts' part (EXPERT / 2 layers / 2 EP ranks
    held) over its replicas {0, 2}; after the last micro-batch it reduce-scatters each part
    once, over the same groups: wq + wo, the router, the experts' EXPERT / 4. It keeps 1/4
    of the dense weights and 1/2 of its experts'."""
    sim, r = run(
        trace(layers=2, experts=2),
        8,
        {
            "mode": "ep",
            "pp": 2,
            "ep": 2,
            "fsdp": True,
            "wrap_depth": 3,  # units: layers.N.attention, layers.N.feed_forward
            "accumulation_steps": 2,
        },
        batch=8,
    )
    tl = r.timeline
    fsdp = tl[(tl.kind == "comm") & tl.key.astype(str).str.startswith("fsdp:")]
    g0 = fsdp[fsdp.gpu == 0]
    scatters = g0[g0.name == "reduce_scatter"]
    assert sorted(scatters.nbytes) == pytest.approx(sorted([WQ + WO, ROUTER, EXPERT / 4]))
    for key, rows in fsdp.groupby("key"):
        members = set(rows.gpu)
        assert members == ({0, 2} if "experts" in key else {0, 1, 2, 3}) or 0 not in members
    ex = sim.extrapolator
    assert ex.expert_group(0, "edp") == (0, 2) and ex.expert_group(4, "edp") == (4, 6)
    keep = (ROUTER + WQ + WO) / 4 + EXPERT / 4 / 2
    assert ex.held_weight_bytes(0) == pytest.approx(keep)
    mem = r.memory[r.memory.gpu == 0]
    assert mem["optimizer_states"].max() == pytest.approx(6 * keep)


# -- mode ep is its mesh ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ep_fields, mesh_fields",
    [
        ({"ep": 2}, {"dp_replicate": 8, "ep": 2}),
        (
            {"ep": 2, "tp": 2, "accumulation_steps": 2, "dp_overlap": True},
            {
                "dp_replicate": 4,
                "tp": 2,
                "ep": 2,
                "sequence_parallel": True,
                "microbatches": 2,
                "dp_overlap": True,
            },
        ),
        (
            {"ep": 2, "pp": 2, "distributed_optimizer": True, "overlap_param_gather": True},
            {
                "dp_replicate": 4,
                "pp": 2,
                "ep": 2,
                "distributed_optimizer": True,
                "overlap_param_gather": True,
            },
        ),
    ],
)
def test_mode_ep_is_the_mesh_it_stands_for(ep_fields, mesh_fields):
    """Each mode ep layout equals the general form written as the mesh: pp x dp x tp with
    ep (and etp) folded out of it, the timeline row for row."""
    tr = trace(layers=2, experts=4)
    _, a = run(tr, 8, {"mode": "ep", **ep_fields}, batch=8)
    mesh = {"mode": "mesh", "dp_shard": 1, "dp_overlap": False, **mesh_fields}  # ep's default
    _, b = run(tr, 8, mesh, batch=8)
    assert a.iteration_time == b.iteration_time
    assert a.timeline.equals(b.timeline)


def test_expert_degrees_are_checked_and_named():
    """ep x etp must divide a stage's GPUs, ep the experts; a trace without experts is
    refused for ep > 1 naming the field; HSDP with experts is refused."""
    tr = trace(layers=2, experts=4)
    with pytest.raises(ConfigError, match=r"parallelism\.ep.*ep x etp \(8 x 1\)"):
        run(tr, 4, {"mode": "mesh", "dp_replicate": 4, "ep": 8})
    with pytest.raises(ConfigError, match=r"parallelism\.ep.*4 experts"):
        run(tr, 6, {"mode": "mesh", "dp_replicate": 6, "ep": 3}, batch=6)
    from tests.conftest import chain_trace

    with pytest.raises(ConfigError, match=r"parallelism\.ep.*mixture-of-experts"):
        run(chain_trace(batch=4), 4, {"mode": "mesh", "dp_replicate": 4, "ep": 2})
    with pytest.raises(ConfigError, match=r"parallelism\.dp_replicate"):
        run(tr, 8, {"mode": "mesh", "dp_replicate": 2, "dp_shard": 4, "ep": 2}, batch=8)
    # mode ep's errors name its own fields (its micro-batches are accumulation_steps)
    bad = {"mode": "ep", "ep": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2}
    with pytest.raises(ConfigError, match=r"parallelism\.accumulation_steps' = 3"):
        run(tr, 8, {**bad, "accumulation_steps": 3}, batch=24)


@pytest.mark.parametrize(
    "par",
    [
        {"dp_replicate": 8, "ep": 4},
        {"dp_replicate": 4, "tp": 2, "ep": 2, "sequence_parallel": True},
        # TP inside EP (Megatron-Bridge's DeepSeek-V3 layout in small): local index
        # t + 2 r, EP rank (t + 2 r) % 4: digits t, r % 2, r // 2
        {"dp_replicate": 4, "tp": 2, "ep": 4, "sequence_parallel": True},
        {"dp_replicate": 4, "pp": 2, "ep": 2, "microbatches": 2},
        {"dp_shard": 8, "ep": 2},
        {"dp_replicate": 8, "ep": 4, "load": "skew", "skew": 1.5},
    ],
)
def test_a_symmetric_expert_run_is_the_exact_run(par):
    """Copies along every digit of the dense and expert meshes' common refinement (uniform
    loads: one representative a stage) or, with skewed loads, along all but EP's (each
    expert's replicas, TP, data parallelism) stand for the others: the iteration time is
    the exact run's."""
    tr = trace(layers=2, experts=4)
    mesh = {"mode": "mesh", "dp_shard": par.get("dp_shard", 1), **par}
    _, exact = run(tr, 8, mesh, batch=16)
    _, sym = run(tr, 8, mesh, batch=16, symmetry="auto")
    assert sym.iteration_time == pytest.approx(exact.iteration_time, rel=1e-12)
    if "load" not in par:
        pp = par.get("pp", 1)
        assert sym.symmetry == f"auto: {pp} representative{'s' * (pp > 1)} of 8 GPUs"
    else:  # dp_replicate 8 x EP 4: the EP rank's digit (4) stays, its replicas' (2) move
        assert sym.symmetry == "auto: 4 representatives of 8 GPUs"


@pytest.mark.parametrize(
    "par, field",
    [
        ({"mode": "ep", "ep": 2, "skew": 1.5}, "skew"),  # load uniform: skew unused
        ({"mode": "ep", "ep": 2, "expert_loads": [1, 2, 3, 4]}, "expert_loads"),
        ({"mode": "mesh", "dp_replicate": 4, "load": "skew"}, "load"),  # no experts
        ({"mode": "mesh", "dp_replicate": 4, "capacity_factor": 1.25}, "capacity_factor"),
        ({"mode": "mesh", "dp_replicate": 4, "reshard_after_forward": "always"}, "reshard"),
        ({"mode": "fsdp", "stage": 1, "reshard_after_forward": False}, "reshard"),
        ({"mode": "cp", "cp": 2, "reshard_after_forward": "never"}, "reshard"),
    ],
)
def test_a_field_without_effect_is_refused_naming_it(par, field):
    """Issue 44: fields the layout would ignore (expert loads without their load kind or
    without experts, FSDP's reshard policy without FSDP) are refused, naming the field."""
    from tests.conftest import chain_trace

    tr = trace(layers=2, experts=4) if par["mode"] == "ep" else chain_trace(batch=8)
    par = {**par, "dp_shard": 1} if par["mode"] == "mesh" else par
    with pytest.raises(ConfigError, match=rf"parallelism\.{field}"):
        run(tr, 4, par, batch=8)


def test_an_expert_product_is_timed_on_one_gpus_experts_by_the_learned_model():
    """Mixtral 8x7B on 8 GPUs with ep 8, the learned model: GPU 0 holds 1 of the 8 experts
    and, with uniform dropless loads, gets as many tokens as the traced GEMM processed
    (8 x 1,024 slots): its first expert product [8, 1024, 4096] x [8, 4096, 14336] runs at
    the traced FLOPs (962 GFLOP) over the traced token tensors but 1/8 of the weight
    buffer's bytes (117 MB of 940 MB), not the whole trace's product that reads all eight
    experts' weights (4 % slower here; 2.7x for DeepSeek-V3's 256 experts under EP 64,
    where the product is memory-bound on one GPU). Timed as a fresh model on that view."""
    import dataclasses

    from perfmodel import LearnedModel, Target

    sim = Simulation(
        {
            "trace": MIXTRAL,
            "num_gpus": 8,
            "batch_size": 8,
            "gpu": "H100-SXM",
            "parallelism": {"mode": "mesh", "dp_replicate": 8, "ep": 8},
            "topology": {"kind": "fully_connected", "bandwidth": B, "latency": L},
            "perfmodel": {"kind": "learned"},
            "host": {"model": "off"},  # the kernel alone
        }
    )
    r = sim.run()
    trace = sim.trace
    bmm = next(o for o in trace.operators if o.name == "aten::bmm" and "experts" in o.layer)
    x, w = (trace.tensors[i] for i in bmm.inputs)
    assert x.shape == (8, 1024, 4096) and w.shape == (8, 4096, 14336) and not w.scales_with_batch
    tensors = dict(trace.tensors)
    tensors[w.id] = dataclasses.replace(w, nbytes=w.nbytes / 8)
    view = type(trace)(trace.operators, tensors, trace.metadata)
    want = LearnedModel(view, identity=False).time(bmm, Target(gpu="H100-SXM", batch_size=1))
    whole = LearnedModel(trace, identity=False).time(bmm, Target(gpu="H100-SXM", batch_size=1))
    assert want < 0.99 * whole  # 1.196 ms against 1.245: the view is what tells them apart
    tl = r.timeline
    got = tl[(tl.gpu == 0) & (tl.op_id == bmm.id) & (tl.phase == "forward")]
    assert len(got) == 1
    assert float(got.end.iloc[0] - got.start.iloc[0]) == pytest.approx(want, rel=1e-9)


def test_ep_copies_across_nodes_fall_back_to_copies_that_keep_a_nodes_parity():
    """NCCL's rail rings enter and leave alternate nodes on alternate GPUs, so a copy that
    moves a GPU to a node of the other parity may meet another data-parallel ring
    (Megatron-Bridge's DeepSeek-V3 layout: a TP collective on the odd nodes ended 13 us
    later). 16 GPUs in nodes of 4, tp 2 x dp_replicate 8, ep 8: the local index's digits
    cut at the TP pair, the node and two nodes: radices 2, 2, 2, 2 (TP; a node's second
    pair; the next node, which flips the parity; the next EP group). The declarations, in
    order: every digit (16 copies, one representative), then all but the parity digit
    (8 copies: within a node and two nodes on), then one axis (the expert-DP rank: 2)."""
    from extrapolators.modes.mesh.symmetry import digits, mesh_symmetry

    topo = {"kind": "multi_node", "gpus_per_node": 4, "bandwidth": B, "latency": L,
            "inter_bandwidth": B / 10, "inter_latency": L}  # fmt: skip
    par = {"mode": "mesh", "tp": 2, "dp_replicate": 8, "ep": 8, "sequence_parallel": True}
    cfg = {"num_gpus": 16, "batch_size": 16, "parallelism": par, "topology": topo,
           "communication": {"kind": "textbook"}, "perfmodel": {"kind": "roofline"},
           "symmetry": "auto"}  # fmt: skip
    sim = Simulation(cfg, trace=trace(layers=2, experts=8))
    radices, shifts, _ = digits(sim.extrapolator)
    assert radices == [2, 2, 2, 2] and shifts == [0, 1, 2, 3]
    chain, sym = [], mesh_symmetry(sim.extrapolator)
    while sym is not None:
        chain.append(sym.copies)
        sym = getattr(sym, "fallback", None)
    assert chain == [16, 8, 2]
    exact = Simulation({**cfg, "symmetry": "off"}, trace=trace(layers=2, experts=8)).run()
    assert sim.run().iteration_time == pytest.approx(exact.iteration_time, rel=1e-12)
