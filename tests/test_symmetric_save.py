"""A symmetric run's result folder: its representatives' rows and which GPU each stands
for (every other GPU's rows are copies: gigabytes at hundreds of GPUs), read back and
drawn."""

import json

import pandas as pd
import pytest

from tests.conftest import chain_trace
from triosim.results.saved import plot_result, read_result_folder
from triosim.simulation.wiring import Simulation

NODES = {"kind": "switch", "bandwidth": "100 GB/s", "latency": "1 us"}


def _run(symmetry: str, par=None):
    cfg = {
        "num_gpus": 8,
        "batch_size": 64,
        "parallelism": {"mode": "mesh", **(par or {"tp": 2, "dp_shard": 4})},
        "topology": NODES,
        "symmetry": symmetry,
    }
    return Simulation(cfg, trace=chain_trace(batch=8, layers=4, weight_bytes=3e6)).run()


def test_a_symmetric_folder_holds_the_representatives_rows(tmp_path):
    r = _run("auto")
    assert "representative" in r.symmetry
    r.save(tmp_path / "sym")
    summary = json.loads((tmp_path / "sym" / "summary.json").read_text())
    rep_of = {int(g): rep for g, rep in summary["represented_by"].items()}
    assert sorted(rep_of) == r.gpus and summary["saved_rows"] == "representatives"
    reps = set(rep_of.values())
    assert len(reps) < len(r.gpus)
    timeline = pd.read_csv(tmp_path / "sym" / "timeline.csv")
    assert set(timeline["gpu"]) == reps and len(timeline) == len(r.own_timeline)
    # each image's rows are its representative's: the whole timeline has them all
    assert len(r.timeline) == len(timeline) * len(r.gpus) // len(reps)
    memory = pd.read_csv(tmp_path / "sym" / "memory.csv")
    assert set(memory["gpu"]) == reps
    per_gpu = pd.read_csv(tmp_path / "sym" / "per_gpu.csv", index_col=0)
    assert list(per_gpu.index) == r.gpus  # the per-GPU table keeps every GPU
    trace = json.loads((tmp_path / "sym" / "chrome_trace.json").read_text())
    named = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert named == {f"GPU {g}" for g in sorted(reps)} | {
        "network (transfers per source -> destination)"
    }
    saved = read_result_folder(tmp_path / "sym")
    assert saved.timeline_gpus == list(dict.fromkeys(rep_of.values()))
    for kind in ("overview", "timeline"):
        assert plot_result(saved, kind, tmp_path / f"{kind}.png").stat().st_size > 0


def test_a_folder_without_symmetry_holds_every_gpus_rows(tmp_path):
    r = _run("off")
    r.save(tmp_path / "all")
    summary = json.loads((tmp_path / "all" / "summary.json").read_text())
    assert "represented_by" not in summary
    timeline = pd.read_csv(tmp_path / "all" / "timeline.csv")
    assert sorted(set(timeline["gpu"])) == r.gpus
    assert read_result_folder(tmp_path / "all").timeline_gpus is None


@pytest.mark.parametrize("par", [None, {"pp": 2, "tp": 2, "dp_shard": 2, "microbatches": 2}])
def test_the_per_layer_table_of_a_symmetric_run_is_every_gpus(par):
    from triosim.results import tables

    r = _run("auto", par)
    assert "representative" in r.symmetry
    whole = tables.per_layer_table(r.timeline, r.gpus, len(r.iteration_times) - 1)
    pd.testing.assert_frame_equal(r.per_layer(), whole, check_exact=True)
