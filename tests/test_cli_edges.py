"""Issue 29, the command-line edges: every writer refuses to write over its inputs, over an
existing file without --force, or half a file; every argument a command takes is checked
(zero, negative, NaN, huge, a folder, a binary file) and refused with one `error:` line and
exit 2, never a traceback and never a silently wrong answer."""

import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli as triosim
from triosim import nccl_tests

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz"
# a system with no trace: collectives and calibrate need none
SYSTEM = {"num_gpus": 8, "gpu": "A100-80GB",
          "topology": {"kind": "switch", "bandwidth": "300 GB/s", "latency": "0.7 us"}}  # fmt: skip


def user_error(capsys, *args) -> str:
    """Run a command that must fail on the user's input; return its error line (argparse's
    usage errors included: their last line)."""
    code, out, err = triosim(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code == 2, (code, out, err)
    assert "Traceback" not in err
    assert lines and "error: " in lines[-1], err
    return lines[-1]


def write(folder, data, name="sys.yaml") -> Path:
    p = Path(folder) / name
    p.write_text(yaml.safe_dump(data))
    return p


def rows(out: str, op="all_reduce"):
    [t] = nccl_tests.parse(out, op=op)
    return t.rows


# -- collectives: sizes, root, the config ----------------------------------------------------


def test_collectives_needs_no_trace(capsys, tmp_path):
    code, out, err = triosim(capsys, "collectives", write(tmp_path, SYSTEM), "-b", "1M", "-e",
                             "4M")  # fmt: skip
    assert code == 0, err
    assert [r.size for r in rows(out)] == [2**20, 2**21, 2**22]


def test_collectives_min_size_zero_with_a_factor_is_refused(capsys, tmp_path):
    # 0 x 2 stays 0: the run stopped after one row and never reached -e
    msg = user_error(capsys, "collectives", write(tmp_path, SYSTEM), "-b", "0", "-e", "1M")
    assert "-b 0 with -f 2" in msg and "never reach -e 1048576" in msg
    code, out, err = triosim(capsys, "collectives", write(tmp_path, SYSTEM), "-b", "0", "-e", "0")
    assert code == 0, err
    assert [r.size for r in rows(out)] == [0]


@pytest.mark.parametrize("op", ["broadcast", "all_reduce"])
def test_collectives_root_out_of_range(capsys, tmp_path, op):
    msg = user_error(capsys, "collectives", write(tmp_path, SYSTEM), "--op", op, "-b", "1M",
                     "-e", "1M", "-r", "99")  # fmt: skip
    assert msg == "error: -r 99: the root must be a rank of the 8 GPUs (0 to 7)"
    assert "expected an integer >= 0" in user_error(capsys, "collectives", write(tmp_path, SYSTEM),
                                                    "-r", "-1")  # fmt: skip


@pytest.mark.parametrize("option", ["-b", "-e", "-i"])
@pytest.mark.parametrize("value,why", [("1e30", "more than 1T"), ("2T", "more than 1T"),
                                       ("1P", "not a size"), ("-1", "not a size"),
                                       ("nan", "not a size"), ("inf", "not a size"),
                                       ("1.5", "not a whole number of bytes")])  # fmt: skip
def test_collectives_one_size_parser_for_b_e_and_i(capsys, tmp_path, option, value, why):
    args = {"-b": "8", "-e": "1T", "-f": "1", "-i": "1G"}
    args[option] = value
    msg = user_error(capsys, "collectives", write(tmp_path, SYSTEM),
                     *[x for kv in args.items() for x in kv])  # fmt: skip
    assert msg.startswith(f"error: {option} {value!r}: {why}"), msg


def test_collectives_1t_is_the_largest_size(capsys, tmp_path):
    code, out, err = triosim(capsys, "collectives", write(tmp_path, SYSTEM), "-b", "1T", "-e",
                             "1T")  # fmt: skip
    assert code == 0, err
    assert [r.size for r in rows(out)] == [2**40]


def test_collectives_refuses_a_billion_rows(capsys, tmp_path):
    msg = user_error(capsys, "collectives", write(tmp_path, SYSTEM), "-b", "1", "-e", "1G", "-f",
                     "1", "-i", "1")  # fmt: skip
    assert "gives 1,073,741,824 sizes, more than 100,000 rows" in msg
    assert "--max-rows 1073741824" in msg
    msg = user_error(capsys, "collectives", write(tmp_path, SYSTEM), "-b", "1", "-e", "64",
                     "-i", "1", "--max-rows", "10")  # fmt: skip
    assert "gives 64 sizes, more than 10 rows" in msg


def test_collectives_step_without_factor_steps(capsys, tmp_path):
    # -i alone used to be ignored (the default factor 2 won)
    code, out, err = triosim(capsys, "collectives", write(tmp_path, SYSTEM), "-b", "1K", "-e",
                             "4K", "-i", "1K")  # fmt: skip
    assert code == 0, err
    assert [r.size for r in rows(out)] == [1024, 2048, 3072, 4096]
    msg = user_error(capsys, "collectives", write(tmp_path, SYSTEM), "-i", "1K", "-f", "2")
    assert "not both" in msg


@pytest.mark.parametrize("bad", ["0", "-2", "nan", "inf", "1.5", "two"])
def test_collectives_step_factor(capsys, tmp_path, bad):
    msg = user_error(capsys, "collectives", write(tmp_path, SYSTEM), "-f", bad)
    assert f"expected an integer >= 1, got '{bad}'" in msg


def _time_of_64m(capsys, tmp_path, het=None):
    data = dict(SYSTEM, heterogeneity=het) if het else SYSTEM
    code, out, err = triosim(capsys, "collectives", write(tmp_path, data), "-b", "64M", "-e",
                             "64M")  # fmt: skip
    assert code == 0, err
    return rows(out)[0].time, err


def test_collectives_apply_slower_links(capsys, tmp_path):
    base, _ = _time_of_64m(capsys, tmp_path)
    slow, err = _time_of_64m(capsys, tmp_path, {"bandwidth": {0: 4.0}})
    # GPU 0's link at a quarter: a bandwidth-bound 64 MiB all-reduce takes about 4x as long
    assert 3.0 < slow / base < 4.5 and not err
    one_link, _ = _time_of_64m(
        capsys, tmp_path, {"links": [{"src": 0, "dst": "nvswitch", "factor": 4}]}
    )
    assert one_link > 1.5 * base


def test_collectives_say_a_compute_slowdown_changes_nothing(capsys, tmp_path):
    base, _ = _time_of_64m(capsys, tmp_path)
    same, err = _time_of_64m(capsys, tmp_path, {"compute": {3: 4.0}})
    assert same == base
    assert "warning: heterogeneity.compute: a slower compute on 1 GPU(s)" in err
    _, err = _time_of_64m(capsys, tmp_path, {"random": [{"target": "compute"}]})
    assert "warning: heterogeneity.random[0] (target: compute)" in err


def test_binary_calibration_file(capsys, tmp_path):
    calib = tmp_path / "calib.yaml"
    calib.write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff" * 10)
    cfg = write(tmp_path, dict(SYSTEM, communication={"calibration": "calib.yaml"}))
    msg = user_error(capsys, "collectives", cfg, "-b", "1M", "-e", "1M")
    assert msg == (f"error: communication.calibration file {calib}: not UTF-8 text (byte 0xd0 "
                   "at offset 8)")  # fmt: skip
    cfg = write(tmp_path, dict(SYSTEM, communication={"calibration": "."}))
    assert "is a folder, expected a file" in user_error(capsys, "collectives", cfg)


# -- calibrate --------------------------------------------------------------------------------


@pytest.fixture
def measured(tmp_path, capsys):
    """(log, config): a small nccl-tests log the model made, and the system's config."""
    cfg = write(tmp_path, SYSTEM)
    code, out, _ = triosim(capsys, "collectives", cfg, "-b", "1K", "-e", "1G", "-f", "8")
    assert code == 0
    log = tmp_path / "measured.log"
    log.write_text(out)
    return log, cfg


def test_calibrate_refuses_an_existing_out_without_force(capsys, measured, tmp_path):
    log, cfg = measured
    out = tmp_path / "calib.yaml"
    out.write_text("mine")
    msg = user_error(capsys, "calibrate", log, "--config", cfg, "--out", out)
    assert msg == f"error: --out {out} exists; pass --force to overwrite it"
    assert out.read_text() == "mine"
    code, _, err = triosim(capsys, "calibrate", log, "--config", cfg, "--out", out, "--force")
    assert code == 0, err
    assert "tuning" in yaml.safe_load(out.read_text())


@pytest.mark.parametrize("which", ["log", "config"])
def test_calibrate_never_writes_over_its_inputs(capsys, measured, which):
    log, cfg = measured
    target = log if which == "log" else cfg
    before = target.read_bytes()
    for spelling in (target, target.parent / "." / target.name):
        msg = user_error(capsys, "calibrate", log, "--config", cfg, "--out", spelling, "--force")
        assert "is the input" in msg and "not even with --force" in msg
    assert target.read_bytes() == before


@pytest.mark.parametrize("args,expected", [
    (["--every", "0"], "argument --every: expected an integer >= 1, got '0'"),
    (["--every", "-1"], "argument --every: expected an integer >= 1, got '-1'"),
    (["--table", "5"], "--table 5: {log} holds 1 result table(s), numbered 0 to 0"),
    (["--table", "-1"], "argument --table: expected an integer >= 0, got '-1'"),
    (["--offset", "99"], "--offset 99: the table has 7 rows, numbered 0 to 6"),
])  # fmt: skip
def test_calibrate_row_selection(capsys, measured, tmp_path, args, expected):
    log, cfg = measured
    msg = user_error(capsys, "calibrate", log, "--config", cfg, "--out", tmp_path / "c.yaml", *args)
    assert msg.endswith(expected.format(log=log)), msg
    assert not (tmp_path / "c.yaml").exists()


@pytest.mark.parametrize("kind", ["folder", "binary", "missing"])
def test_calibrate_log_that_is_not_a_log(capsys, measured, tmp_path, kind):
    _, cfg = measured
    bad = {"folder": tmp_path, "binary": tmp_path / "x.bin", "missing": tmp_path / "no.log"}[kind]
    if kind == "binary":
        bad.write_bytes(bytes(range(256)) * 4)
    msg = user_error(capsys, "calibrate", bad, "--config", cfg, "--out", tmp_path / "c.yaml")
    assert msg.startswith(f"error: nccl-tests log {bad}: "), msg


def test_calibrate_out_is_checked_before_the_fit(capsys, measured, tmp_path, monkeypatch):
    import triosim.calibration

    def no_fit(*a, **k):
        raise AssertionError("fitted before the output was checked")

    monkeypatch.setattr(triosim.calibration, "calibrate", no_fit)
    log, cfg = measured
    msg = user_error(capsys, "calibrate", log, "--config", cfg, "--out", tmp_path)
    assert msg == f"error: --out {tmp_path} is a folder; name a file"


def test_calibrate_slowed_links_fit_the_slowed_system(capsys, measured, tmp_path):
    # a log measured on a system whose GPU 0 links run at half speed: described with the
    # heterogeneity, it fits NCCL's figures (scale 1); without it the bandwidth scale is off
    log, _ = measured
    het = {"bandwidth": {0: 2.0}}
    code, out, _ = triosim(capsys, "collectives", write(tmp_path, dict(SYSTEM, heterogeneity=het),
                           "slow.yaml"), "-b", "1M", "-e", "1G", "-f", "4")  # fmt: skip
    log.write_text(out)
    for name, data in (("with", dict(SYSTEM, heterogeneity=het)), ("without", SYSTEM)):
        c = write(tmp_path, data, f"{name}.yaml")
        code, _, err = triosim(capsys, "calibrate", log, "--config", c, "--out",
                               tmp_path / f"{name}-c.yaml")  # fmt: skip
        assert code == 0, err
    fit = {n: yaml.safe_load((tmp_path / f"{n}-c.yaml").read_text())["tuning"]
           for n in ("with", "without")}  # fmt: skip
    assert fit["with"]["bandwidth_scale_Simple"] == pytest.approx(1.0, rel=0.05)
    assert fit["without"]["bandwidth_scale_Simple"] < 0.7


def test_set_is_parsed_alike_everywhere(capsys, tmp_path):
    cfg = write(tmp_path, SYSTEM)
    msg = user_error(capsys, "collectives", cfg, "--set", "num_gpus=[2")
    assert "--set 'num_gpus=[2'" in msg and "not valid YAML" in msg
    assert re.search(r"--set expects FIELD=VALUE, got 'num_gpus'$",
                     user_error(capsys, "collectives", cfg, "--set", "num_gpus"))  # fmt: skip
