"""The device mesh (extrapolators/modes/mesh/): ranks and groups, every degree checked in
one place, HSDP and FSDP with pipeline stages by hand, the presets as the mesh they stand
for, and properties over random meshes (compute per GPU against its closed form, the bytes
each data-parallel plan reduces, a dimension of degree 1 as the mesh without it, symmetric
runs equal to exact ones)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extrapolators.modes.mesh.dims import DIMS, Layout, Mesh, parse_order, resolve
from tests.conftest import chain_trace
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation

GB = 1e9
FAST = {"kind": "ring", "bandwidth": 1e30, "latency": 0.0}
RING = {"kind": "ring", "bandwidth": 10 * GB, "latency": 0.0}
ORDERS = ["tp-cp-dp-pp", "tp-cp-pp-dp", "dp-pp-cp-tp", "pp-tp-dp_replicate-cp-dp_shard"]


def run(trace, n, par, topology=RING, batch=None, symmetry="off"):
    """The run, with its mode as `r.extrapolator`."""
    cfg = {
        "num_gpus": n,
        "batch_size": batch,
        "parallelism": {"mode": "mesh", **par},
        "topology": topology,
        "communication": {"kind": "textbook"},
        "symmetry": symmetry,
    }
    sim = Simulation(cfg, trace=trace)
    r = sim.run()
    r.extrapolator = sim.extrapolator
    return r


# -- the mesh: ranks, orders, groups ---------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(*[st.sampled_from([1, 2, 3]) for _ in DIMS]),
    order=st.sampled_from(ORDERS),
)
def test_ranks_and_coordinates_are_one_to_one_and_groups_partition_the_gpus(shape, order):
    mesh = Mesh(*shape, order=parse_order(order))
    n = mesh.size
    assert sorted(mesh.rank(mesh.coords(i)) for i in range(n)) == list(range(n))
    # every rank's coordinates at once (the layout's) are each rank's own
    assert mesh.all_coords() == [mesh.coords(i) for i in range(n)]
    layout = Layout(mesh, range(n), range(n))
    assert all(layout.at[mesh.coords(i)] == i for i in range(n))
    innermost = parse_order(order)[0]
    k = DIMS.index(innermost)
    # the innermost dimension's groups are consecutive ranks
    for x in layout.at:
        g = layout.group(x, (innermost,))
        assert len(g) == shape[k] and g == tuple(range(g[0], g[0] + shape[k]))
    for r in range(1, 4):
        for dims in itertools.combinations(DIMS, r):
            groups = {layout.group(x, dims) for x in layout.at}
            size = math.prod(shape[DIMS.index(d)] for d in dims)
            assert all(len(g) == size for g in groups)
            assert sorted(g for grp in groups for g in grp) == list(range(n))  # a partition


def test_both_frameworks_default_order_puts_tp_innermost_and_pp_outermost():
    mesh = Mesh(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2)
    layout = Layout(mesh, range(16), range(16))
    assert layout.group(mesh.coords(0), ("tp",)) == (0, 1)  # tp: consecutive
    assert layout.group(mesh.coords(0), ("dp_shard",)) == (0, 2)  # then dp_shard
    assert layout.group(mesh.coords(0), ("dp_replicate",)) == (0, 4)  # then dp_replicate
    assert layout.group(mesh.coords(0), ("pp",)) == (0, 8)  # pipeline stages outermost


def test_dp_shard_zero_takes_what_the_other_degrees_leave_and_a_wrong_product_is_named():
    assert resolve(64, 2, 2, 0, 1, 8).dp_shard == 2
    with pytest.raises(ConfigError, match=r"parallelism.dp_shard.*product is num_gpus \(64\)"):
        resolve(64, 2, 2, 4, 1, 8)
    with pytest.raises(ConfigError, match=r"parallelism.tp.*dividing num_gpus \(60\)"):
        resolve(60, 1, 1, 0, 1, 8)  # one degree alone that cannot fit is the one named
    with pytest.raises(ConfigError, match=r"parallelism.dp_shard.*divide num_gpus \(12\)"):
        resolve(12, 4, 1, 0, 1, 6)  # each divides 12, their product does not
    with pytest.raises(ConfigError, match="parallelism.order"):
        parse_order("tp-cp-pp")


@pytest.mark.parametrize(
    "n,batch,par,field",
    [
        (3, 6, {"tp": 3, "dp_shard": 1}, "parallelism.tp"),  # 3 does not divide 64 outputs
        (4, 8, {"dp_shard": 4, "distributed_optimizer": True}, "parallelism.distributed_optimizer"),
        (4, 8, {"dp_replicate": 2, "dp_shard": 2, "zero": 2}, "parallelism.zero"),
        (4, 8, {"dp_shard": 4, "sequence_parallel": True}, "parallelism.sequence_parallel"),
        (4, 8, {"dp_shard": 4, "virtual_stages": 2}, "parallelism.virtual_stages"),
        (4, 6, {"dp_shard": 4}, "batch_size"),
        (4, 8, {"dp_shard": 4, "microbatches": 16}, "parallelism.microbatches"),
        (
            4,
            8,
            {"pp": 2, "dp_shard": 2, "schedule": "interleaved", "virtual_stages": 2},
            "parallelism.microbatches",
        ),  # fmt: skip
        (4, 8, {"pp": 2, "dp_shard": 2, "schedule": "zerobubble"}, "parallelism.schedule"),
        (4, 8, {"pp": 8, "dp_shard": 0}, "parallelism.pp"),
        (4, 9, {"pp": 2, "dp_shard": 2, "microbatches": 3}, "batch_size.*x microbatches \\(3\\)"),
    ],
)
def test_every_degree_is_checked_before_the_run_and_the_message_names_the_field(
    n, batch, par, field
):
    t = chain_trace(batch=8, layers=4)
    cfg = {"num_gpus": n, "batch_size": batch, "parallelism": {"mode": "mesh", **par}}
    with pytest.raises(ConfigError, match=field if "\\" in field else field.replace(".", r"\.")):
        Simulation(cfg, trace=t)


# -- HSDP and FSDP with pipeline stages, by hand -------------------------------------------------
def test_hsdp_reduce_scatters_in_each_replica_then_all_reduces_the_shard_across_replicas():
    """dp_replicate 2 x dp_shard 2 on 4 GPUs (ranks: shards inside replicas), a chain of 2
    layers of 4 MB (one unit each), 10 GB/s ring, textbook collectives. Per replica each unit
    is gathered for forward and backward (reshard always) and reduce-scattered over its 2
    shards: 2 MB a collective, 0.2 ms; then the reduced 2 MB shard is all-reduced over the
    2 replicas: 2 x (1/2) x 2 MB = 2 MB, 0.2 ms (each GPU's own switch links). Unit gradients: u1 at the end of its
    backward (forward 2 x 1 ms after the first gather, backward 2 ms), u0 2 ms later."""
    t = chain_trace(batch=4, layers=2, t_fwd=1e-3, t_bwd=2e-3, t_opt=0.5e-3)
    par = {"dp_replicate": 2, "dp_shard": 2, "wrap_depth": 1, "reshard_after_forward": "always"}
    switch = {"kind": "switch", "bandwidth": 10 * GB, "latency": 0.0}  # no link shared
    r = run(t, 4, par, switch, batch=16)
    x = 0.2e-3
    tl = r.timeline
    for g in range(4):
        mine = tl[(tl.gpu == g) & (tl.kind == "comm")].sort_values("start")
        assert list(mine.name) == ["all_gather"] * 4 + ["reduce_scatter", "allreduce"] * 2
        rs = mine[mine.name == "reduce_scatter"]
        ar = mine[mine.name == "allreduce"]
        assert rs.nbytes.tolist() == [4e6, 4e6] and ar.nbytes.tolist() == [2e6, 2e6]
        # u1: gathered at 0.2-0.4 (prefetch), forward [0.2, 2.2], backward [2.2, 4.2]
        assert rs.start.tolist() == pytest.approx([4.2e-3, 6.2e-3], rel=1e-9)
        assert ar.start.tolist() == pytest.approx([4.2e-3 + x, 6.2e-3 + x], rel=1e-9)
    replicas = {frozenset(c.group) for c in [*_collectives(r, "allreduce")]}
    assert replicas == {frozenset({0, 2}), frozenset({1, 3})}
    assert r.collective_bytes["reduce_scatter"] == pytest.approx(2 * t.weight_bytes())
    assert r.collective_bytes["allreduce"] == pytest.approx(t.weight_bytes())
    assert r.iteration_time == pytest.approx(6.2e-3 + 2 * x + 0.5e-3 / 2, rel=1e-9)


def _collectives(r, op):
    tl = r.timeline
    rows = tl[(tl.kind == "comm") & (tl.name == op)]

    class C:  # the groups that met: GPUs sharing one key
        pass

    out = []
    for _, grp in rows.groupby("key"):
        c = C()
        c.group = tuple(sorted(grp.gpu))
        out.append(c)
    return out


def test_fsdp_with_pipeline_stages_gathers_each_unit_once_and_reduces_after_the_last_microbatch():
    """pp 2 x dp_shard 2, 4 micro-batches, 1F1B: torchtitan keeps parameters gathered across
    micro-batches with pipelines (no reshard after forward, none after a backward but the
    last), so each stage's 2 units are gathered once, and reduce-scattered once, after the
    last micro-batch's backward."""
    t = chain_trace(batch=8, layers=4)
    r = run(t, 4, {"pp": 2, "dp_shard": 2, "microbatches": 4, "wrap_depth": 1}, batch=16)
    tl = r.timeline
    for g in range(4):
        c = tl[(tl.gpu == g) & (tl.kind == "comm")]
        assert (c.name == "all_gather").sum() == 2 and (c.name == "reduce_scatter").sum() == 2
        last_bwd = tl[(tl.gpu == g) & (tl.kind == "compute") & (tl.phase == "backward")]
        mb3 = last_bwd[last_bwd.microbatch == 3]
        first_rs = c[c.name == "reduce_scatter"].start.min()
        assert first_rs >= mb3.start.min() - 1e-12  # only in the last micro-batch's backward
    # the reshard policy "always" gathers again for every forward and backward
    always = run(t, 4, {"pp": 2, "dp_shard": 2, "microbatches": 4, "wrap_depth": 1,
                        "reshard_after_forward": "always"}, batch=16)  # fmt: skip
    n_ag = (always.timeline.name == "all_gather").sum()
    assert n_ag > (r.timeline.name == "all_gather").sum()


# -- the presets are the mesh they stand for ----------------------------------------------------
LAYOUTS = st.sampled_from([1, 2, 4])


@pytest.mark.no_cover
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.sampled_from([2, 4, 8]), layers=st.integers(2, 6), bw=st.sampled_from([1e9, 1e11]))
def test_fsdp_is_the_mesh_with_dp_shard_alone(n, layers, bw):
    t = chain_trace(batch=8, layers=layers, weight_bytes=3e6)
    top = {"kind": "ring", "bandwidth": bw, "latency": 1e-6}
    cfg = {
        "num_gpus": n,
        "batch_size": 8 * n,
        "topology": top,
        "communication": {"kind": "textbook"},
    }
    a = Simulation({**cfg, "parallelism": {"mode": "fsdp"}}, trace=t).run()
    b = run(t, n, {"dp_shard": n, "reshard_after_forward": "always"}, top, batch=8 * n)
    assert a.iteration_time == b.iteration_time
    assert a.bytes_delivered == b.bytes_delivered


