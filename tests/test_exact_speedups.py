"""The speed-ups outside the network give the same numbers as the straightforward paths.

Compute runs (ComputeRun: computes shared by all GPUs, timed by one cumsum) against one
Compute per operator; the columnar timeline against a DataFrame of one tuple per task;
the shared memory curves against one curve per GPU. Every row must match exactly.
"""

import pickle

import numpy as np
import pandas as pd
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from extrapolators.communication.base import Textbook
from extrapolators.execution import Runtime
from extrapolators.execution.runtime import COLUMNS
from extrapolators.execution.tasks import Collective, Compute, ComputeRun, Iteration, Signal, Wait
from extrapolators.execution.timeline_log import Block, TimelineLog
from networks import PacketSwitchNetwork
from networks import topology as topo
from tests.conftest import chain_trace
from triosim.results.memory import _FrameRows, memory_curves, memory_timeline
from triosim.simulation.wiring import Simulation

RING = {"kind": "ring", "bandwidth": "10 GB/s", "latency": "1 us"}
FAT = {"kind": "fat_tree", "bandwidth": "50 GB/s", "latency": "1 us"}

CASES = {
    "ddp": dict(n=8, parallelism={"mode": "ddp", "bucket_size": 2e6, "first_bucket_size": 1e5}),
    "ddp-accumulate-recompute": dict(
        n=4, parallelism={"mode": "ddp", "accumulation_steps": 2, "recompute": "full"}
    ),
    "dp-3-iterations": dict(n=4, iterations=3, parallelism={"mode": "dp"}),
    "ddp-heterogeneous": dict(
        n=4, iterations=2, parallelism={"mode": "ddp"}, heterogeneity={"compute": {1: 1.7, 3: 0.9}}
    ),
    "ddp-fat-tree": dict(n=16, topology=FAT, parallelism={"mode": "ddp"}),
    "fsdp": dict(n=4, parallelism={"mode": "fsdp"}),
    "tp": dict(n=4, parallelism={"mode": "tp"}),
    "1f1b": dict(n=4, parallelism={"mode": "1f1b", "microbatches": 4}),
    "hybrid": dict(
        n=8, parallelism={"mode": "hybrid", "dp": 4, "inner": "gpipe", "microbatches": 2}
    ),
    "hop": dict(
        n=4, iterations=3, parallelism={"mode": "hop"}, heterogeneity={"compute": {1: 3.0}}
    ),
}


def _run(case: dict, runs: bool):
    c = dict(case)
    n = c.pop("n")
    cfg = {"num_gpus": n, "batch_size": 8 * n, "topology": c.pop("topology", RING), **c}
    s = Simulation(cfg, trace=chain_trace(batch=8, layers=6))
    s.extrapolator.compute_runs = runs
    return s, s.run()


@pytest.mark.parametrize("name", list(CASES))
def test_compute_runs_give_the_per_operator_timeline(name):
    _, ref = _run(CASES[name], runs=False)
    sim, fast = _run(CASES[name], runs=True)
    pd.testing.assert_frame_equal(fast.timeline, ref.timeline, check_exact=True)
    assert fast.iteration_times == ref.iteration_times
    pd.testing.assert_frame_equal(fast.memory, ref.memory, check_exact=True)
    assert fast.peak_memory == ref.peak_memory
    # the shared memory curves against one curve per GPU
    mem, peaks = memory_timeline(
        fast.timeline, sim.trace, sim.extrapolator, sim.gpus, sim.config.memory, share=False
    )
    pd.testing.assert_frame_equal(fast.memory, mem, check_exact=True)
    assert fast.peak_memory == peaks


def test_ddp_emits_shared_runs_and_few_tasks_per_gpu():
    # the point of the runs: a GPU's compute stream is O(buckets) tasks, the same run
    # objects for every GPU
    sim, _ = _run(CASES["ddp-fat-tree"], runs=True)  # default buckets: few
    streams = sim.extrapolator.streams()
    a, b = list(streams[0, "compute"]), list(streams[5, "compute"])
    runs_a = [t for t in a if type(t) is ComputeRun]
    assert runs_a and all(
        x is y for x, y in zip(runs_a, [t for t in b if type(t) is ComputeRun], strict=True)
    )
    assert not any(type(t) is Compute for t in a)
    assert len(a) < sum(len(r) for r in runs_a)


