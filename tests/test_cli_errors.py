"""The command line on bad input: one `error: ...` line on stderr and exit 2, never a
traceback, and nothing overwritten or lost without --force."""

import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli as triosim
from tests.test_trace import TENSOR_CSV, TRACE_CSV
from triosim.trace.model import load

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz"


def user_error(capsys, *args) -> str:
    """Run a command that must fail on the user's input; return its one error line."""
    code, out, err = triosim(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def config(tmp_path):
    """A tiny, fast config: the small GPT-2 trace replayed on one device."""
    p = tmp_path / "tiny.yaml"
    p.write_text(
        f"trace: {TRACE}\nnum_gpus: 1\nparallelism: {{mode: single}}\nperfmodel: {{kind: trace}}\n"
    )
    return p


@pytest.fixture
def go(tmp_path):
    """An original TrioSim CSV folder."""
    d = tmp_path / "go"
    d.mkdir()
    (d / "trace.csv").write_text(TRACE_CSV)
    (d / "tensor.csv").write_text(TENSOR_CSV)
    return d


# -- config files ---------------------------------------------------------------------------


def test_yaml_syntax_error_names_file_line_and_column(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_gpus: 2\nparallelism: {mode: dp\n")
    msg = user_error(capsys, "simulate", bad)
    assert f"config file {bad}, line 3, column 1: not valid YAML" in msg


def test_folder_as_config(capsys, tmp_path):
    msg = user_error(capsys, "simulate", tmp_path)
    assert msg == f"error: config file {tmp_path}: is a folder, expected a file"


def test_missing_config(capsys, tmp_path):
    msg = user_error(capsys, "simulate", tmp_path / "nope.yaml")
    assert msg == f"error: config file {tmp_path / 'nope.yaml'}: no such file"


def test_unreadable_config(capsys, monkeypatch, config):
    # chmod cannot make a file unreadable to root (CI runs as root): fail the read instead
    real = Path.read_bytes

    def read_bytes(self):
        if self == config:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    msg = user_error(capsys, "simulate", config, "--no-save")
    assert msg == f"error: config file {config}: permission denied"


def test_non_utf8_config(capsys, tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("# caf\u00e9\nnum_gpus: 2\n".encode("latin-1"))
    msg = user_error(capsys, "simulate", bad)
    assert msg == f"error: config file {bad}: not UTF-8 text (byte 0xe9 at offset 5)"


def test_config_that_is_not_a_mapping_with_set(capsys, tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    msg = user_error(capsys, "simulate", bad, "--set", "num_gpus=2")
    assert f"config file {bad}: [1, 2] is not a mapping of fields" in msg


def test_set_without_equals(capsys, config):
    msg = user_error(capsys, "simulate", config, "--set", "num_gpus")
    assert msg == "error: --set expects FIELD=VALUE, got 'num_gpus'"


def test_set_value_that_is_not_yaml(capsys, config):
    msg = user_error(capsys, "simulate", config, "--set", "num_gpus=[2")
    assert "--set 'num_gpus=[2'" in msg and "not valid YAML" in msg


# -- trace files ----------------------------------------------------------------------------


def test_non_utf8_csv_trace_names_the_file(capsys, go, tmp_path):
    (go / "tensor.csv").write_bytes(TENSOR_CSV.replace("input", "entr\u00e9e").encode("latin-1"))
    msg = user_error(capsys, "info", go)
    assert f"trace file {go / 'tensor.csv'}: not UTF-8 text" in msg
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trace: go\nnum_gpus: 1\n")
    assert user_error(capsys, "simulate", cfg, "--no-save") == msg
    assert user_error(capsys, "import", go, tmp_path / "t.trace.json") == msg


def test_non_utf8_json_trace(capsys, tmp_path):
    bad = tmp_path / "x.trace.json"
    bad.write_bytes(b'{"format": "caf\xe9"}')
    assert f"file {bad}: not a readable trace" in user_error(capsys, "info", bad)


# -- simulate: where outputs go -------------------------------------------------------------


def test_out_that_is_a_file_is_refused_before_simulating(capsys, config, tmp_path):
    f = tmp_path / "results.txt"
    f.write_text("keep me")
    code, out, err = triosim(capsys, "simulate", config, "--out", f)
    assert code == 2 and err.strip() == f"error: --out {f} is a file, expected a folder"
    assert "iteration time" not in out and f.read_text() == "keep me"


def test_unwritable_out_is_refused_before_simulating(capsys, config, tmp_path):
    (tmp_path / "afile").write_text("")
    code, out, err = triosim(capsys, "simulate", config, "--out", tmp_path / "afile" / "sub")
    assert code == 2 and f"output folder {tmp_path / 'afile' / 'sub'}: cannot write there" in err
    assert "iteration time" not in out and "Traceback" not in err


def test_out_holding_files_needs_force(capsys, config, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("old")
    msg = user_error(capsys, "simulate", config, "--out", out)
    assert str(out) in msg and "--force" in msg
    assert (out / "summary.json").read_text() == "old" and len(list(out.iterdir())) == 1
    code, stdout, err = triosim(capsys, "simulate", config, "--out", out, "--force")
    assert code == 0, err
    assert (out / "summary.json").read_text() != "old" and (out / "timeline.csv").exists()


def test_default_out_is_never_overwritten(capsys, monkeypatch, config, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, _ = triosim(capsys, "simulate", config)
    assert code == 0 and "outputs written to out/tiny/" in out
    first = {p.name: p.read_bytes() for p in (tmp_path / "out" / "tiny").iterdir()}
    for n in (2, 3):
        code, out, _ = triosim(capsys, "simulate", config)
        assert code == 0 and f"outputs written to out/tiny-{n}/" in out
        assert (tmp_path / "out" / f"tiny-{n}" / "timeline.csv").exists()
    assert "out/tiny/ already holds files: writing to out/tiny-3/ instead" in out
    assert {p.name: p.read_bytes() for p in (tmp_path / "out" / "tiny").iterdir()} == first


# -- import -------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["trace.csv", "tensor.csv", "."])
def test_import_never_writes_over_its_input(capsys, go, target):
    before = {p.name: p.read_text() for p in go.iterdir()}
    msg = user_error(capsys, "import", go, go / target, "--force")
    assert "is the input" in msg
    assert {p.name: p.read_text() for p in go.iterdir()} == before


def test_import_into_an_input_file_without_force(capsys, go):
    user_error(capsys, "import", go, go / "trace.csv")
    assert (go / "trace.csv").read_text() == TRACE_CSV


def test_import_over_an_existing_file_needs_force(capsys, go, tmp_path):
    out = tmp_path / "t.trace.json"
    out.write_text("old")
    msg = user_error(capsys, "import", go, out)
    assert msg == f"error: output {out} exists; pass --force to overwrite it"
    assert out.read_text() == "old"
    code, _, err = triosim(capsys, "import", go, out, "--force")
    assert code == 0, err
    assert len(load(out).operators) == 3


@pytest.mark.parametrize("bad", ["0", "-3", "two"])
def test_import_batch_size_must_be_positive(capsys, go, tmp_path, bad):
    code, _, err = triosim(capsys, "import", go, tmp_path / "t.trace.json", "--batch-size", bad)
    assert code == 2 and f"expected an integer >= 1, got '{bad}'" in err
    assert not (tmp_path / "t.trace.json").exists()


def test_import_records_the_gpu(capsys, go, tmp_path):
    out = tmp_path / "t.trace.json"
    code, _, err = triosim(capsys, "import", go, out, "--gpu", "a100-80gb")
    assert code == 0, err
    assert load(out).metadata["gpu"] == "A100-80GB"
    msg = user_error(capsys, "import", go, tmp_path / "u.trace.json", "--gpu", "Z80")
    assert "--gpu 'Z80' is not in the catalogue" in msg and "H100-SXM" in msg


# -- trace ----------------------------------------------------------------------------------


def test_trace_without_torch_says_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    msg = user_error(capsys, "trace", "resnet18", "--batch-size", "2", "--out", tmp_path)
    assert "pip install 'triosim[trace]'" in msg