@pytest.mark.no_cover
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp=LAYOUTS, tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), m=LAYOUTS, data=st.data()
)
def test_3d_ddp_dp_and_hybrid_are_their_meshes(dp, tp, pp, m, data):
    t = chain_trace(batch=8, layers=4)
    n, batch = dp * tp * pp, 8 * dp * m
    overlap = data.draw(st.booleans())
    three_d = {"mode": "3d", "dp": dp, "tp": tp, "pp": pp, "microbatches": m, "dp_overlap": overlap}
    cfg = {
        "num_gpus": n,
        "batch_size": batch,
        "topology": RING,
        "communication": {"kind": "textbook"},
    }
    a = Simulation({**cfg, "parallelism": three_d}, trace=t).run()
    mesh = {"dp_replicate": dp, "dp_shard": 1, "tp": tp, "pp": pp, "microbatches": m}
    b = run(t, n, {**mesh, "dp_overlap": overlap, "order": "tp-cp-pp-dp"}, batch=batch)
    assert a.iteration_time == b.iteration_time
    if tp == pp == 1:
        mode = "ddp" if overlap else "dp"
        c = Simulation({**cfg, "parallelism": {"mode": mode, "accumulation_steps": m}}, trace=t)
        assert c.run().iteration_time == a.iteration_time
    if m == 1 and not overlap and tp * pp > 1:
        inner = {"inner": "tp"} if pp == 1 else {"inner": "1f1b"}
        if tp == 1 or pp == 1:
            h = Simulation({**cfg, "parallelism": {"mode": "hybrid", "dp": dp, **inner}}, trace=t)
            assert h.run().iteration_time == a.iteration_time