def _runtime(streams, scale=None):
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.ring(2, 1e9, 1e-6))
    rt = Runtime(env, net, Textbook(env, net), compute_scale=scale)
    for (gpu, stream), tasks in streams.items():
        rt.start(gpu, stream, tasks)
    env.run()
    rt.check_finished()
    return rt


def _c(i, d, op_id=None):
    return Compute(
        f"op{i}",
        f"layer{i % 3}",
        "forward" if i % 2 else "backward",
        d,
        i if op_id is None else op_id,
        i % 2,
    )


def test_runs_end_where_sequential_sums_do():
    # durations whose sums round differently in another order: the run must reach what
    # adding them one by one from the run's start reaches (the straightforward path's sum)
    ds = [0.1, 0.2, 1e-9, 0.0, 0.3, 1e-17, 0.7, 3.3e-5]
    run = ComputeRun([_c(i, d) for i, d in enumerate(ds)])
    tail = [_c(10 + i, d) for i, d in enumerate(ds[:3])]
    streams = {
        (0, "a"): [_c(99, 0.05), Wait("go"), run, *tail, Signal("x")],
        (1, "a"): [_c(98, 0.013), Signal("go"), Iteration(4), run, run],
    }
    rt = _runtime(streams, scale={1: 1.3})
    tl = pd.DataFrame(rt.rows, columns=list(COLUMNS))
    t = 0.05  # GPU 0 waits for GPU 1's signal at 0.013 * 1.3 < 0.05: no wait
    ends = []
    for d in ds + ds[:3]:
        t = t + d
        ends.append(t)
    g0 = tl[(tl.gpu == 0) & (tl.kind == "compute")]
    assert g0["end"].tolist()[1:] == ends
    t = 0.013 * 1.3
    ends = []
    for d in ds + ds:
        t = t + d * 1.3
        ends.append(t)
    g1 = tl[(tl.gpu == 1) & (tl.kind == "compute")]
    assert g1["end"].tolist()[1:] == ends
    assert g1["iteration"].tolist() == [0] + [4] * 2 * len(ds)  # Iteration(4) renumbers


def test_columnar_timeline_equals_one_tuple_per_row():
    run = ComputeRun([_c(i, 1e-3 * (i + 1)) for i in range(5)])
    plain = ComputeRun([Compute("x", "", "", 1e-4)])  # op_id None: the column is not ints
    streams = {
        (0, "a"): [run, Signal("s"), _c(7, 1e-4), run],
        (1, "a"): [Wait("s"), run, plain],
        (1, "b"): [_c(3, 2e-3), Wait("s")],
    }
    rt = _runtime(streams)
    ref = pd.DataFrame(rt.rows, columns=list(COLUMNS))
    got = pd.DataFrame(rt.timeline_columns(), columns=list(COLUMNS))
    # text columns come as categoricals (a code per row); their values are the rows'
    # (key, with None on computes, stays a string column)
    text = ["stream", "kind", "name", "layer", "phase"]
    assert all(isinstance(got[c].dtype, pd.CategoricalDtype) for c in text)
    assert list(got["kind"].cat.categories) == sorted(set(ref["kind"]))  # sorted: sorts as text
    got[text] = got[text].astype(ref[text].dtypes.to_dict())
    pd.testing.assert_frame_equal(got, ref, check_exact=True)
    # GPU 0: 5 + 1 + 5 computes; GPU 1: a wait, 5 + 1 computes; stream b: 1 compute, a wait
    assert len(ref) == 11 + 7 + 2 and ref["op_id"].isna().sum() == 1


def test_negative_durations_are_refused_in_runs_too():
    with pytest.raises(ValueError, match="Negative delay"):
        _runtime({(0, "a"): [ComputeRun([_c(0, 1e-3), _c(1, -1e-3)])]})


def test_cumsum_adds_left_to_right():
    # what the runs rely on: numpy's cumsum is a sequential sum, not a pairwise one
    rng = np.random.default_rng(1)
    d = np.r_[0.123, rng.exponential(1e-3, 4000)]
    t, seq = 0.0, []
    for x in d:
        t = t + x
        seq.append(t)
    assert np.cumsum(d).tolist() == seq


