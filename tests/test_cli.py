import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def triosim(*args):
    return subprocess.run([sys.executable, "-m", "triosim.cli", *args], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip


@pytest.mark.parametrize("cmd", [[], ["simulate"], ["trace"], ["info"], ["import"]])
def test_help(cmd):
    p = triosim(*cmd, "--help")
    assert p.returncode == 0 and "usage: triosim" in p.stdout


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_example_runs(tmp_path, example):
    p = triosim("simulate", f"examples/{example}", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "iteration time" in p.stdout and (tmp_path / "chrome_trace.json").exists()


def test_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trace: ../traces/cpu/resnet18-b8.trace.json.gz\nnum_gpus: two\n")
    p = triosim("simulate", str(bad))
    assert p.returncode == 2 and "num_gpus" in p.stderr and "Traceback" not in p.stderr


def test_set_override_and_info():
    p = triosim("simulate", "examples/dp.yaml", "--no-save", "--set", "num_gpus=2")
    assert p.returncode == 0 and "GPUs                          2" in p.stdout
    p = triosim("info", "traces/cpu/gpt2-small-b8.trace.json.gz")
    assert p.returncode == 0 and "operators" in p.stdout


def test_photonic_wafer_case_study(tmp_path):
    p = subprocess.run([sys.executable, "case_studies/photonic_wafer.py", "--out", str(tmp_path / "w.png")],
                       capture_output=True, text=True, cwd=ROOT, env={**__import__("os").environ,
                       "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if "electrical" in line or "photonic" in line]
    assert len(rows) == 5 and (tmp_path / "w.png").stat().st_size > 0  # header + 4 rows


def test_import_then_info_then_simulate(tmp_path):
    from tests.test_trace import TENSOR_CSV, TRACE_CSV

    (tmp_path / "go").mkdir()
    (tmp_path / "go" / "trace.csv").write_text(TRACE_CSV)
    (tmp_path / "go" / "tensor.csv").write_text(TENSOR_CSV)
    out = tmp_path / "t.trace.json.gz"
    p = triosim("import", str(tmp_path / "go"), str(out))
    assert p.returncode == 0 and "imported 3 operators" in p.stdout
    p = triosim("info", str(out))
    assert p.returncode == 0 and "sum of op times 0.0350 ms" in p.stdout
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"trace: {out.name}\nnum_gpus: 2\nbatch_size: 4\nparallelism: {{mode: ddp}}\n")
    p = triosim("simulate", str(cfg), "--no-save")
    assert p.returncode == 0 and "ddp" in p.stdout, p.stderr


def test_set_through_a_non_mapping_is_a_clear_error():
    p = triosim("simulate", "examples/dp.yaml", "--no-save", "--set", "num_gpus.x=1")
    assert p.returncode == 2 and "num_gpus.x" in p.stderr and "Traceback" not in p.stderr