# -- properties over random meshes ---------------------------------------------------------------
MESHES = st.fixed_dictionaries(
    {
        "pp": st.sampled_from([1, 2]),
        "dp_replicate": st.sampled_from([1, 2]),
        "dp_shard": st.sampled_from([1, 2]),
        "tp": st.sampled_from([1, 2]),
        "microbatches": st.sampled_from([1, 2, 4]),
        "zero": st.sampled_from([None, 0, 1, 2, 3]),
        "schedule": st.sampled_from(["1f1b", "gpipe"]),
        "order": st.sampled_from(ORDERS),
    }
)


def _valid(par) -> bool:
    z = par["zero"] if par["zero"] is not None else (3 if par["dp_shard"] > 1 else 0)
    return not (par["dp_shard"] > 1 and z in (1, 2) and par["dp_replicate"] > 1)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(par=MESHES, layers=st.sampled_from([4, 5, 7]))
def test_compute_per_gpu_is_its_stage_share_of_the_trace(par, layers):
    """On a chain of TP-split layers (FLOP-scaled exactly): a GPU of stage p computes its
    stage's forward and backward operators at its share of the batch, batch / (dp_replicate
    x dp_shard) over the traced batch, split over tp, plus the optimizer on what it steps."""
    if not _valid(par):
        return
    t = chain_trace(batch=8, layers=layers, t_opt=0.5e-3)
    dp = par["dp_replicate"] * par["dp_shard"]
    n, batch = par["pp"] * dp * par["tp"], 8 * dp * par["microbatches"]
    r = run(t, n, par, FAST, batch=batch)
    ex = r.extrapolator
    share = batch / dp / t.batch_size / par["tp"]
    total = t.weight_bytes()
    for g, (p, *_rest) in ex.layout.coord.items():
        ops = [
            op
            for c in ex.weights.stage_chunks(p)
            for op in (*ex.pipe.fwd_ops[c], *ex.pipe.bwd_ops[c])
        ]
        held = sum(
            t.tensors[w].nbytes
            for c in ex.weights.stage_chunks(p)
            for w in ex.weights.chunk_weights[c]
        )
        parts = par["dp_shard"] if ex.zero else 1
        want = sum(op.time for op in ops) * share + 0.5e-3 * held / total / par["tp"] / parts
        assert r.per_gpu().loc[g, "compute"] == pytest.approx(want, rel=1e-9)