# -- routing: bounded per-source rows against full rows ------------------------------------
def _reference_paths(graph, pairs, mode="latency"):
    """Paths by full Dijkstra rows and the plain walk (the straightforward routing, one
    rule for both speed-up tests: tests/test_route_speedups.reference_paths), by pair."""
    from tests.test_route_speedups import reference_paths

    return dict(zip(pairs, reference_paths(graph, pairs, mode), strict=True))


def _skewed(g, seed):
    """The same graph with random link latencies and bandwidths (ties and non-ties)."""
    rng = np.random.default_rng(seed)
    g = g.copy()
    for _, _, d in g.edges(data=True):
        d["latency"] = float(rng.choice([0.0, 1e-6, 2e-6, 3.5e-6]))
        d["bandwidth"] = float(rng.choice([10e9, 50e9, 450e9]))
    return g


GRAPHS = {
    "fat_tree": lambda: topo.fat_tree(32, 50e9, 1e-6, radix=8),
    "torus": lambda: topo.torus2d(5, 6, 50e9, 1e-6),
    "multi_node": lambda: topo.multi_node(3, 4, 450e9, 50e9, 1e-6, 2e-6),
    "one_way_ring": lambda: topo.ring(9, 10e9, 1e-6, bidirectional=False),
    "skewed_mesh": lambda: _skewed(topo.mesh2d(4, 5, 50e9, 1e-6), 3),
    "skewed_fat_tree": lambda: _skewed(topo.fat_tree(20, 50e9, 1e-6, radix=8), 4),
}


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("mode", ["latency", "hops"])
def test_bounded_routes_are_the_full_rows_routes(name, mode):
    import networkx as nx

    from networks.base import gpu_nodes
    from networks.routing import Routes

    g = GRAPHS[name]()
    gpus = gpu_nodes(g)
    g.add_node("island", kind="gpu")  # unreachable: no path either way
    pairs = [(a, b) for a in [*gpus, "island"] for b in [*gpus, "island"]]
    ref = _reference_paths(g, pairs, mode)
    r = Routes(g, mode)
    # ask in an order that grows each source's ball several times
    for a, b in sorted(pairs, key=lambda p: (hash(p) % 7, repr(p))):
        got = r.path_links(a, b)
        assert (None if got is None else got.tolist()) == ref[a, b], (a, b)
    assert nx.has_path(g, gpus[0], gpus[-1]) and ref[gpus[0], "island"] is None


def test_progress_bar_names_the_steps_after_the_event_loop():
    import io

    from triosim.simulation.progress import run_with_progress

    sim = Simulation({"num_gpus": 2, "parallelism": {"mode": "ddp"}}, trace=chain_trace())
    out = io.StringIO()
    r = run_with_progress(sim, file=out, enabled=True, delay=0, interval=0.001)
    last = out.getvalue().strip().split("\r")[-1]
    assert f"{r.total_time * 1e3:.3f} ms simulated, memory" in last


def test_memory_curves_do_not_depend_on_the_timeline_row_order():
    # each GPU's rows are put in (start, end) order; with no two compute rows of a GPU
    # at the same (start, end) that order is unique, so shuffled rows give the same curves
    sim, r = _run(CASES["ddp-heterogeneous"], runs=True)
    comp = r.timeline[r.timeline["kind"] == "compute"]
    assert not comp.duplicated(["gpu", "start", "end"]).any()
    shuffled = r.timeline.sample(frac=1.0, random_state=3).reset_index(drop=True)
    mem, peaks = memory_timeline(shuffled, sim.trace, sim.extrapolator, sim.gpus, sim.config.memory)
    pd.testing.assert_frame_equal(mem, r.memory, check_exact=True)
    assert peaks == r.peak_memory


def test_vectorised_union_is_the_loop_union():
    from triosim.common.intervals import union_length
    from triosim.results.unions import union_sorted

    rng = np.random.default_rng(5)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        grid = rng.choice([1e-3, 1e-4 / 3, 0.1])  # coarse grids: ties and touching ends
        s = np.round(rng.uniform(0, 1, n) / grid) * grid
        e = s + np.round(rng.exponential(0.05, n) / grid) * grid
        order = np.argsort(s, kind="stable")
        assert union_sorted(s[order], e[order]) == union_length(s, e), trial


