"""Sweeps: grid files, a local Dask cluster, any exception recorded, resume, clear errors."""

import os
from pathlib import Path

import pandas as pd
import pytest

from extrapolators.modes import EXTRAPOLATORS, DataParallel, register
from tests.conftest import run_cli as triosim
from triosim.config.loading import from_dict, load_config
from triosim.simulation.wiring import Simulation
from triosim.studies import sweep as sw

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ROOT / "traces/cpu/gpt2-small-b8.trace.json.gz"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def rel(target: Path, start: Path) -> str:
    return os.path.relpath(target, start)


@pytest.mark.parametrize("cmd", ["sweep", "compare", "plot"])
def test_help(capsys, cmd):
    code, out, _ = triosim(capsys, cmd, "--help")
    assert code == 0 and f"usage: triosim {cmd}" in out


def test_a_yaml_config_and_the_same_python_config_give_identical_results(tmp_path):
    cfg = write(
        tmp_path / "c" / "ddp.yaml",
        f"""
trace: {rel(GPT2, tmp_path / "c")}   # relative to this file
num_gpus: 4
batch_size: 16
perfmodel: {{kind: roofline, source_gpu: A100-40GB}}
gpu: H100-SXM
parallelism: {{mode: ddp, bucket_size: 64 KiB, first_bucket_size: 16 KiB}}
topology: {{kind: ring, bandwidth: 400 Gb/s, latency: 1 us}}
""",
    )
    python = {
        "trace": str(GPT2),
        "num_gpus": 4,
        "batch_size": 16,
        "perfmodel": {"kind": "roofline", "source_gpu": "A100-40GB"},
        "gpu": "H100-SXM",
        "parallelism": {"mode": "ddp", "bucket_size": 64 * 1024, "first_bucket_size": 16384},
        "topology": {"kind": "ring", "bandwidth": 50e9, "latency": 1e-6},
    }
    a, b = Simulation(load_config(cfg)).run(), Simulation(python).run()
    assert len(a.timeline) > 100 and a.timeline.equals(b.timeline)
    sa, sb = a.summary_dict(), b.summary_dict()
    sa.pop("simulation_wall_s"), sb.pop("simulation_wall_s")
    assert sa == sb and sa["comm_ms_mean"] > 0
    # and a sweep sees them as one point
    assert sw.config_id(sw.absolute(load_config(cfg))) == sw.config_id(
        sw.absolute(from_dict(python))
    )


def test_a_sweep_on_a_local_dask_cluster_equals_separate_runs(capsys, tmp_path, monkeypatch):
    """8 points (a 2-value grid times 4 zipped rows) on 2 Dask worker processes, which run
    in folders of their own; the grid file is named relative to here and names the trace
    relative to itself. Dask is the `cluster` extra, which the README's test command
    installs; without it the test is skipped, not failed."""
    pytest.importorskip("dask.distributed", reason="the cluster extra (Dask) is not installed")
    pytest.importorskip("pyarrow", reason="the cluster extra (pyarrow) is not installed")
    grid = write(
        tmp_path / "grids" / "g.yaml",
        f"""
base:
  trace: {rel(GPT2, tmp_path / "grids")}
  perfmodel: {{kind: trace}}
  topology: {{kind: switch, bandwidth: 50 GB/s}}
grid:
  parallelism.mode: [dp, ddp]
zip:
  num_gpus: [1, 2, 4, 8]
  batch_size: [8, 16, 32, 64]
""",
    )
    monkeypatch.chdir(tmp_path)
    code, out, err = triosim(
        capsys, "sweep", grid.relative_to(tmp_path), "--out", "o", "--workers", "2"
    )
    assert code == 0, err
    assert "8 points" in out and "local Dask cluster of 2 worker processes" in out
    df = pd.read_parquet(tmp_path / "o" / "sweep.parquet")
    assert len(df) == 8 and df["error"].isna().all(), df["error"].tolist()
    assert df.equals(sw.read_table(tmp_path / "o"))  # the table read back: parquet first
    for row in df.itertuples(index=False):
        cfg = {
            "trace": str(GPT2),
            "perfmodel": {"kind": "trace"},
            "num_gpus": row.num_gpus,
            "batch_size": row.batch_size,
            "parallelism": {"mode": row[df.columns.get_loc("parallelism.mode")]},
            "topology": {"kind": "switch", "bandwidth": "50 GB/s"},
        }
        alone = Simulation(cfg).run().summary_dict()
        for k in (
            "iteration_time_ms",
            "compute_ms_mean",
            "comm_ms_mean",
            "exposed_comm_ms_mean",
            "idle_ms_mean",
            "bytes_moved",
        ):
            assert getattr(row, k) == alone[k], (k, row)
    csv = pd.read_csv(tmp_path / "o" / "sweep.csv")
    assert list(csv.columns) == list(df.columns)
    assert csv["iteration_time_ms"].tolist() == pytest.approx(
        df["iteration_time_ms"].tolist(), rel=1e-15
    )


