import json
import math
from pathlib import Path

import pytest

from tests.conftest import chain_trace
from triosim.config import from_dict, load_config
from triosim.errors import ConfigError
from triosim.simulation import Simulation, load_any_trace
from triosim.sweep import sweep

ROOT = Path(__file__).resolve().parents[1]


def test_single_gpu_replay_equals_sum_of_operator_times():
    t = chain_trace(layers=7)
    r = Simulation({"num_gpus": 1}, trace=t).run()
    assert r.iteration_time == pytest.approx(math.fsum(op.time for op in t.operators), rel=1e-14)


def test_shipped_trace_replays_to_its_operator_sum():
    t = load_any_trace(ROOT / "traces/cpu/resnet18-b8.trace.json.gz")
    r = Simulation(load_config(ROOT / "examples/single.yaml")).run()
    assert r.iteration_time == pytest.approx(t.total_time, rel=1e-12)


def test_chrome_trace_is_valid_and_sums_to_iteration_time(tmp_path):
    t = chain_trace()
    r = Simulation({"num_gpus": 1}, trace=t).run()
    doc = json.loads(r.to_chrome_trace(tmp_path / "t.json").read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(t.operators)
    assert sum(e["dur"] for e in spans) * 1e-6 == pytest.approx(r.iteration_time)


def test_breakdowns_add_up():
    r = Simulation(
        {"num_gpus": 4, "parallelism": {"mode": "ddp"}}, trace=chain_trace(batch=16)
    ).run()
    g = r.per_gpu()
    total = g["compute"] + g["exposed_comm"] + g["idle"]
    assert all(abs(x - r.iteration_time) < 1e-12 for x in total)
    layers = r.per_layer()  # per GPU and layer: each GPU's layers add up to its compute
    assert list(layers.columns) == ["gpu", "layer", "compute", "comm"]
    by_gpu = layers.groupby("gpu")[["compute", "comm"]].sum()
    assert by_gpu["compute"].to_numpy() == pytest.approx(g["compute"].to_numpy())
    assert by_gpu["comm"].to_numpy() == pytest.approx(g["comm"].to_numpy())


def test_save_writes_every_output(tmp_path):
    r = Simulation({"num_gpus": 2, "parallelism": {"mode": "dp"}}, trace=chain_trace()).run()
    r.save(tmp_path)
    for name in ("timeline.csv", "per_gpu.csv", "per_layer.csv", "links.csv", "summary.json",
                 "chrome_trace.json", "timeline.png", "config.yaml"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0
    again = from_dict(__import__("yaml").safe_load((tmp_path / "config.yaml").read_text()))
    assert again.parallelism.mode == "dp" and again.num_gpus == 2


def test_runs_are_deterministic():
    cfg = {"num_gpus": 4, "parallelism": {"mode": "ddp", "bucket_size": "5 MB"}}
    a = Simulation(cfg, trace=chain_trace(batch=16)).run()
    b = Simulation(cfg, trace=chain_trace(batch=16)).run()
    assert a.timeline.equals(b.timeline)


@pytest.mark.parametrize("field,value,match", [
    ("num_gpus", 0, "num_gpus"), ("parallelism", {"mode": "zz"}, "parallelism.mode"),
    ("topology", {"bandwidth": "0 GB/s"}, "topology.bandwidth"),
    ("topology", {"latency": -1}, "topology.latency"), ("colour", "red", "colour"),
    ("batch_size", -3, "batch_size"), ("parallelism", {"bucket_size": "lots"}, "bucket_size"),
])  # fmt: skip
def test_config_errors_name_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        from_dict({"trace": "x", field: value})


def test_unknown_network_topology_gpu():
    t = chain_trace()
    with pytest.raises(ConfigError, match="network.kind"):
        Simulation({"num_gpus": 2, "network": {"kind": "carrier-pigeon"}}, trace=t).run()
    with pytest.raises(ConfigError, match="topology.kind"):
        Simulation({"num_gpus": 2, "topology": {"kind": "hypercube9"}}, trace=t)
    with pytest.raises(ConfigError, match="gpu"):
        Simulation(
            {"num_gpus": 1, "gpu": "Z9000", "perfmodel": {"kind": "roofline"}}, trace=t
        ).run()


def test_sweep_keeps_failed_points():
    base = {"trace": str(ROOT / "traces/cpu/resnet18-b8.trace.json.gz"), "batch_size": 8,
            "parallelism": {"mode": "dp"}}  # fmt: skip
    df = sweep(base, {"num_gpus": [2, 4, 16]}, progress=False)
    assert list(df["num_gpus"]) == [2, 4, 16]
    assert df.loc[2, "error"].startswith("config field 'batch_size'")
    assert df.loc[0, "iteration_time_ms"] > df.loc[1, "iteration_time_ms"]


def test_photonic_network_in_a_run():
    cfg = {
        "num_gpus": 4,
        "parallelism": {"mode": "dp"},
        "network": {"kind": "photonic", "setup_time": "20 ms", "total_bandwidth": "484 GB/s"},
    }
    r = Simulation(cfg, trace=chain_trace(batch=16)).run()
    compute = r.per_gpu()["compute"].max()
    assert r.iteration_time >= compute + 0.02  # at least one circuit set-up is exposed