def test_a_collective_posted_with_another_group_is_refused():
    # the group is compared by identity first; an equal tuple is the same group, another
    # one is an error
    from extrapolators.execution.tasks import Collective
    from triosim.common.errors import SimulationError

    same = {(g, "a"): [Collective("allreduce", (0, 1), 1e6, "k")] for g in (0, 1)}
    rt = _runtime(same)
    assert rt.collective_bytes == {"allreduce": 1e6}
    with pytest.raises(SimulationError, match="different groups"):
        _runtime(
            {
                (0, "a"): [Collective("allreduce", (0, 1), 1e6, "k")],
                (1, "a"): [Collective("allreduce", (1, 0), 1e6, "k")],
            }
        )


# -- 3d (dp x tp x pp): stage templates of shared runs against one task per operator -------
GPT2_CPU = "traces/cpu/gpt2-small-b8.trace.json.gz"  # 2 blocks: Megatron roles, loss, tied

THREED = {
    "dp2-tp2-pp2-1f1b": dict(
        n=8, parallelism={"mode": "3d", "dp": 2, "tp": 2, "pp": 2, "microbatches": 4}
    ),
    "interleaved-tp2": dict(
        n=8,
        parallelism={
            "mode": "3d",
            "dp": 2,
            "tp": 2,
            "pp": 2,
            "microbatches": 4,
            "schedule": "interleaved",
            "virtual_stages": 2,
        },
    ),
    "interleaved-mode": dict(n=2, parallelism={"mode": "interleaved", "microbatches": 8}),
    "gpipe-no-overlap-sp": dict(
        n=8,
        parallelism={
            "mode": "3d",
            "dp": 2,
            "tp": 2,
            "pp": 2,
            "microbatches": 2,
            "schedule": "gpipe",
            "dp_overlap": False,
            "sequence_parallel": True,
        },
    ),
    "channel-dp-innermost": dict(
        n=8,
        parallelism={
            "mode": "3d",
            "dp": 2,
            "tp": 2,
            "pp": 2,
            "microbatches": 2,
            "tp_style": "channel",
            "placement": "dp-pp-tp",
        },
    ),
    "heterogeneous-2-iterations": dict(
        n=8,
        iterations=2,
        topology=FAT,
        heterogeneity={"compute": {1: 1.7, 6: 0.9}},
        parallelism={"mode": "3d", "dp": 2, "tp": 2, "pp": 2, "microbatches": 2},
    ),
    "dp-only": dict(n=4, parallelism={"mode": "3d", "dp": 4, "bucket_size": 1e6}),
    "gpt2-dp2-tp2-pp2-sp": dict(
        n=8,
        trace=GPT2_CPU,
        batch=2,
        parallelism={
            "mode": "3d",
            "dp": 2,
            "tp": 2,
            "pp": 2,
            "microbatches": 2,
            "sequence_parallel": True,
        },
    ),
    "gpt2-tp4-interleaved": dict(
        n=8,
        trace=GPT2_CPU,
        batch=2,
        iterations=2,
        heterogeneity={"compute": {3: 1.25}},
        parallelism={
            "mode": "3d",
            "dp": 1,
            "tp": 2,
            "pp": 4,
            "microbatches": 4,
            "schedule": "interleaved",
            "virtual_stages": 2,
        },
    ),
}


def _run_any(case: dict, runs: bool):
    """As `_run`, on a shipped trace where the case names one (`batch`: per GPU)."""
    c = dict(case)
    path = c.pop("trace", None)
    if path is None:
        return _run(c, runs)
    n, batch = c.pop("n"), c.pop("batch")
    cfg = {
        "num_gpus": n,
        "batch_size": batch * n,
        "topology": c.pop("topology", RING),
        "trace": path,
        **c,
    }
    s = Simulation(cfg)
    s.extrapolator.compute_runs = runs
    return s, s.run()