@pytest.fixture
def boom_mode():
    @register
    class Boom(DataParallel):
        name = "test-boom"

        def streams(self):
            raise RuntimeError("streams() exploded")

    yield Boom.name
    EXTRAPOLATORS._parts.pop(Boom.name, None)


def test_a_point_raising_any_exception_is_recorded_and_the_rest_finish(boom_mode):
    base = {"trace": str(GPT2), "perfmodel": {"kind": "trace"}, "num_gpus": 2, "batch_size": 16}
    df = sw.sweep(base, {"parallelism.mode": ["dp", boom_mode, "ddp"]}, progress=False)
    assert list(df["parallelism.mode"]) == ["dp", boom_mode, "ddp"]
    assert df.loc[1, "error_type"] == "RuntimeError" and df.loc[1, "error"] == "streams() exploded"
    assert pd.isna(df.loc[1, "iteration_time_ms"])
    assert df.loc[[0, 2], "error"].isna().all() and (df.loc[[0, 2], "iteration_time_ms"] > 0).all()


def test_resume_runs_only_missing_points_and_failed_ones_on_request(capsys, tmp_path, monkeypatch):
    calls = []
    real = sw.run_point

    def counting(config):
        calls.append(config.num_gpus)
        return real(config)

    monkeypatch.setattr(sw, "run_point", counting)
    grid = tmp_path / "g.yaml"
    text = f"""
base: {rel(ROOT / "examples/ddp.yaml", tmp_path)}
grid:
  num_gpus: [2, 16]
  parallelism.mode: [dp, ddp]
"""
    write(grid, text)
    out = tmp_path / "out"
    code, stdout, err = triosim(capsys, "sweep", grid, "--out", out, "--workers", "1")
    assert code == 1, err  # the table is written, and the status says points failed
    assert sorted(calls) == [2, 2, 16, 16]
    # ddp.yaml's bucket sizes do not apply to dp: left out of the dp points, and said so
    assert "with parallelism.mode=dp, the base's parallelism.bucket_size" in stdout
    assert "2 of 4 points failed" in err  # 16 GPUs cannot split a batch of 8
    df = sw.read_table(out)
    assert list(df["error_type"].fillna("")) == ["", "", "ConfigError", "ConfigError"]

    calls.clear()
    code, stdout, _ = triosim(capsys, "sweep", grid, "--out", out, "--workers", "1")
    assert code == 1 and calls == []  # the failed points kept: still failed
    assert (
        "2 finished earlier, 2 failed earlier (kept: --retry-failed reruns them), nothing to run"
        in stdout
    )
    code, stdout, _ = triosim(
        capsys, "sweep", grid, "--out", out, "--workers", "1", "--retry-failed"
    )
    assert code == 1 and calls == [16, 16]
    calls.clear()
    write(grid, text.replace("[2, 16]", "[2, 4, 16]"))  # a grown grid: only the new points
    code, stdout, _ = triosim(capsys, "sweep", grid, "--out", out, "--workers", "1")
    assert code == 1 and calls == [4, 4]
    assert len(sw.read_table(out)) == 6
    calls.clear()
    write(grid, text.replace("[2, 16]", "[2]"))  # points of the table not in the grid: refused
    code, _, err = triosim(capsys, "sweep", grid, "--out", out, "--workers", "1")
    assert code == 2 and "not in this grid" in err and "--force" in err and calls == []


