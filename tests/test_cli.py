import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.conftest import run_cli as triosim

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name examples/ and traces/ relative to the root


@pytest.mark.parametrize("cmd", [[], ["simulate"], ["trace"], ["info"], ["import"]])
def test_help(capsys, cmd):
    code, out, _ = triosim(capsys, *cmd, "--help")
    assert code == 0 and "usage: triosim" in out


def test_version(capsys):
    code, out, _ = triosim(capsys, "--version")
    assert code == 0 and out.strip() == f"triosim {version('triosim')}"


# the published layouts of hundreds of GPUs (minutes each, gigabytes of outputs): their runs
# are benchmarks/mesh_layouts.py's; the suite checks their plans against their traces
LARGE = {
    "titan_llama8b_hsdp.yaml",  # 64 GPUs' outputs: 10 s
    "titan_llama70b_fsdp_tp.yaml",
    "titan_llama405b_3d.yaml",
    "titan_llama405b_4d.yaml",
    "megatron_mixtral.yaml",
    "megatron_deepseek_v3.yaml",
    "automodel_deepseek_v3.yaml",  # 256 GPUs: 12 s
    "mixtral_ep.yaml",  # 64 GPUs' outputs (435,840 timeline rows): 17 s; its run is
    # fingerprinted by benchmarks/same_results.py, as are the two Llama 3 8B examples':
    "llama8b_tp.yaml",  # 11 s with its outputs
    "llama8b_128k_cp_tp.yaml",  # 12 s
}
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e not in LARGE])
def test_every_example_runs(capsys, tmp_path, example):
    code, out, err = triosim(capsys, "simulate", f"examples/{example}", "--out", tmp_path)
    assert code == 0, err
    assert "iteration time" in out and (tmp_path / "chrome_trace.json").exists()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("example", sorted(LARGE))
def test_every_large_example_is_a_valid_plan(example):
    """Loaded, and its plan checked against its trace (every degree, the batch split, the
    pipeline cut, the TP and CP plans), as `triosim simulate` does before running."""
    from triosim.simulation.wiring import Simulation

    sim = Simulation(ROOT / "examples" / example)
    assert len(sim.gpus) == sim.config.num_gpus >= 16


def test_bad_config_is_a_clear_error(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trace: ../traces/cpu/resnet18-b8.trace.json.gz\nnum_gpus: two\n")
    code, _, err = triosim(capsys, "simulate", bad)
    assert code == 2 and "num_gpus" in err and "Traceback" not in err


def test_set_override_and_info(capsys):
    code, out, _ = triosim(
        capsys, "simulate", "examples/dp.yaml", "--no-save", "--set", "num_gpus=2"
    )
    assert code == 0 and "GPUs                          2" in out
    code, out, _ = triosim(capsys, "info", "traces/cpu/gpt2-small-b8.trace.json.gz")
    assert code == 0 and "operators" in out


def test_import_then_info_then_simulate(capsys, tmp_path):
    from tests.test_trace import TENSOR_CSV, TRACE_CSV

    (tmp_path / "go").mkdir()
    (tmp_path / "go" / "trace.csv").write_text(TRACE_CSV)
    (tmp_path / "go" / "tensor.csv").write_text(TENSOR_CSV)
    out = tmp_path / "t.trace.json.gz"
    code, stdout, _ = triosim(capsys, "import", tmp_path / "go", out)
    assert code == 0 and "imported 3 operators" in stdout
    code, stdout, _ = triosim(capsys, "info", out)
    assert code == 0 and "sum of op times 0.0350 ms" in stdout
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"trace: {out.name}\nnum_gpus: 2\nbatch_size: 4\nparallelism: {{mode: ddp}}\n")
    code, stdout, err = triosim(capsys, "simulate", cfg, "--no-save")
    assert code == 0 and "ddp" in stdout, err


def test_set_through_a_non_mapping_is_a_clear_error(capsys):
    code, _, err = triosim(
        capsys, "simulate", "examples/dp.yaml", "--no-save", "--set", "num_gpus.x=1"
    )
    assert code == 2 and "num_gpus.x" in err and "Traceback" not in err


def test_start_up_imports_only_what_is_needed():
    """A fresh interpreter is the point: `info` loads no SimPy, and a simulation that fits
    no regression loads neither scikit-learn nor matplotlib nor torch."""
    code = """if True:
        import sys, triosim.cli.main
        assert triosim.cli.main.main(["info", "traces/cpu/gpt2-small-b8.trace.json.gz"]) == 0
        assert "simpy" not in sys.modules, "info imported simpy"
        from triosim.simulation.wiring import Simulation
        heavy = [m for m in ("sklearn", "matplotlib", "torch") if m in sys.modules]
        assert not heavy, f"import triosim.simulation.wiring imported {heavy}"
        Simulation({"trace": "traces/cpu/gpt2-small-b8.trace.json.gz", "num_gpus": 1,
                    "parallelism": {"mode": "single"}, "perfmodel": {"kind": "trace"}}).run()
        heavy = [m for m in ("sklearn", "matplotlib", "torch") if m in sys.modules]
        assert not heavy, f"a 1-GPU run imported {heavy}"
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr


def test_a_symmetry_fallback_is_a_warning_line_with_its_reason(capsys):
    # gpipe has no identical GPUs: `auto` runs the full simulation and says why, in the CLI's
    # own `warning:` form (not Python's file:line), and the summary says what ran
    code, out, err = triosim(
        capsys, "simulate", "examples/gpipe.yaml", "--no-save", "--set", "symmetry=auto"
    )
    assert code == 0
    assert "warning: symmetry: auto fell back to the full simulation: every GPU is its own" in err
    assert "SymmetryWarning" not in err and ".py:" not in err
    assert "off (fell back: every GPU is its own class" in out


def test_the_package_version_is_pyprojects():
    import tomllib

    import triosim

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert triosim.__version__ == pyproject["project"]["version"] == version("triosim")
