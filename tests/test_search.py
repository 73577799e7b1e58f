"""triosim search: candidates, memory filter, ranking equal to separate runs."""

import math
from pathlib import Path

import pytest

from tests.conftest import chain_trace
from triosim.simulation.wiring import Simulation
from triosim.studies.search import candidates, search
from triosim.trace.model import save

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def base(tmp_path):
    path = save(chain_trace(batch=8, layers=4), tmp_path / "c.trace.json.gz")
    return {
        "trace": str(path),
        "num_gpus": 4,
        "batch_size": 16,
        "topology": {"kind": "ring", "bandwidth": "10 GB/s", "latency": "1 us"},
    }


def test_candidates_cover_every_family():
    labels = [label for label, _ in candidates(4, 16)]
    big = dict(candidates(8, 16))
    grid = {"mode": "3d", "dp": 2, "tp": 2, "pp": 2, "microbatches": 4, "schedule": "1f1b"}
    assert big["3d dp 2 x tp 2 x pp 2 (1f1b, 4 mb)"] == grid
    want = {**grid, "distributed_optimizer": True}
    assert big["3d dp 2 x tp 2 x pp 2 (1f1b, 4 mb, distributed optimizer)"] == want
    for want in (
        "dp",
        "ddp",
        "fsdp zero-3",
        "tp 4",
        "gpipe 4 stages x 8 mb",
        "dp 2 x tp 2",
        "dp 2 x 1f1b 2 stages x 4 mb",
        "cp 4 (ring)",
        "dp 2 x cp 2 (all-to-all)",
        "cp 4 (ring, distributed optimizer)",
        "dp 2 x cp 2 (ring, fsdp)",
        "tp 2 x cp 2 (ring, SP, distributed optimizer)",
        "tp 2 x cp 2 (all-to-all, SP, distributed optimizer)",
        "3d dp 1 x tp 1 x pp 2 x cp 2 (1f1b, 4 mb, ring)",
        "3d dp 1 x tp 1 x pp 2 x cp 2 (1f1b, 4 mb, ring, distributed optimizer)",
        "fsdp 2 x tp 2",  # the mesh: FSDP2 with the other dimensions, torchtitan's
        "fsdp 2 x tp 2 (full recompute)",
        "hsdp 2 x 2",
        "fsdp 2 x pp 2 (1f1b, 4 mb)",
        "fsdp 2 x pp 2 (interleaved, 4 mb, full recompute)",
        "fsdp 2 x pp 2 (zb1p, 4 mb)",
    ):
        assert want in labels
    mesh = {"mode": "mesh", "pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    mesh.update(microbatches=4, sequence_parallel=True, schedule="1f1b", virtual_stages=1)
    assert big["fsdp 2 x tp 2 x pp 2 (1f1b, 4 mb)"] == {**mesh, "recompute": "none"}
    # every mesh candidate is a valid factorisation: its degrees multiply to the GPUs; it
    # shards (FSDP) or folds experts out of them
    for label, par in candidates(8, 16):
        if par["mode"] == "mesh":
            degrees = [par[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]
            assert math.prod(degrees) == 8 and (par["dp_shard"] > 1 or "ep" in par), label


@pytest.mark.no_cover
def test_the_search_finds_context_parallelism_where_nothing_else_splits_the_batch(tmp_path):
    """One sequence on 4 GPUs: no data-parallel plan splits a batch of 1 (dp 2 x cp 2
    neither), so the plans that run include cp 4 both ways, each as fast as its separate
    run; a trace without fused attention skips them with the reason."""
    from tests.test_context_parallel import attention_trace

    path = save(attention_trace(b=1, s=256, H=8, d=64), tmp_path / "a.trace.json.gz")
    cfg = {
        "trace": str(path),
        "num_gpus": 4,
        "batch_size": 1,
        "topology": {"kind": "switch", "bandwidth": "100 GB/s", "latency": "1 us"},
    }
    ranked, table, best = search(cfg, progress=False)
    cp = {p for p in ranked["plan"] if "cp" in p}
    with_tp = {f"tp 2 x cp 2 ({how}, SP, distributed optimizer)" for how in ("ring", "all-to-all")}
    assert (
        cp
        == {"cp 4 (ring)", "cp 4 (all-to-all)", "cp 4 (ring, distributed optimizer)"}
        | {"cp 4 (ring, fsdp)"}
        | with_tp
    )
    assert "batch_size" in table.set_index("plan").loc["dp 2 x cp 2 (ring)", "reason"]
    for label in [*with_tp, "cp 4 (ring, fsdp)"]:  # each as its separate run
        par = dict(candidates(4, 1))[label]
        alone = Simulation({**cfg, "parallelism": par}).run().iteration_time
        got = ranked.set_index("plan").loc[label, "iteration_time_ms"]
        assert got == pytest.approx(alone * 1e3, rel=1e-12)
    assert not {"ddp", "dp"} & set(ranked["plan"])  # a batch of 1 does not split
    row = ranked.set_index("plan").loc["cp 4 (ring)"]
    par = {"mode": "cp", "cp": 4, "cp_comm": "p2p"}
    alone = Simulation({**cfg, "parallelism": par}).run().iteration_time
    assert row["iteration_time_ms"] == pytest.approx(alone * 1e3, rel=1e-12)
    chain = save(chain_trace(batch=8), tmp_path / "c.trace.json.gz")
    _, table, _ = search({**cfg, "trace": str(chain), "batch_size": 8}, progress=False)
    why = table.set_index("plan").loc["cp 4 (ring)", "reason"]
    assert "scaled_dot_product" in why


@pytest.mark.no_cover
def test_the_best_is_the_fastest_of_the_separate_runs(base):
    ranked, table, best = search(base, progress=False)
    assert len(ranked) >= 10 and (ranked["status"] == "ok").all()
    times = []
    for _label, par in candidates(4, 16):
        try:
            times.append(Simulation({**base, "parallelism": par}).run().iteration_time)
        except Exception:  # noqa: BLE001 - a plan the trace does not allow
            continue
    assert ranked.loc[0, "iteration_time_ms"] == pytest.approx(min(times) * 1e3, rel=1e-12)
    assert Simulation(best).run().iteration_time == pytest.approx(min(times), rel=1e-12)


def test_the_search_never_returns_a_plan_that_does_not_fit(base):
    # 16 MB of fp32 weights, no optimizer states: DP holds 32 MB (weights + gradients) per
    # GPU, ZeRO-3 a quarter. With 20 MB usable, replicated plans must drop out (without the
    # cuBLAS workspaces, 64 MiB on the chain trace's GPU, which no plan could fit beside)
    tight = {**base, "memory": {"capacity": "21 MB", "reserve": "1 MB", "workspace": 0}}
    ranked, table, _ = search(tight, progress=False)
    assert len(ranked) and "dp" not in set(ranked["plan"]) and "ddp" not in set(ranked["plan"])
    assert (ranked["peak_memory_gb_max"] * 1e9 <= 20e6).all()
    assert table["status"].str.startswith("out of memory").sum() >= 2


@pytest.mark.no_cover
def test_search_tries_expert_parallelism_on_an_moe_trace():
    """ep for every degree above 1 dividing N (both gradient schedules), the rest data
    parallel; an ep candidate evaluates as its own run does; a dense trace refuses it with
    the reason (no MoE layer)."""
    from triosim.simulation.wiring import Simulation
    from triosim.studies.search import _evaluate, candidates

    plans = dict(candidates(4, 8))
    assert plans["dp 2 x ep 2"] == {"mode": "ep", "ep": 2, "dp_overlap": False}
    assert plans["ep 4 (overlapped reduction)"] == {"mode": "ep", "ep": 4, "dp_overlap": True}
    assert not any(label.startswith("ep 3") or "x ep 3" in label for label in plans)
    moe = str(ROOT / "traces/modelled/h100-sxm/mixtral-8x7b-s4096-b1.trace.json.gz")
    cfg = {
        "trace": moe,
        "num_gpus": 2,
        "batch_size": 2,
        "gpu": "H100-SXM",
        "perfmodel": {"kind": "calibrated"},
        "memory": {"capacity": "10 TB"},
        "parallelism": {"mode": "ep", "ep": 2, "dp_overlap": False},
    }
    row = _evaluate(cfg, ".")
    assert row["status"] == "ok"
    assert row["iteration_time_ms"] == Simulation(cfg).run().iteration_time * 1e3
    dense = {**cfg, "trace": str(ROOT / "traces/cpu/resnet18-b8.trace.json.gz"), "batch_size": 8}
    dense.pop("gpu")
    dense.pop("perfmodel")
    row = _evaluate(dense, ".")
    assert row["status"] == "invalid" and "parallelism" in row["reason"]


@pytest.mark.no_cover
def test_search_tries_expert_parallelism_with_tp_and_the_distributed_optimizer():
    """ep x tp for every tp above 1 dividing N (etp 1, and etp = tp where ep x tp divides
    N), ep with the distributed optimizer; an ep x tp candidate evaluates as its own run;
    an expert-TP degree whose ep x etp does not divide N is never proposed."""
    from triosim.studies.search import candidates

    plans = dict(candidates(4, 8))
    assert plans["ep 2 x tp 2"] == {"mode": "ep", "ep": 2, "tp": 2, "etp": 1, "dp_overlap": True}
    assert plans["ep 2 x tp 2 x etp 2"]["etp"] == 2
    assert "ep 4 x tp 2 x etp 2" not in plans  # ep x etp = 8 does not divide 4 GPUs
    assert plans["ep 4 (distributed optimizer)"]["distributed_optimizer"] is True
    assert plans["dp 2 x ep 2 (fsdp)"] == {"mode": "ep", "ep": 2, "fsdp": True}
    _mixtral_candidate_runs_as_itself(2, 2, "ep 2 x tp 2")


@pytest.mark.no_cover
def test_search_tries_expert_parallelism_with_pipeline_stages():
    """ep x pp for every pp above 1 and ep above 1 dividing a stage's GPUs (1F1B over 2 x
    pp micro-batches, the distributed optimizer), only where the batch splits over the
    stage's replicas and micro-batches; such a candidate evaluates as its own run."""
    from triosim.studies.search import candidates

    plans = dict(candidates(8, 16))
    par = plans["dp 2 x ep 2 x pp 2 (1f1b, 4 mb, distributed optimizer)"]
    assert par == {
        "mode": "ep",
        "ep": 2,
        "pp": 2,
        "accumulation_steps": 4,
        "schedule": "1f1b",
        "dp_overlap": True,
        "distributed_optimizer": True,
    }
    assert "ep 2 x pp 4 (1f1b, 8 mb, distributed optimizer)" in plans
    assert not any(" x pp 8" in label for label in plans if label.startswith("ep"))
    ep_pp = [label for label in dict(candidates(8, 8)) if " ep " in f" {label}" and "pp" in label]
    assert not any("x pp 4" in label for label in ep_pp)  # 8 % (2 x 8): the batch does not split
    _mixtral_candidate_runs_as_itself(4, 8, "ep 2 x pp 2 (1f1b, 4 mb, distributed optimizer)")


def test_search_tries_context_parallelism_inside_3d(tmp_path):
    """A 3D grid with a CP degree (2 stages of 2 ring ranks, 1F1B), with and without the
    distributed optimizer, is a candidate that runs, ranked at its separate run's time."""
    from tests.test_context_parallel import attention_trace

    path = save(attention_trace(b=4, s=256, H=8, d=64, layers=2), tmp_path / "a.trace.json.gz")
    cfg = {
        "trace": str(path),
        "num_gpus": 4,
        "batch_size": 4,
        "topology": {"kind": "switch", "bandwidth": "100 GB/s", "latency": "1 us"},
    }
    ranked, _, _ = search(cfg, progress=False)
    plain = "3d dp 1 x tp 1 x pp 2 x cp 2 (1f1b, 4 mb, ring)"
    for label in (plain, plain[:-1] + ", distributed optimizer)"):
        par = dict(candidates(4, 4))[label]
        alone = Simulation({**cfg, "parallelism": par}).run().iteration_time
        got = ranked.set_index("plan").loc[label, "iteration_time_ms"]
        assert got == pytest.approx(alone * 1e3, rel=1e-12)


@pytest.mark.no_cover
def test_search_tries_expert_parallelism_where_only_the_mesh_writes_it():
    """FSDP x EP x PP and CP x EP (refused before the mesh) are candidates where the batch
    splits; a CP x EP candidate evaluates on the Mixtral trace as its own run."""
    from triosim.studies.search import candidates

    plans = dict(candidates(8, 16))
    assert plans["fsdp 4 x ep 2 x pp 2 (1f1b, 4 mb)"] == {
        "mode": "mesh",
        "pp": 2,
        "dp_replicate": 1,
        "dp_shard": 4,
        "cp": 1,
        "tp": 1,
        "ep": 2,
        "microbatches": 4,
    }
    assert plans["dp 4 x cp 2 x ep 4 (ring)"]["cp"] == 2
    assert "fsdp 2 x ep 2 x pp 4 (1f1b, 8 mb)" not in dict(candidates(8, 8))  # 8 % (2 x 8)
    # (FSDP x EP x PP by hand: tests/test_mesh_experts.py)
    _mixtral_candidate_runs_as_itself(2, 2, "cp 2 x ep 2 (ring)")


def _mixtral_candidate_runs_as_itself(n: int, batch: int, label: str) -> None:
    """The search's candidate `label` for n GPUs, evaluated on the Mixtral trace, is ok and
    at its own run's iteration time."""
    from triosim.simulation.wiring import Simulation
    from triosim.studies.search import _evaluate, candidates

    moe = str(ROOT / "traces/modelled/h100-sxm/mixtral-8x7b-s4096-b1.trace.json.gz")
    cfg = {
        "trace": moe,
        "num_gpus": n,
        "batch_size": batch,
        "gpu": "H100-SXM",
        "perfmodel": {"kind": "calibrated"},
        "memory": {"capacity": "10 TB"},
        "parallelism": dict(candidates(n, batch))[label],
    }
    row = _evaluate(cfg, ".")
    assert row["status"] == "ok"
    assert row["iteration_time_ms"] == Simulation(cfg).run().iteration_time * 1e3