@pytest.mark.parametrize("name", list(THREED))
def test_3d_templates_give_the_per_operator_timeline(name):
    _, ref = _run_any(THREED[name], runs=False)
    sim, fast = _run_any(THREED[name], runs=True)
    pd.testing.assert_frame_equal(fast.timeline, ref.timeline, check_exact=True)
    assert fast.iteration_times == ref.iteration_times
    pd.testing.assert_frame_equal(fast.memory, ref.memory, check_exact=True)
    assert fast.peak_memory == ref.peak_memory
    # the fast path did use shared runs (the test compares two different paths)
    streams = sim.extrapolator.streams()
    tasks = list(streams[sim.gpus[-1], "compute"])
    assert any(type(t) is ComputeRun for t in tasks)
    assert not any(type(t) is Compute for t in tasks)


def test_3d_streams_share_each_stages_runs():
    # every GPU of a stage yields the same run objects; the other tasks as the per-op path
    sim, _ = _run_any(THREED["dp2-tp2-pp2-1f1b"], runs=True)
    x = sim.extrapolator
    at = x.layout.at  # (pp, dp_replicate, dp_shard, cp, tp)
    a = list(x.streams()[at[1, 0, 0, 0, 0], "compute"])
    b = list(x.streams()[at[1, 1, 0, 0, 1], "compute"])
    ra, rb = ([t for t in s if type(t) is ComputeRun] for s in (a, b))
    assert ra and all(p is q for p, q in zip(ra, rb, strict=True))
    x.compute_runs = False
    ref = list(x.streams()[at[1, 0, 0, 0, 0], "compute"])
    assert [t for t in a if type(t) is not ComputeRun] == [t for t in ref if type(t) is not Compute]
    assert [c for r in ra for c in r.tasks] == [t for t in ref if type(t) is Compute]


def _reference_hop_rows(graph, routes, sources, targets):
    """rings.hop_rows as it was: every node of each source's tree, in distance order."""
    from extrapolators.communication.rings import NET_WEIGHT, NS_WEIGHT

    cap = {(u, v): d["bandwidth"] for u, v, d in graph.edges(data=True)}
    idx = routes.node_index
    t_idx = np.array([idx[t] for t in targets])
    out = []
    dist, pred = routes.trees(sources)
    for row, prow, s in zip(np.atleast_2d(dist), np.atleast_2d(pred), sources, strict=True):
        bott = np.full(len(routes.nodes), np.inf)
        hops = np.zeros(len(routes.nodes))
        for v in np.argsort(row, kind="stable"):
            p = prow[v]
            if p >= 0 and np.isfinite(row[v]):
                bott[v] = min(bott[p], cap[(routes.nodes[p], routes.nodes[v])])
                hops[v] = hops[p] + 1
        d = row[t_idx]
        ok = np.isfinite(d)
        lat = np.where(
            ok, np.floor(np.mod(np.where(ok, d, 0), NET_WEIGHT) / NS_WEIGHT) * 1e-9, np.inf
        )
        b = np.where(ok, bott[t_idx], 0.0)
        b[t_idx == idx[s]] = np.inf
        out.append((b, lat, np.where(ok, hops[t_idx], np.inf)))
    return out


@pytest.mark.parametrize("name", list(GRAPHS))
def test_hop_rows_walk_the_tree_paths_as_the_whole_tree_did(name):
    from extrapolators.communication.rings import hop_rows, ring_order
    from networks.base import gpu_nodes
    from networks.routing import Routes

    g = GRAPHS[name]()
    gpus = gpu_nodes(g)
    g.add_node("island", kind="gpu")  # unreachable both ways
    r = Routes(g)
    for sources, targets in [(gpus, [*gpus, "island"]), (gpus[:3], gpus[-5:]), (["island"], gpus)]:
        got = hop_rows(g, r, sources, targets)
        ref = _reference_hop_rows(g, r, sources, targets)
        for x, y in zip(got, ref, strict=True):
            for a, b in zip(x, y, strict=True):
                assert a.tolist() == b.tolist(), name
    assert len(ring_order(g, gpus, r)) == len(gpus)


