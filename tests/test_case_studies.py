"""Reduced versions of the case studies: each runs, writes its table, and keeps its claim."""

import csv

from case_studies import hop_heterogeneous, simulator_speed
from tests.conftest import chain_trace
from triosim.trace.model import save


def vgg_like(tmp_path):
    """A weight-heavy model (VGG's 530 MB of weights against ~0.1 s of compute, scaled):
    200 MB of weights and 20 ms of compute per iteration at the traced batch of 8."""
    t = chain_trace(layers=4, weight_bytes=50e6, t_fwd=1.5e-3, t_bwd=3e-3, t_opt=2e-3, batch=8)
    return str(save(t, tmp_path / "vgg-like.trace.json.gz"))


def test_hop_backup_workers_are_not_slower_on_average(tmp_path):
    rows = hop_heterogeneous.study(vgg_like(tmp_path), scenarios=4, iterations=6, batch=8)
    assert len(rows) == 8 and {r["graph"] for r in rows} == {"ring-based", "double-ring"}
    for graph in ("ring-based", "double-ring"):
        speedups = [r["speedup"] for r in rows if r["graph"] == graph]
        assert sum(speedups) / len(speedups) >= 1.0, (graph, speedups)


def test_hop_script_writes_its_table_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(hop_heterogeneous, "find_trace", lambda *a: (vgg_like(tmp_path), "test"))
    hop_heterogeneous.main(
        ["--out", str(tmp_path / "hop"), "--scenarios", "2", "--iterations", "3"]
    )
    with open(tmp_path / "hop" / "hop.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (tmp_path / "hop" / "hop.png").stat().st_size > 10_000


def test_simulator_speed_grows_with_gpus(tmp_path):
    rows = simulator_speed.study(gpu_counts=(2, 16), sizes=(1,))
    assert [r["gpus"] for r in rows] == [2, 16] and all(r["wall_s"] > 0 for r in rows)


def test_dp_is_fastest_for_cnns_at_a_fixed_total_batch():
    from case_studies import parallelism_comparison as pc

    rows = pc.study(models=pc.MODELS[:2])  # VGG-11 and ResNet-50, modelled A100 times
    assert all("modelled" in r["times_from"] for r in rows)
    for model in ("VGG-11", "ResNet-50"):
        t = {r["mode"]: r["iteration_ms"] for r in rows if r["model"] == model}
        assert t["DP"] < min(t["TP"], t["GPipe"]), (model, t)


def test_photonic_communication_is_below_electrical_at_the_papers_setting():
    from case_studies import wafer_scale_photonic as w

    rows = w.study(models=w.MODELS[:1])  # VGG-19 on 84 modelled A100s, 0.5 GB/s mesh links
    el = next(r for r in rows if r["network"] == "electrical")
    ph = next(r for r in rows if r["network"] == "photonic")
    assert el["comm_share"] > 0.85  # the paper: 92 % on the electrical mesh
    assert ph["exposed_comm_ms"] < 0.5 * el["exposed_comm_ms"]


def test_tp_communicates_more_than_ddp_over_pcie():
    from case_studies import comm_breakdown as cb

    rows = cb.study(models=cb.MODELS[:1])  # VGG-11 on 2 modelled A40s
    share = {r["mode"]: r["comm_share"] for r in rows}
    assert share["TP"] > share["DDP"]
