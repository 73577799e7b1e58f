"""`symmetry: auto` (extrapolators.execution.symmetry): one representative per class of identical GPUs
gives the full simulation's results, row by row; where the classes are not identical it
falls back to the full simulation and says so."""

import pickle
import re
import warnings

import numpy as np
import pytest

from extrapolators.execution.symmetry import Symmetry, SymmetryBroken, SymmetryWarning
from tests.conftest import ROOT, chain_trace
from triosim.common.errors import ConfigError
from triosim.config.loading import from_dict, parse_yaml
from triosim.simulation.wiring import Simulation, load_any_trace

RESNET = ROOT / "traces/cpu/resnet18-b8.trace.json.gz"
GPT2 = ROOT / "traces/modelled/a100-80gb/gpt2-s512-b8.trace.json.gz"
FAT = {"kind": "fat_tree", "bandwidth": "50 GB/s", "latency": "1 us", "radix": 8}
NON_TIME = [
    "gpu",
    "stream",
    "iteration",
    "kind",
    "name",
    "layer",
    "phase",
    "op_id",
    "microbatch",
    "nbytes",
]


@pytest.fixture(scope="module")
def resnet():
    return load_any_trace(RESNET)


@pytest.fixture(scope="module")
def gpt2():
    return load_any_trace(GPT2)


def ddp(n, symmetry, **extra):
    return {
        "num_gpus": n,
        "batch_size": 8 * n,
        "parallelism": {"mode": "ddp"},
        "topology": {**FAT, "radix": 8 if n <= 32 else 16},
        "symmetry": symmetry,
        **extra,
    }


ONE_LEAF = {**FAT, "radix": 64}  # 16 GPUs on one leaf switch
RING = {"kind": "ring", "bandwidth": "50 GB/s", "latency": "1 us"}
# 4-GPU servers on a rail fabric (rail i: GPU i of every server)
RAIL = {
    "kind": "multi_node",
    "gpus_per_node": 4,
    "bandwidth": "300 GB/s",
    "latency": "1 us",
    "inter_bandwidth": "50 GB/s",
    "inter_latency": "2 us",
}


def threed(symmetry, dp=4, tp=2, pp=2, **extra):
    par = {"mode": "3d", "dp": dp, "tp": tp, "pp": pp, "microbatches": 2 * pp}
    return {
        "num_gpus": dp * tp * pp,
        "batch_size": 8 * dp,
        "gpu": "A100-80GB",
        "parallelism": par,
        "topology": ONE_LEAF,
        "symmetry": symmetry,
        **extra,
    }