@pytest.mark.no_cover
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(par=MESHES, dist=st.booleans())
def test_the_bytes_each_data_parallel_plan_reduces(par, dist):
    """Per iteration, summed over the collectives that ran (each counts its per-GPU buffer):
    FSDP reduce-scatters every weight once per replica (dp_replicate x W: each replica's
    shard groups hold the model's TP shards once) and HSDP all-reduces the shards once (W);
    ZeRO-2 and the distributed optimizer reduce-scatter and all-gather W after the step; DDP
    and ZeRO-1 all-reduce W; with one data-parallel GPU nothing is reduced."""
    if not _valid(par):
        return
    z = par["zero"] if par["zero"] is not None else (3 if par["dp_shard"] > 1 else 0)
    z = z if par["dp_shard"] > 1 else 0
    dist = dist and z == 0
    t = chain_trace(batch=8, layers=4, weight_bytes=3e6)
    dp = par["dp_replicate"] * par["dp_shard"]
    n, batch = par["pp"] * dp * par["tp"], 8 * dp * par["microbatches"]
    r = run(t, n, {**par, "distributed_optimizer": dist}, batch=batch)
    w, got = t.weight_bytes(), r.collective_bytes
    rs, ar, ag = (got.get(k, 0.0) for k in ("reduce_scatter", "allreduce", "all_gather"))
    if dp == 1:
        assert rs == 0 and ar == pytest.approx(_tp_allreduce(r)) and ag == 0
    elif z == 3:
        assert rs == pytest.approx(par["dp_replicate"] * w)
        hsdp = w if par["dp_replicate"] > 1 else 0.0
        assert ar - _tp_allreduce(r) == pytest.approx(hsdp)
    elif z == 2 or dist:
        assert rs == pytest.approx(w) and ag == pytest.approx(w)
    else:
        assert ar - _tp_allreduce(r) == pytest.approx(w)
        assert ag == pytest.approx(w if z == 1 else 0.0)