def test_an_interrupted_sweep_keeps_what_finished_and_resumes(capsys, tmp_path, monkeypatch):
    calls = []
    real = sw.run_point

    def interrupted_at_the_third(config):
        calls.append(config.num_gpus)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(config)

    monkeypatch.setattr(sw, "run_point", interrupted_at_the_third)
    grid = write(
        tmp_path / "g.yaml",
        f"base: {{trace: {GPT2}, perfmodel: {{kind: trace}}, "
        "parallelism: {mode: dp}}\n"
        "zip: {num_gpus: [1, 2, 4, 8], batch_size: [8, 16, 32, 64]}\n",
    )
    code, _, err = triosim(capsys, "sweep", grid, "--out", tmp_path / "o", "--workers", "1")
    assert code == 130 and "rerun the same command to resume" in err
    assert list(sw.read_table(tmp_path / "o")["num_gpus"]) == [1, 2]  # no row for the rest
    calls.clear()
    code, out, _ = triosim(capsys, "sweep", grid, "--out", tmp_path / "o", "--workers", "1")
    assert code == 0 and calls == [4, 8] and "2 finished earlier, 2 to run" in out
    assert sw.read_table(tmp_path / "o")["iteration_time_ms"].notna().all()


@pytest.mark.parametrize(
    "grid,match",
    [
        ("grid: {num_gpus: [2, 0]}", "grid point 1 (num_gpus=0): config field 'num_gpus' = 0"),
        ("grid: {parallelism.mdoe: [dp]}", "parallelism.mdoe"),
        (
            "grid: {num_gpus: 4}",
            "config field 'grid.num_gpus' = 4 is not allowed: a non-empty list",
        ),
        ("zip: {num_gpus: [2, 4], batch_size: [8]}", "lists of one length"),
        ("grd: {num_gpus: [2]}", "unknown key 'grd'"),
        ("", "nothing to vary"),
    ],
)
def test_grid_mistakes_are_one_error_line(capsys, tmp_path, grid, match):
    f = write(tmp_path / "g.yaml", f"base: {rel(ROOT / 'examples/dp.yaml', tmp_path)}\n{grid}\n")
    code, _, err = triosim(capsys, "sweep", f, "--out", tmp_path / "o", "--workers", "1")
    assert code == 2 and match in err and "Traceback" not in err, err
    assert not (tmp_path / "o" / "sweep.csv").exists()


def test_paths_are_absolute_before_a_config_leaves_this_process(tmp_path):
    f = write(
        tmp_path / "a" / "g.yaml",
        f"base: {rel(ROOT / 'examples/dp.yaml', tmp_path / 'a')}\n"
        f"grid: {{trace: [{rel(GPT2, tmp_path / 'a')}]}}\n",
    )
    spec = sw.read_grid(f)
    (p,) = sw.points(spec.base, spec.grid, spec.zipped, spec.base_dir, spec.grid_dir)
    assert Path(p.config.trace).is_absolute() and Path(p.config.trace) == GPT2
    spec.grid = {"num_gpus": [2]}  # the base's own trace, relative to the base's folder
    (p,) = sw.points(spec.base, spec.grid, spec.zipped, spec.base_dir, spec.grid_dir)
    assert Path(p.config.trace) == ROOT / "traces/cpu/resnet18-b8.trace.json.gz"


@pytest.mark.parametrize("grid", sorted(p.name for p in (ROOT / "examples/sweeps").glob("*.yaml")))
def test_every_example_grid_expands(grid):
    spec = sw.read_grid(ROOT / "examples/sweeps" / grid)
    pts = sw.points(spec.base, spec.grid, spec.zipped, spec.base_dir, spec.grid_dir)
    assert len(pts) > 1 and len({p.id for p in pts}) == len(pts)


def test_a_symmetry_sweep_shows_what_ran_beside_what_was_asked():
    # gpipe declares no classes: asked auto, ran the full simulation; ddp's auto held
    import warnings

    base = {"trace": str(GPT2), "num_gpus": 4, "batch_size": 32}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = sw.sweep(
            base,
            {"parallelism.mode": ["ddp", "gpipe"], "symmetry": ["off", "auto"]},
            progress=False,
        )
    got = {
        (m, s): r
        for m, s, r in zip(df["parallelism.mode"], df["symmetry"], df["symmetry_ran"], strict=True)
    }
    assert got[("ddp", "auto")] == "auto: 1 representative of 4 GPUs"
    why = "every GPU is its own class (no identical replicas to share a simulation)"
    assert got[("gpipe", "auto")] == f"off (fell back: {why})"
    assert got[("ddp", "off")] == got[("gpipe", "off")] == "off"