# -- tp: one template of shared runs and collectives for every GPU -------------------------
TP = {
    "tp4": dict(n=4, parallelism={"mode": "tp"}),
    "tp-sp-heterogeneous-2-iterations": dict(
        n=4,
        iterations=2,
        heterogeneity={"compute": {2: 1.3}},
        parallelism={"mode": "tp", "sequence_parallel": True},
    ),
    "tp-channel": dict(n=2, parallelism={"mode": "tp", "tp_style": "channel"}),
    "gpt2-tp2-sp": dict(
        n=2, trace=GPT2_CPU, batch=2, parallelism={"mode": "tp", "sequence_parallel": True}
    ),
    "gpt2-hybrid-tp": dict(
        n=4,
        trace=GPT2_CPU,
        batch=2,
        iterations=2,
        parallelism={"mode": "hybrid", "dp": 2, "inner": "tp"},
    ),
}


def _run_nested(case: dict, runs: bool):
    """As `_run_any`, with `runs` set on a hybrid's replicas too."""
    c = dict(case)
    path, n, batch = c.pop("trace", None), c.pop("n"), c.pop("batch", 8)
    cfg = {"num_gpus": n, "batch_size": batch * n, "topology": c.pop("topology", RING), **c}
    s = (
        Simulation({**cfg, "trace": path})
        if path
        else Simulation(cfg, trace=chain_trace(batch=8, layers=6))
    )
    for x in [s.extrapolator, *getattr(s.extrapolator, "replicas", [])]:
        x.compute_runs = runs
    return s, s.run()


@pytest.mark.parametrize("name", list(TP))
def test_tp_template_gives_the_per_operator_timeline(name):
    _, ref = _run_nested(TP[name], runs=False)
    sim, fast = _run_nested(TP[name], runs=True)
    pd.testing.assert_frame_equal(fast.timeline, ref.timeline, check_exact=True)
    assert fast.iteration_times == ref.iteration_times
    pd.testing.assert_frame_equal(fast.memory, ref.memory, check_exact=True)
    assert fast.peak_memory == ref.peak_memory
    a, b = (list(sim.extrapolator.streams()[g, "compute"]) for g in sim.gpus[:2])
    runs = [t for t in a if type(t) is ComputeRun]
    assert runs and all(
        x is y for x, y in zip(runs, [t for t in b if type(t) is ComputeRun], strict=True)
    )
    # the computes left one by one are the optimizer's only
    assert {t.phase for t in a if type(t) is Compute} <= {"optimizer"}


def test_3d_groups_are_the_ring_passes():
    # groups in ring order from ring positions, against the pass over the whole ring
    import random

    from extrapolators.modes.mesh.dims import Layout

    sim, _ = _run_any(THREED["dp2-tp2-pp2-1f1b"], runs=True)
    x = sim.extrapolator
    ring = list(x.ring)
    random.Random(4).shuffle(ring)
    for r in (tuple(ring), (*ring, ring[0]), tuple(ring[1:])):  # shuffled, a repeat, a gap
        layout = Layout(x.mesh, x.gpus, r)  # (the mesh carries the rank order)
        at = layout.at
        for (p, d, s, c, t), _g in at.items():
            for got, members in (
                (layout.group((p, d, s, c, t), ("tp",)), [at[p, d, s, c, u] for u in range(2)]),
                (
                    layout.group((p, d, s, c, t), ("dp_replicate", "dp_shard", "cp")),
                    [at[p, e, s, c, t] for e in range(2)],
                ),
            ):
                assert got == tuple(g for g in r if g in set(members))
        assert layout.group((1, 1, 0, 0, 0), ("tp",)) is layout.group((1, 1, 0, 0, 1), ("tp",))