def run(cfg, trace):
    """The run and the SymmetryWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = Simulation(cfg, trace=trace).run()
    return r, [str(w.message) for w in caught if issubclass(w.category, SymmetryWarning)]


def sorted_timeline(r):
    tl = r.timeline.drop(columns=["key"])  # symmetric: the representatives' keys (documented)
    cols = {c: tl[c].astype(str) for c in NON_TIME}
    order = tl.assign(**{f"_{c}": v for c, v in cols.items()}).sort_values(
        [f"_{c}" for c in NON_TIME] + ["start", "end"], kind="stable"
    )
    return order[tl.columns].reset_index(drop=True)


def assert_same_run(a, b):
    """Every task of every GPU starts and ends at the same instant (1e-9 relative), with the
    same iteration time, per-GPU breakdown and memory."""
    ta, tb = sorted_timeline(a), sorted_timeline(b)
    assert len(ta) == len(tb)
    for c in NON_TIME:
        assert (ta[c].astype(str).to_numpy() == tb[c].astype(str).to_numpy()).all(), c
    for c in ("start", "end"):
        np.testing.assert_allclose(ta[c].to_numpy(float), tb[c].to_numpy(float), rtol=1e-9, atol=0)
    assert a.iteration_times == pytest.approx(b.iteration_times, rel=1e-9, abs=0)
    assert a.peak_memory.keys() == b.peak_memory.keys()
    for g, p in b.peak_memory.items():
        assert a.peak_memory[g] == pytest.approx(p, rel=1e-9)
    pa, pb = a.per_gpu(), b.per_gpu()
    assert list(pa.index) == list(pb.index)
    np.testing.assert_allclose(pa.to_numpy(float), pb.to_numpy(float), rtol=1e-9, atol=1e-15)
    ma, mb = a.memory, b.memory
    assert list(ma["gpu"]) == list(mb["gpu"])
    np.testing.assert_allclose(
        ma.drop(columns="gpu").to_numpy(float), mb.drop(columns="gpu").to_numpy(float), rtol=1e-9
    )
    assert a.bytes_delivered == pytest.approx(b.bytes_delivered, rel=1e-12)
    assert a.collective_bytes == pytest.approx(b.collective_bytes, rel=1e-12)


def assert_same_transfers(a, b):
    """Every byte moved as in the full run: the same transfers (tags aside) and links."""
    key = ["src", "dst", "start", "end", "nbytes"]
    xa = a.transfers().sort_values(key).reset_index(drop=True)
    xb = b.transfers().sort_values(key).reset_index(drop=True)
    assert len(xa) == len(xb)
    assert list(xa["src"]) == list(xb["src"]) and list(xa["dst"]) == list(xb["dst"])
    for c in ("start", "end", "nbytes"):
        np.testing.assert_allclose(xa[c].to_numpy(float), xb[c].to_numpy(float), rtol=1e-9)
    np.testing.assert_allclose(a.per_link()["busy_time"], b.per_link()["busy_time"], rtol=1e-9)


# -- exact where the classes are identical ------------------------------------------------------
@pytest.mark.parametrize("n", [8, 64])
def test_ddp_one_representative_equals_the_full_run(resnet, n):
    full, _ = run(ddp(n, "off"), resnet)
    sym, warned = run(ddp(n, "auto"), resnet)
    assert not warned
    assert sym.symmetry == f"auto: 1 representative of {n} GPUs" and full.symmetry == "off"
    assert len(sym.own_timeline) * n == len(sym.timeline)  # the representative's rows only
    assert_same_run(sym, full)
    assert sym.iteration_time == full.iteration_time  # bit for bit, in fact
    assert_same_transfers(sym, full)


def test_ddp_two_iterations_and_the_timeline_of_each_gpu(resnet):
    full, _ = run(ddp(8, "off", iterations=2), resnet)
    sym, _ = run(ddp(8, "auto", iterations=2), resnet)
    assert sym.symmetry.startswith("auto")
    assert_same_run(sym, full)
    assert sym.per_layer().equals(full.per_layer())


@pytest.mark.no_cover
@pytest.mark.parametrize("topology", [ONE_LEAF, RING])
def test_3d_replica_zero_represents_the_others(gpt2, topology):
    # dp 4 x tp 2 x pp 2: TP all-reduces and pipeline sends run for every replica through
    # the network, the DP all-reduces (bucketed, overlapping the backward) once over their
    # whole group; they share GPU links (one leaf), or every link of the ring
    full, _ = run(threed("off", topology=topology), gpt2)
    sym, warned = run(threed("auto", topology=topology), gpt2)
    assert not warned
    # copies along dp and tp (4 x 2): one representative per pipeline stage
    assert sym.symmetry == "auto: 2 representatives of 16 GPUs"
    # one leaf: the copies see the same network, which moves one flow per orbit
    # (networks.packet.quotient); on the ring the copies (dp and tp digits shifted, each
    # modulo its own size) are no rotation: every copy's flows move
    if topology is ONE_LEAF:
        assert sym.symmetry_flows == "by orbits: one flow of every 8"
    else:
        assert sym.symmetry_flows.startswith("every copy's: the copies of")
    assert full.symmetry_flows is None
    assert_same_run(sym, full)
    assert_same_transfers(sym, full)
    # "send to" / "recv from" name the image's own peer
    rows = sym.timeline[sym.timeline["gpu"] == 13]
    names = set(rows["name"])
    assert "send to 15" in names and "recv from 15" in names and "send to 3" not in names
    # the images' peers' names join the categories in order: sorting sorts as text
    cats = list(sym.timeline["name"].cat.categories)
    assert cats == sorted(cats) == list(full.timeline["name"].cat.categories)


@pytest.mark.no_cover
@pytest.mark.parametrize(
    "par", [{"mode": "interleaved", "virtual_stages": 2}, {"dp_overlap": False}]
)
def test_interleaved_and_unbucketed_3d(gpt2, par):
    cfg = threed("off")
    cfg["parallelism"] = {**cfg["parallelism"], **par}
    full, _ = run(cfg, gpt2)
    sym, warned = run({**cfg, "symmetry": "auto"}, gpt2)
    assert not warned and sym.symmetry == "auto: 2 representatives of 16 GPUs"
    assert_same_run(sym, full)


def test_3d_on_the_rail_cluster_sends_across_rails_alike_in_every_replica(gpt2):
    # dp 2 x tp 2 x pp 4 on four 4-GPU servers: replica d on servers 2d and 2d + 1, its
    # stage 1 on local ranks 2-3 of the first, stage 2 on local ranks 0-1 of the second:
    # those sends change rails. Relayed at the sender (PXN) in both replicas they take
    # alike ways; a hash of the pair put the relay at the receiver for some pairs, per
    # replica differently, and the run fell back
    cfg = threed("auto", dp=2, tp=2, pp=4, topology=RAIL)
    sym, warned = run(cfg, gpt2)
    assert not warned and sym.symmetry == "auto: 4 representatives of 16 GPUs"  # one a stage
    assert sym.symmetry_flows == "by orbits: one flow of every 4"
    assert re.search(r"^symmetric flows +by orbits: one flow of every 4$", sym.summary(), re.M)
    full, _ = run({**cfg, "symmetry": "off"}, gpt2)
    assert "symmetric flows" not in full.summary()
    assert_same_run(sym, full)
    assert_same_transfers(sym, full)
    x = full.transfers()
    hops = set(zip(x["src"], x["dst"], strict=True))
    assert (2, 4) in hops and (10, 12) in hops  # the cross-rail sends are there
    # replica 1 (GPUs 8-15) is represented by replica 0 at the same grid position, a TP
    # rank by TP rank 0 of its group (ranks tp-fastest: GPU g's group starts at g - g % 2)
    assert sym.represented_by().to_dict() == {g: g % 8 - g % 2 for g in range(16)}
    assert full.represented_by().to_dict() == {g: g for g in range(16)}


def test_3d_on_a_fat_tree_whose_routes_differ_per_replica(gpt2):
    # radix 8: a replica per leaf (dp 4) or per two leaves (dp 2); the DP all-reduces or the
    # pipeline sends cross the spines, where ECMP routes collide differently for different
    # replicas, so their operations end at different instants: auto sees it and falls back
    for dp, tp in ((4, 2), (2, 4)):
        sym, warned = run(threed("auto", dp=dp, tp=tp, topology=FAT), gpt2)
        assert len(warned) == 1 and sym.symmetry.startswith("off (fell back: the symmetric run")
        full, _ = run(threed("off", dp=dp, tp=tp, topology=FAT), gpt2)
        assert_same_run(sym, full)


def test_a_run_by_orbits_that_breaks_in_the_run_runs_again_with_every_flow(gpt2, monkeypatch):
    # without the check of every collective before the run, the ring's copies (no
    # rotation) break the network by orbits half-way: the same declaration runs again,
    # moving every copy's flows, and gives the full run
    from extrapolators.execution.runtime import Runtime

    monkeypatch.setattr(Runtime, "prepare_calls", lambda self, collectives, sends: None)
    sym, warned = run(threed("auto", topology=RING), gpt2)
    assert not warned and sym.symmetry == "auto: 2 representatives of 16 GPUs"
    assert sym.symmetry_flows.startswith("every copy's: the copies of")
    full, _ = run(threed("off", topology=RING), gpt2)
    assert_same_run(sym, full)


def test_ddp_stays_symmetric_behind_a_slower_link(resnet):
    # the all-reduce spans every GPU, so it runs in full: a slower link is simulated exactly
    slow = {**FAT, "links": [{"src": 5, "dst": "leaf1", "bandwidth": "5 GB/s", "both": True}]}
    full, _ = run(ddp(8, "off", topology=slow), resnet)
    sym, warned = run(ddp(8, "auto", topology=slow), resnet)
    assert not warned and sym.symmetry.startswith("auto")
    # its ring over the fat tree's leaves: GPU 0 -> 1 within a leaf, its copy 3 -> 4 across
    assert (
        sym.symmetry_flows == "every copy's: the copies of 0 -> 1 take paths of different lengths"
    )

    assert_same_run(sym, full)


@pytest.mark.parametrize(
    ("mode", "par", "reps"),
    [
        ("fsdp", {}, 1),
        ("tp", {}, 1),
        ("dp", {"accumulation_steps": 2}, 1),
        ("hybrid", {"dp": 2, "inner": "1f1b", "microbatches": 2}, 4),
        ("hybrid", {"dp": 4, "inner": "tp"}, 1),  # copies along dp x tp
    ],
)
def test_other_modes_that_declare_classes(mode, par, reps):
    t = chain_trace(layers=8)
    cfg = {
        "num_gpus": 8,
        "batch_size": 16,
        "parallelism": {"mode": mode, **par},
        "topology": {"kind": "ring", "bandwidth": 10e9, "latency": 1e-6},
    }
    full, _ = run({**cfg, "symmetry": "off"}, t)
    sym, warned = run({**cfg, "symmetry": "auto"}, t)
    assert not warned
    assert sym.symmetry == f"auto: {reps} representative{'s' * (reps > 1)} of 8 GPUs"
    assert_same_run(sym, full)


def test_result_pickles_and_expands_after(gpt2):
    sym, _ = run(threed("auto"), gpt2)
    back = pickle.loads(pickle.dumps(sym))
    assert back.symmetry == sym.symmetry
    assert len(back.timeline) == len(sym.timeline) and len(back.memory) == len(sym.memory)


# -- falls back, and says so, where they are not ---------------------------------------------------
@pytest.mark.no_cover
def test_a_slower_link_in_one_replica_falls_back(gpt2):
    # GPU 12 (replica 3) reaches its switch at a tenth of the bandwidth: its TP all-reduce
    # ends later than replica 0's, which the symmetric run sees, and abandons
    slow = {**ONE_LEAF, "links": [{"src": 12, "dst": "leaf0", "bandwidth": "5 GB/s", "both": True}]}
    sym, warned = run(threed("auto", topology=slow), gpt2)
    assert len(warned) == 1 and "do not see the same network" in warned[0]
    assert sym.symmetry.startswith("off (fell back: the symmetric run stopped: another replica")
    assert "after the representatives'" in sym.symmetry  # the slow replica ends later
    full, _ = run(threed("off", topology=slow), gpt2)
    assert_same_run(sym, full)


def test_a_slower_tp_rank_falls_back_to_copies_along_dp_alone(gpt2):
    # dp 4 x tp 2 x pp 2 (rank = t + 2 (d + 4 p)): every TP rank 1 (the odd GPUs) reaches
    # the switch at a quarter of the bandwidth. The data-parallel copies stay alike, the TP
    # ones do not: GPU 1's send to GPU 9 (copy (0, 1) of GPU 0's to GPU 8) ends later than
    # the representatives'. The run falls back to copies along dp (4 representatives: both
    # TP ranks of both stages), says so, and is the full run.
    het = {"bandwidth": {g: 4.0 for g in range(1, 16, 2)}}
    sym, warned = run(threed("auto", heterogeneity=het), gpt2)
    assert not warned
    assert sym.symmetry.startswith(
        "auto: 4 representatives of 16 GPUs (fell back from 2 representatives of 16 GPUs: "
        "another replica's copy of send"
    )
    full, _ = run(threed("off", heterogeneity=het), gpt2)
    assert_same_run(sym, full)
    assert_same_transfers(sym, full)


def test_copies_along_two_axes_by_hand():
    # representatives a (stage 0) and b (stage 1); copies (d, t) on axes (2, 3), t fastest:
    # copy k = 3 d + t, a's copies 0-5 are GPUs 0-5, b's 10-15
    sym = Symmetry({0: tuple(range(6)), 10: tuple(range(10, 16))}, axes=(2, 3))
    assert sym.problem(list(range(6)) + list(range(10, 16))) is None
    assert sym.digits(5) == (1, 2) and sym.compose(5, 4) == 3 * 0 + 0  # (1+1, 2+1) mod (2, 3)
    assert sym.image(4, 2) == 3  # GPU 4 is copy (1, 1) of a; copy (0, 2) of it is (1, 0)
    # a TP group (copies (0, 0..2) of a): met by a alone, run again at d = 1
    tp = (0, 1, 2)
    left, images = sym.plan(tp)
    assert left == {0} and images == [(3, 4, 5)] and sym.image_copies(tp) == [3]
    # a DP group (copies (0..1, 0) of a and b): met by both, run again at t = 1 and t = 2
    dp = (0, 3, 10, 13)
    left, images = sym.plan(dp)
    assert left == {0, 10} and images == [(1, 4, 11, 14), (2, 5, 12, 15)]
    # within the representatives: every other copy; whole classes: once
    assert sym.plan((0, 10))[1] == [(k, 10 + k) for k in range(1, 6)]
    assert sym.plan(tuple(range(6)))[1] is None
    for bad, why in (
        ((0, 4), "not whole axes"),  # copies (0, 0) and (1, 1): a diagonal, no axis
        ((0, 11), "mixes classes"),  # a at copy 0, b only at copy 1
        ((1, 2), "no representative"),
    ):
        with pytest.raises(SymmetryBroken, match=why):
            sym.plan(bad)
    assert "do not multiply" in Symmetry({0: (0, 1, 2, 3)}, axes=(2, 3)).problem(range(4))


def test_a_slower_gpu_falls_back(gpt2):
    het = {"compute": {13: 1.5}}
    sym, warned = run(threed("auto", heterogeneity=het), gpt2)
    assert len(warned) == 1 and "compute factor of GPU 13" in warned[0]
    assert "compute factor of GPU 13 (1.5)" in sym.symmetry
    full, _ = run(threed("off", heterogeneity=het), gpt2)
    assert_same_run(sym, full)


def test_a_plan_without_replicas_falls_back():
    # a pipeline alone: every stage runs other work, so every GPU is its own class
    t = chain_trace(layers=8)
    cfg = {
        "num_gpus": 4,
        "batch_size": 8,
        "parallelism": {"mode": "1f1b", "microbatches": 4},
        "topology": {"kind": "ring", "bandwidth": 10e9, "latency": 1e-6},
    }
    sym, warned = run({**cfg, "symmetry": "auto"}, t)
    why = "every GPU is its own class (no identical replicas to share a simulation)"
    assert warned == [f"symmetry: auto fell back to the full simulation: {why}"]
    assert sym.symmetry == f"off (fell back: {why})"
    full, _ = run(cfg, t)
    assert full.symmetry == "off"
    assert_same_run(sym, full)


def test_no_replicas_falls_back(gpt2):
    sym, warned = run(threed("auto", dp=1, tp=1, pp=2), gpt2)
    assert len(warned) == 1 and "its own class" in sym.symmetry


def test_tensor_parallel_ranks_stand_for_each_other_without_replicas(gpt2):
    # dp 1: TP rank 0 of every stage represents the others (its TP group is one class)
    sym, warned = run(threed("auto", dp=1, tp=2, pp=2), gpt2)
    assert not warned and sym.symmetry == "auto: 2 representatives of 4 GPUs"
    full, _ = run(threed("off", dp=1, tp=2, pp=2), gpt2)
    assert_same_run(sym, full)


def test_a_wrong_declaration_is_caught_by_the_stream_check(gpt2, monkeypatch):
    # replica d's TP ranks 0 and 1 swapped: the same computes and held bytes, but the
    # images' sends go to other GPUs than their streams' (the stream check says where)
    from extrapolators.modes.mesh import MeshMode

    def wrong(self):
        at, (pp, dp, _, _, tp) = self.layout.at, self.mesh.shape
        reps = [
            [at[p, d, 0, 0, 1 - t if d else t] for p in range(pp) for t in range(tp)]
            for d in range(dp)
        ]
        return Symmetry.of_replicas(reps)

    monkeypatch.setattr(MeshMode, "symmetry", wrong)
    sym, warned = run(threed("auto"), gpt2)
    assert len(warned) == 1 and "not GPU" in warned[0] and "mapped" in warned[0]
    full, _ = run(threed("off"), gpt2)
    assert_same_run(sym, full)


# -- the config option -------------------------------------------------------------------------------
def test_symmetry_option_values():
    assert from_dict({"trace": "x"}).symmetry == "off"  # the default
    assert from_dict({"trace": "x", "symmetry": "auto"}).symmetry == "auto"
    assert from_dict({"trace": "x", **parse_yaml("symmetry: off", "t")}).symmetry == "off"
    for bad in ("on", "full", 1, True):
        with pytest.raises(ConfigError, match="symmetry"):
            from_dict({"trace": "x", "symmetry": bad})


def _nccl_on(topology: dict, n: int):
    from triosim.studies.calibration import system

    cfg = from_dict(
        {
            "trace": str(RESNET),
            "num_gpus": n,
            "topology": topology,
            "communication": {"kind": "nccl"},
        }
    )
    env, net, model, _ = system(cfg)
    return env, model


@pytest.mark.parametrize("op", ["allreduce", "all_gather", "broadcast"])
def test_run_many_ends_each_group_as_its_own_run(op):
    # disjoint groups on one switch (every GPU its own link): no group slows another, so
    # each group's end is what `run` gives the group alone; the call returns at the first's
    groups = [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    sw = {"kind": "switch", "bandwidth": "50 GB/s", "latency": "1 us"}
    alone = []
    for g in groups:
        env, model = _nccl_on(sw, 12)
        env.process(model.run(op, g, 8e6, root=g[0]))
        env.run()
        alone.append(env.now)
    env, model = _nccl_on(sw, 12)
    got = {}

    def proc():
        got["ends"] = yield from model.run_many(op, groups, 8e6, roots=[g[0] for g in groups])
        got["now"] = env.now

    env.process(proc())
    env.run()
    assert got["ends"] == alone and got["now"] == alone[0]


def test_run_many_gives_a_slower_group_its_later_end():
    # group 1's GPU 5 behind a 10x slower link: its end is later, the others' are their own
    sw = {
        "kind": "switch",
        "bandwidth": "50 GB/s",
        "latency": "1 us",
        "links": [{"src": 5, "dst": "nvswitch", "bandwidth": "5 GB/s", "both": True}],
    }
    groups = [(0, 1, 2, 3), (4, 5, 6, 7)]
    env, model = _nccl_on(sw, 8)
    got = {}

    def proc():
        got["ends"] = yield from model.run_many("allreduce", groups, 8e6)

    env.process(proc())
    env.run()
    env0, m0 = _nccl_on(sw, 8)
    env0.process(m0.run("allreduce", groups[0], 8e6))
    env0.run()
    assert got["ends"][0] == env0.now and got["ends"][1] > 2 * got["ends"][0]


def test_run_many_keeps_the_calls_it_used_last(monkeypatch):
    # room for two calls' groups (2 x 8 GPU slots): calls A, B, C, C, C prepare A, B and C
    # once each (C kept in place of A, the least recently used); keeping the first calls
    # that fit and making every later one again prepared C three times
    from extrapolators.communication.nccl.many import ManyCalls

    monkeypatch.setattr(ManyCalls, "MANY_SLOTS", 16)
    made = []
    real = ManyCalls._prepared
    monkeypatch.setattr(
        ManyCalls, "_prepared", lambda self, op, *a: made.append(op) or real(self, op, *a)
    )
    groups = [(0, 1, 2, 3), (4, 5, 6, 7)]
    env, model = _nccl_on({"kind": "switch", "bandwidth": "50 GB/s", "latency": "1 us"}, 8)

    def calls():
        for op in ("allreduce", "all_gather", "reduce_scatter", "reduce_scatter", "allreduce"):
            yield from model.run_many(op, groups, 8e6)

    env.process(calls())
    env.run()
    # A, B, C, then C twice from what was kept; A was dropped for C: made again
    assert made == ["allreduce", "all_gather", "reduce_scatter", "allreduce"]


@pytest.mark.parametrize("slots", [0, 8, 4_000_000])
def test_run_many_again_ends_as_the_groups_own_runs(slots, monkeypatch):
    # the same groups run three times, at two sizes and with and without roots: with the
    # calls' plans and streams kept (all, the last call's 8 GPU slots, or only the last)
    # every group ends where a run of its own, the same calls one after another, ends (a
    # kept call matched on anything less than its groups, size and roots would reuse
    # another's streams)
    from extrapolators.communication.nccl.many import ManyCalls

    monkeypatch.setattr(ManyCalls, "MANY_SLOTS", slots)
    groups = [(0, 1, 2, 3), (4, 5, 6, 7)]
    calls = [("allreduce", 8e6, None), ("allreduce", 16e6, None), ("broadcast", 8e6, 0)]
    calls += [("broadcast", 8e6, 3)]
    calls += calls
    sw = {"kind": "switch", "bandwidth": "50 GB/s", "latency": "1 us"}
    alone = []
    for g in groups:
        env, model = _nccl_on(sw, 8)

        def one(g=g, model=model, env=env):
            ends = []
            for op, size, root in calls:
                yield from model.run(op, g, size, root=None if root is None else g[root])
                ends.append(env.now)
            return ends

        p = env.process(one())
        env.run()
        alone.append(p.value)
    env, model = _nccl_on(sw, 8)

    def many():
        out = []
        for op, size, root in calls:
            roots = None if root is None else [g[root] for g in groups]
            out.append((yield from model.run_many(op, groups, size, roots=roots)))
        return out

    p = env.process(many())
    env.run()
    assert [list(e) for e in zip(*p.value, strict=True)] == alone
    assert len(model.many.calls) == (4 if slots > 8 else 1)  # 4 distinct calls, 8 slots each


# -- expert parallelism --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "par,n,reps,orbits",
    [
        # uniform loads: copies along every digit of the dense and expert meshes' common
        # refinement (EP, expert-TP, the experts' replicas): one representative a stage.
        # `orbits`: the network moves one flow per orbit (else a collective's transfers are
        # no copies of each other: every copy's flows)
        ({"ep": 4}, 8, 1, False),
        ({"ep": 2, "etp": 2, "dp_overlap": True}, 8, 1, False),
        ({"ep": 2, "pp": 2, "accumulation_steps": 2, "distributed_optimizer": True}, 8, 2, True),
        ({"ep": 2, "fsdp": True}, 4, 1, True),
    ],
)
def test_expert_parallel_copies_stand_for_each_other(par, n, reps, orbits):
    from tests.test_expert_parallel import moe_trace

    t = moe_trace(layers=2, experts=4, top_k=2)
    cfg = {
        "num_gpus": n,
        "batch_size": 2 * n,
        "parallelism": {"mode": "ep", **par},
        "topology": {"kind": "switch", "bandwidth": 10e9, "latency": 1e-6},
        "perfmodel": {"kind": "trace"},
    }
    full, _ = run({**cfg, "symmetry": "off"}, t)
    sym, warned = run({**cfg, "symmetry": "auto"}, t)
    assert (
        not warned and sym.symmetry == f"auto: {reps} representative{'s' * (reps > 1)} of {n} GPUs"
    )
    # the all-to-alls (per-pair sizes) of every copy in one transfer group
    if orbits:
        assert sym.symmetry_flows == f"by orbits: one flow of every {n // reps}"
    else:
        assert sym.symmetry_flows.startswith("every copy's: a transfer group is not")
    assert_same_run(sym, full)
    assert_same_transfers(sym, full)


def test_expert_parallel_with_uneven_loads_falls_back():
    # skewed loads: each EP rank's experts keep other token counts, so copies along the EP
    # rank would differ; with no expert replicas every GPU is its own class
    from tests.test_expert_parallel import moe_trace

    t = moe_trace(layers=1, experts=4, top_k=1)
    cfg = {
        "num_gpus": 4,
        "batch_size": 8,
        "parallelism": {"mode": "ep", "ep": 4, "load": "skew", "skew": 1.5},
        "topology": {"kind": "switch", "bandwidth": 10e9, "latency": 1e-6},
        "perfmodel": {"kind": "trace"},
        "symmetry": "auto",
    }
    sym, warned = run(cfg, t)
    assert len(warned) == 1 and "its own class" in sym.symmetry
    two = {**cfg, "num_gpus": 8, "batch_size": 16}  # 2 expert replicas: copies along them
    sym, warned = run(two, t)
    assert not warned and sym.symmetry == "auto: 4 representatives of 8 GPUs"
    assert sym.symmetry_flows == "by orbits: one flow of every 2"  # skewed, alike per copy
    full, _ = run({**two, "symmetry": "off"}, t)
    assert_same_run(sym, full)
    assert_same_transfers(sym, full)