def _tp_allreduce(r) -> float:
    """The all-reduce bytes of the tensor-parallel collectives (keys `.../tp:...`), once each."""
    tl = r.timeline
    rows = tl[
        (tl.kind == "comm") & (tl.name == "allreduce") & tl.key.astype(str).str.contains("/tp:")
    ]
    return float(rows.drop_duplicates("key").nbytes.sum())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(par=MESHES, data=st.data())
def test_a_dimension_of_degree_one_is_the_mesh_without_it(par, data):
    """A dimension of degree 1 adds no rank: wherever the rank order puts it (innermost,
    outermost, between the others), every GPU's coordinates, groups and timeline are the
    mesh's without it, to the bit; and every byte the run sent was delivered."""
    if not _valid(par):
        return
    dims = list(parse_order(par["order"]))
    ones = [d for d in dims if par.get(d, 1) == 1]
    if not ones:
        return
    d = data.draw(st.sampled_from(ones))
    rest = [x for x in dims if x != d]
    at = data.draw(st.integers(0, len(rest)))
    moved = {**par, "order": "-".join([*rest[:at], d, *rest[at:]])}
    t = chain_trace(batch=8, layers=4, weight_bytes=3e6)
    dp = par["dp_replicate"] * par["dp_shard"]
    n, batch = par["pp"] * dp * par["tp"], 8 * dp * par["microbatches"]
    a, b = run(t, n, par, RING, batch=batch), run(t, n, moved, RING, batch=batch)
    assert a.extrapolator.layout.coord == b.extrapolator.layout.coord
    assert a.iteration_time == b.iteration_time
    cols = ["gpu", "stream", "kind", "name", "start", "end", "nbytes"]
    assert a.timeline[cols].equals(b.timeline[cols])
    for r in (a, b):  # (the run checks it too: a difference would have raised)
        moved_bytes = r.transfers()["nbytes"].sum() if len(r.transfers()) else 0.0
        assert r.bytes_delivered == pytest.approx(moved_bytes, rel=1e-12, abs=1e-6)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(par=MESHES)
def test_a_symmetric_run_is_the_exact_run(par):
    if not _valid(par):
        return
    t = chain_trace(batch=8, layers=4, weight_bytes=3e6)
    dp = par["dp_replicate"] * par["dp_shard"]
    n, batch = par["pp"] * dp * par["tp"], 8 * dp * par["microbatches"]
    switch = {"kind": "switch", "bandwidth": 10 * GB, "latency": 1e-6}  # every copy alike
    exact = run(t, n, par, switch, batch=batch)
    sym = run(t, n, par, switch, batch=batch, symmetry="auto")
    copies = par["dp_replicate"] * par["dp_shard"] * par["tp"]  # along each of them
    if copies > 1:  # it ran symmetric: the representatives of one copy
        assert sym.symmetry == f"auto: {n // copies} representative{'s' * (n > copies)} of {n} GPUs"
    else:
        assert "its own class" in sym.symmetry
    assert sym.iteration_time == pytest.approx(exact.iteration_time, rel=1e-12)
    assert sym.per_gpu()["compute"].tolist() == pytest.approx(
        exact.per_gpu()["compute"].tolist(), rel=1e-12
    )