@pytest.mark.parametrize("runs", [True, False], ids=["blocks", "rows"])
@pytest.mark.parametrize("name", list(CASES))
def test_what_is_read_from_the_log_is_what_the_table_gives(name, runs):
    # a run's iteration times, busy-time breakdown and memory curves are read from the
    # runtime's log (extrapolators.execution.timeline_log); the table, built afterwards, must give the
    # same numbers through the table's own code paths (groupby, unions of its rows, one
    # memory curve per GPU with no sharing)
    sim, r = _run(CASES[name], runs)
    log = r._log
    assert log is not None  # nothing has asked for the table yet
    breakdown = r.per_gpu()
    curves, peaks = memory_curves(log, sim.trace, sim.extrapolator, sim.gpus, sim.config.memory)
    table = r.own_timeline
    assert r._log is None  # the table replaces the log
    assert r.iteration_ends == table.groupby("iteration")["end"].max().sort_index().tolist()
    r._per_gpu = None
    pd.testing.assert_frame_equal(r.per_gpu(), breakdown, check_exact=True)
    ref, ref_peaks = memory_curves(
        table, sim.trace, sim.extrapolator, sim.gpus, sim.config.memory, share=False
    )
    assert peaks == ref_peaks
    for a, b, ta, tb in zip(curves.states, ref.states, curves.times, ref.times, strict=True):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(a, b)


def test_a_log_backed_result_pickles_with_its_table():
    sim, r = _run(CASES["1f1b"], runs=True)
    assert r._log is not None
    back = pickle.loads(pickle.dumps(r))
    assert back._log is None and r._log is None
    pd.testing.assert_frame_equal(back.timeline, r.timeline, check_exact=True)
    assert back.iteration_time == r.iteration_time


def test_compute_rows_of_several_streams_come_in_start_order():
    # GPU 1 computes on two streams; the log holds its rows in the order they ended, the
    # memory model reads them by (start, end) as the table path's stable lexsort orders them
    run = ComputeRun([_c(i, 1e-3 * (i + 1)) for i in range(4)])
    streams = {
        (0, "a"): [run, Signal("s"), _c(7, 1e-4)],
        (1, "a"): [_c(5, 3e-3), Wait("s"), run],
        (1, "b"): [run, _c(3, 2e-4), run],
    }
    rt = _runtime(streams)
    log = rt.timeline().compute_rows()
    table = _FrameRows(pd.DataFrame(rt.timeline_columns(), columns=list(COLUMNS)))
    starts = log.columns(1)["start"]
    assert starts == sorted(starts) and len(starts) == 1 + 4 + 4 + 1 + 4
    for g in (0, 1):
        got, ref = log.columns(g), table.columns(g)
        assert got.keys() == ref.keys()
        for c in got:
            assert got[c] == ref[c], (g, c)
    assert log.end == table.end == max(rt.timeline_columns()["end"])


def test_compute_rows_signatures_differ_when_any_read_column_does():
    # GPUs share a memory curve when their signatures are equal: a row differing in any
    # column the memory model reads (op_id, start, end, iteration, microbatch, phase) must
    # make them differ; one differing only in what it does not read (name, layer) must not
    row = (0, "a", "compute", "op", "L", "forward", 1.0, 2.0, 0.0, None, 0, 5, 0)
    read = {"phase": 5, "start": 6, "end": 7, "iteration": 10, "op_id": 11, "microbatch": 12}
    other = {
        "phase": "backward",
        "start": 1.5,
        "end": 2.5,
        "iteration": 1,
        "op_id": 6,
        "microbatch": 1,
    }
    for col, k in [*read.items(), ("name", 3), ("layer", 4)]:
        changed = list(row)
        changed[0] = 1
        changed[k] = other.get(col, "x")
        rows = TimelineLog([row, tuple(changed)]).compute_rows()
        assert (rows.signature(0) != rows.signature(1)) == (col in read), col
    run = ComputeRun([_c(i, 1e-3) for i in range(3)])
    acc = np.array([0.0, 1e-3, 2e-3, 3e-3])
    blocks = [
        Block((0, "a", 0), run, acc),
        Block((1, "a", 0), run, acc.copy()),
        Block((2, "a", 0), run, acc + 1e-3),
        Block((3, "a", 1), run, acc),
    ]
    rows = TimelineLog(blocks).compute_rows()
    assert rows.signature(0) == rows.signature(1)  # equal instants, another array
    assert rows.signature(2) != rows.signature(0) != rows.signature(3)  # instants; iteration


