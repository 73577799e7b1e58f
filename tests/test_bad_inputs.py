"""Bad input on the command line, as a new user gives it (issue 44: every message names the
field, the value given and what is expected): one `error:` line, exit 2, no traceback.
Each row of the table was accepted, answered with a traceback, or named the wrong thing
before."""

import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from tests.test_trace import TENSOR_CSV, TRACE_CSV
from triosim.trace.model import load, save

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz"


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working folder with a fast config (good.yaml), a CSV trace folder (go) and a
    folder (folder); the commands run there."""
    shutil.copy(TRACE, tmp_path / "t.trace.json.gz")
    cfg = {
        "trace": "t.trace.json.gz",
        "num_gpus": 2,
        "batch_size": 16,
        "parallelism": {"mode": "ddp"},
        "perfmodel": {"kind": "trace"},
    }
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(cfg))
    host = {**cfg, "host": {"model": "off", "op_cost": "5 us"}}
    (tmp_path / "host-off.yaml").write_text(yaml.safe_dump(host))
    scale = {**cfg, "host": {"model": "on", "trace_scale": 2.0}}
    (tmp_path / "host-scale.yaml").write_text(yaml.safe_dump(scale))
    # a trace whose metadata has no batch size, with a batch in the config
    t = load(TRACE)
    del t.metadata["batch_size"]
    save(t, tmp_path / "nobatch.trace.json.gz")
    nobatch = {**cfg, "trace": "nobatch.trace.json.gz", "batch_size": 4}
    (tmp_path / "nobatch.yaml").write_text(yaml.safe_dump(nobatch))
    peaks = {**cfg, "gpus": [{"name": "X1", "base": "H100-SXM", "peak_tflops": 0}], "gpu": "X1"}
    (tmp_path / "peaks.yaml").write_text(yaml.safe_dump(peaks))
    links = {**cfg, "heterogeneity": {"links": {"0-1": 0.5}}}
    (tmp_path / "links.yaml").write_text(yaml.safe_dump(links))
    (tmp_path / "rows.yaml").write_text(
        yaml.safe_dump({**cfg, "topology": {"kind": "mesh2d", "rows": 3}})
    )
    odd = {**cfg, "topology": {"kind": "fat_tree", "radix": 3}}
    (tmp_path / "radix.yaml").write_text(yaml.safe_dump(odd))
    hybrid = {**cfg, "parallelism": {"mode": "hybrid", "tp": 2}}
    (tmp_path / "hybrid.yaml").write_text(yaml.safe_dump(hybrid))
    (tmp_path / "go").mkdir()
    (tmp_path / "go" / "trace.csv").write_text(TRACE_CSV)
    (tmp_path / "go" / "tensor.csv").write_text(TENSOR_CSV)
    (tmp_path / "folder").mkdir()
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "nccl.log").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


TT = ["train-time", "good.yaml", "--tokens", "1e9"]
VAR = ["variability", "good.yaml", "--runs", "2"]
EMPTY_OUT = ["--out", "''", "an empty one is none"]

# command line -> fragments of its error line (the field, the value, what is expected)
CASES = {
    # an empty output name is '.', the working folder: never what was meant
    "simulate --out ''": (["simulate", "good.yaml", "--out", ""], EMPTY_OUT),
    "trace --out ''": (["trace", "resnet18", "--batch-size", "2", "--out", ""], EMPTY_OUT),
    "search --out ''": (["search", "good.yaml", "--out", ""], EMPTY_OUT),
    "export-chakra --out ''": (["export-chakra", "good.yaml", "--out", ""], EMPTY_OUT),
    "calibrate --out ''": (
        ["calibrate", "nccl.log", "--config", "good.yaml", "--out", ""],
        EMPTY_OUT,
    ),
    "sweep --out ''": (["sweep", "g.yaml", "--out", ""], EMPTY_OUT),
    "compare --out ''": (["compare", "good.yaml", "good.yaml", "--out", ""], EMPTY_OUT),
    "plot --out ''": (["plot", "folder", "--out", ""], EMPTY_OUT),
    "import OUT ''": (["import", "go", ""], ["out", "''", "an empty one is none"]),
    "train-time --plot ''": ([*TT, "--plot", ""], ["--plot", "''", "an empty one is none"]),
    # train-time's durations: checked as the options' own bounds (0 was a math error)
    "train-time --mtbf-gpu 0": ([*TT, "--mtbf-gpu", "0"], ["--mtbf-gpu", "'0'", "> 0"]),
    "train-time --checkpoint-interval -1": (
        [*TT, "--checkpoint-interval", "-1 s"],
        ["--checkpoint-interval", "'-1 s'", "> 0"],
    ),
    "train-time --restart -5": ([*TT, "--restart", "-5 s"], ["--restart", "'-5 s'", ">= 0"]),
    # a flag is a flag, not a config field
    "train-time --storage-bandwidth fast": (
        [*TT, "--storage-bandwidth", "fast"],
        ["error: --storage-bandwidth 'fast'", "bandwidth in bytes/s"],
    ),
    "fit-host on a CPU trace": (
        ["fit-host", "t.trace.json.gz", "--measured", "100ms"],
        ["t.trace.json.gz: device 'cpu'", "a trace recorded on the GPU machine"],
    ),
    "fit-host --measured 0ms": (
        ["fit-host", "t.trace.json.gz", "--measured", "0ms"],
        ["error: --measured '0ms'", "a positive iteration time"],
    ),
    "fit-host --measured abc": (
        ["fit-host", "t.trace.json.gz", "--measured", "abc"],
        ["error: --measured 'abc'", "a time in seconds"],
    ),
    # variability: a GPU count of 0 (a division by zero), options without effect
    "variability --at 0": ([*VAR, "--cv", "0.1", "--at", "0"], ["--at", "'0'", ">= 1"]),
    "variability --at 64,-1": (
        [*VAR, "--cv", "0.1", "--at", "64,-1"],
        ["--at", "'64,-1'", ">= 1"],
    ),
    "variability --slow-factor without --slow": (
        [*VAR, "--cv", "0.1", "--slow-factor", "2"],
        ["--slow-factor 2", "with --slow"],
    ),
    "variability --slow without --slow-factor": (
        [*VAR, "--cv", "0.1", "--slow", "0.5"],
        ["--slow 0.5", "--slow-factor", "above 1"],
    ),
    "variability --seed -1": (
        [*VAR, "--cv", "0.1", "--seed", "-1"],
        ["--seed", "'-1'", "an integer >= 0"],
    ),
    "train-time --seed -1": (
        [*TT, "--cv", "0.1", "--seed", "-1"],
        ["--seed", "'-1'", "an integer >= 0"],
    ),
    "train-time --runs without --cv": ([*TT, "--runs", "5"], ["--runs 5", "only with --cv"]),
    # export-chakra's prefix: a file name ('..' wrote ex/...0.et and pointed ASTRA-sim at ex/..)
    "export-chakra --prefix ..": (
        ["export-chakra", "good.yaml", "--out", "ex", "--prefix", ".."],
        ["prefix '..'", "a plain name"],
    ),
    "variability --cv abc": ([*VAR, "--cv", "abc"], ["--cv", "'abc'", "[0, 1)"]),
    "train-time --cv abc": ([*TT, "--cv", "abc"], ["--cv", "'abc'", "[0, 1)"]),
    # the host model's fields where it is off or where its source does not read them
    "host.op_cost with host.model off": (
        ["simulate", "host-off.yaml", "--no-save"],
        ["'host.op_cost' = '5 us'", "host.model off"],
    ),
    "host.trace_scale with source launches": (
        ["simulate", "host-scale.yaml", "--no-save"],
        ["'host.trace_scale' = 2.0", "source trace"],
    ),
    # the config's batch, as written (it was the batch per GPU, 'batch_size' = 2.0)
    "batch_size with a trace without one": (
        ["simulate", "nobatch.yaml", "--no-save"],
        ["'batch_size' = 4 ", "a trace whose metadata gives its batch size", "--batch-size"],
    ),
    # a field of neither hybrid nor its inner mode: named as hybrid's (it said mode 'single')
    "hybrid with tp": (
        ["simulate", "hybrid.yaml", "--no-save"],
        ["'parallelism.tp' = 2", "not of parallelism mode 'hybrid' with inner 'single'"],
    ),
    # a file that is not a mapping is named (it was `config field 'config'`, whichever file)
    "compare: a config that is a list": (
        ["compare", "good.yaml", "list.yaml"],
        ["config file list.yaml: ['a', 'b'] is not a mapping of fields"],
    ),
    "sweep: a grid file that is a list": (
        ["sweep", "list.yaml", "--out", "s"],
        ["grid file list.yaml: ['a', 'b'] is not a mapping"],
    ),
    # a container field says what it holds (it said "a mapping", "a list")
    "gpus[].peak_tflops a number": (
        ["simulate", "peaks.yaml", "--no-save"],
        ["'gpus[0].peak_tflops' = 0", "a mapping, each key", "per math mode"],
    ),
    "heterogeneity.links a mapping": (
        ["simulate", "links.yaml", "--no-save"],
        ["'heterogeneity.links' = {'0-1': 0.5}", "a list of mappings {src, dst, factor"],
    ),
    # one side of a 2D mesh: a divisor (it said "rows x cols = num_gpus (2); got 3 x 0")
    "mesh2d rows 3 of 2 GPUs": (
        ["simulate", "rows.yaml", "--no-save"],
        ["'topology.rows' = 3", "a divisor of num_gpus (2)"],
    ),
    # a fat tree's switch: half its ports down, half up (radix 3 ran as radix 2)
    "fat_tree radix 3": (
        ["simulate", "radix.yaml", "--no-save"],
        ["'topology.radix' = 3", "an even number"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_one_line_naming_the_field_the_value_and_what_is_expected(
    capsys, here, case
):
    argv, fragments = CASES[case]
    (here / "g.yaml").write_text("base: good.yaml\ngrid:\n  seed: [1]\n")
    code, out, err = run_cli(capsys, *argv)
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error: " in line]
    assert code == 2 and len(errors) == 1, (code, out, err)
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_a_set_that_turns_the_host_model_off_leaves_out_its_costs_and_says_so(capsys, here):
    """`--set host.model=off` on a config that sets host costs: the costs are left out and
    said (as a --set of another mode leaves out the old mode's fields), not refused."""
    cfg = yaml.safe_load((here / "good.yaml").read_text())
    (here / "host-on.yaml").write_text(
        yaml.safe_dump({**cfg, "host": {"model": "on", "op_cost": "5 us"}})
    )
    code, out, err = run_cli(
        capsys, "simulate", "host-on.yaml", "--set", "host.model=off", "--no-save"
    )
    assert code == 0, err
    assert "--set: left out host.op_cost" in out


def test_out_of_memory_is_one_error_line(capsys, here, monkeypatch):
    """A run too large for the machine (num_gpus 10,000,000 of DDP: MemoryError while
    building the topology) ends in one error line saying so, not a traceback."""
    from triosim.simulation import wiring

    def too_big(*a, **k):
        raise MemoryError

    monkeypatch.setattr(wiring.Simulation, "run", too_big)
    code, out, err = run_cli(capsys, "simulate", "good.yaml", "--no-save")
    assert code == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error" in line] == [
        line for line in err.splitlines() if line.startswith("error: out of memory")
    ]
    assert "error: out of memory" in err and "symmetry: auto" in err


def test_import_help_and_refusal_agree_that_both_csv_files_are_needed(capsys, here):
    """Issue 44: `import --help` said a folder with only trace.csv was fine, and import
    refused it; the help says both files are needed, and the refusal names the missing one."""
    code, out, _ = run_cli(capsys, "import", "--help")
    assert code == 0 and "both are needed" in " ".join(out.split())
    (here / "go" / "tensor.csv").unlink()
    code, out, err = run_cli(capsys, "import", "go", "o.trace.json.gz")
    assert code == 2 and "tensor.csv: no such file" in err