def test_iteration_ends_count_every_row_and_no_empty_block():
    # an iteration ends with its latest row of any kind (here a collective and a wait, not
    # a compute); a block of no computes has no row, so its instant does not count
    run = ComputeRun([_c(i, 0.25) for i in range(4)])
    empty = ComputeRun([])
    log = [
        Block((0, "a", 0), run, np.array([0.0, 0.25, 0.5, 0.75, 1.0])),
        (0, "b", "comm", "allreduce", "", "", 0.5, 2.0, 8.0, "k", 0, -1, -1),
        (1, "a", "compute", "op", "", "forward", 2.0, 3.0, 0.0, None, 1, 7, 0),
        (1, "b", "wait", "wait", "", "", 3.0, 5.0, 0.0, "w", 1, -1, -1),
        Block((1, "a", 1), empty, np.array([9.0])),
    ]
    tl = TimelineLog(log)
    table = pd.DataFrame(tl.columns(), columns=list(COLUMNS))
    assert tl.iteration_ends() == [2.0, 5.0]
    assert table.groupby("iteration")["end"].max().tolist() == [2.0, 5.0]
    assert tl.compute_rows().end == 5.0 == table["end"].max()


def test_compute_rows_read_twice_are_the_same():
    rt = _runtime(
        {(0, "a"): [ComputeRun([_c(i, 1e-3) for i in range(3)]), Signal("s"), _c(9, 2e-3)]}
    )
    tl = rt.timeline()
    first, second = tl.compute_rows(), tl.compute_rows()  # the second scans again
    assert first.signature(0) == second.signature(0) and len(first.signature(0)) == 2
    assert first.columns(0) == second.columns(0)
    assert len(first.columns(0)["start"]) == 4 and tl.iteration_ends() == [5e-3]


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31), groups=st.integers(1, 7), n=st.integers(0, 60), pad=st.booleans()
)
def test_grouped_unions_are_each_groups_union(seed, groups, n, pad):
    # every group's union length, all at once, bit for bit as one union_sorted per group
    # (coarse grids: ties, touching and nested intervals; groups with no interval), through
    # the padded matrix and through the per-group fallback
    import triosim.results.unions as res

    rng = np.random.default_rng(seed)
    grid = rng.choice([1e-3, 1e-4 / 3, 0.1])
    s = np.round(rng.uniform(0, 1, n) / grid) * grid
    e = s + np.round(rng.exponential(0.05, n) / grid) * grid
    codes = rng.integers(0, groups, n)
    limit = res.PAD_LIMIT
    res.PAD_LIMIT = limit if pad else 0
    try:
        got = res.union_lengths(codes, s, e, groups)
    finally:
        res.PAD_LIMIT = limit
    for g in range(groups):
        mine = np.flatnonzero(codes == g)
        order = mine[np.argsort(s[mine], kind="stable")]
        want = res.union_sorted(s[order], e[order]) if len(order) else 0.0
        assert got[g] == want, (g, got[g], want)


def test_a_compute_of_no_micro_batch_is_one_micro_batch_in_both_paths():
    # a custom stream's Compute(mb=None) (no micro-batch: the batch is not split) holds its
    # activations as micro-batch 0 would; the table (a float column, NaN for None) and the
    # run's log must both read it so (NaN != NaN once made every row a micro-batch of its own)
    def run(mb):
        cfg = {
            "num_gpus": 2,
            "batch_size": 16,
            "topology": RING,
            "parallelism": {"mode": "ddp"},
            "communication": {"kind": "textbook"},
        }
        s = Simulation(cfg, trace=chain_trace(batch=8, layers=4))
        ops = s.trace.operators
        s.extrapolator.streams = lambda **kw: {
            **{
                (g, "compute"): [Compute(o.name, o.layer, o.phase, 1e-3, o.id, mb) for o in ops]
                for g in s.gpus
            },
            **{
                (g, "comm"): [Collective("allreduce", tuple(s.gpus), 1e6, "c0", "x", "backward")]
                for g in s.gpus
            },
        }
        return s, s.run()

    s, none = run(None)
    _, zero = run(0)
    pd.testing.assert_frame_equal(none.memory, zero.memory, check_exact=True)
    from_table, peaks = memory_timeline(
        none.timeline, s.trace, s.extrapolator, s.gpus, s.config.memory
    )
    pd.testing.assert_frame_equal(from_table, none.memory, check_exact=True)
    assert peaks == none.peak_memory == zero.peak_memory
