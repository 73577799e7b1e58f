"""Issue 29, the command-line edges: every writer refuses to write over its inputs, over an
existing file without --force, or half a file; every argument a command takes is checked
(zero, negative, NaN, huge, a folder, a binary file) and refused with one `error:` line and
exit 2, never a traceback and never a silently wrong answer."""

import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli as triosim
from triosim.hardware import nccl_tests

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz"
# a system with no trace: collectives and calibrate need none
SYSTEM = {
    "num_gpus": 8,
    "gpu": "A100-80GB",
    "topology": {"kind": "switch", "bandwidth": "300 GB/s", "latency": "0.7 us"},
}


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
    code, out, err = triosim(capsys, "collectives", write(tmp_path, SYSTEM), "-b", "1M", "-e", "4M")
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
    msg = user_error(
        capsys,
        "collectives",
        write(tmp_path, SYSTEM),
        "--op",
        op,
        "-b",
        "1M",
        "-e",
        "1M",
        "-r",
        "99",
    )
    assert msg == "error: -r 99: the root must be a rank of the 8 GPUs (0 to 7)"
    assert "expected an integer >= 0" in user_error(
        capsys, "collectives", write(tmp_path, SYSTEM), "-r", "-1"
    )


@pytest.mark.parametrize("option", ["-b", "-e", "-i"])
@pytest.mark.parametrize(
    "value,why",
    [
        ("1e30", "more than 1T"),
        ("2T", "more than 1T"),
        ("1P", "not a size"),
        ("-1", "not a size"),
        ("nan", "not a size"),
        ("inf", "not a size"),
        ("1.5", "not a whole number of bytes"),
    ],
)
def test_collectives_one_size_parser_for_b_e_and_i(capsys, tmp_path, option, value, why):
    args = {"-b": "8", "-e": "1T", "-f": "1", "-i": "1G"}
    args[option] = value
    msg = user_error(
        capsys, "collectives", write(tmp_path, SYSTEM), *[x for kv in args.items() for x in kv]
    )
    assert msg.startswith(f"error: {option} {value!r}: {why}"), msg


def test_collectives_1t_is_the_largest_size(capsys, tmp_path):
    code, out, err = triosim(capsys, "collectives", write(tmp_path, SYSTEM), "-b", "1T", "-e", "1T")
    assert code == 0, err
    assert [r.size for r in rows(out)] == [2**40]


def test_collectives_refuses_a_billion_rows(capsys, tmp_path):
    msg = user_error(
        capsys, "collectives", write(tmp_path, SYSTEM), "-b", "1", "-e", "1G", "-f", "1", "-i", "1"
    )
    assert "gives 1,073,741,824 sizes, more than 100,000 rows" in msg
    assert "--max-rows 1073741824" in msg
    msg = user_error(
        capsys,
        "collectives",
        write(tmp_path, SYSTEM),
        "-b",
        "1",
        "-e",
        "64",
        "-i",
        "1",
        "--max-rows",
        "10",
    )
    assert "gives 64 sizes, more than 10 rows" in msg


def test_collectives_step_without_factor_steps(capsys, tmp_path):
    # -i alone used to be ignored (the default factor 2 won)
    code, out, err = triosim(
        capsys, "collectives", write(tmp_path, SYSTEM), "-b", "1K", "-e", "4K", "-i", "1K"
    )
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
    code, out, err = triosim(capsys, "collectives", write(tmp_path, data), "-b", "64M", "-e", "64M")
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
    assert msg == (
        f"error: communication.calibration file {calib}: not UTF-8 text (byte 0xd0 at offset 8)"
    )
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


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--every", "0"], "argument --every: expected an integer >= 1, got '0'"),
        (["--every", "-1"], "argument --every: expected an integer >= 1, got '-1'"),
        (["--table", "5"], "--table 5: {log} holds 1 result table(s), numbered 0 to 0"),
        (["--table", "-1"], "argument --table: expected an integer >= 0, got '-1'"),
        (["--offset", "99"], "--offset 99: the table has 7 rows, numbered 0 to 6"),
    ],
)
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
    import triosim.studies.calibration

    def no_fit(*a, **k):
        raise AssertionError("fitted before the output was checked")

    monkeypatch.setattr(triosim.studies.calibration, "calibrate", no_fit)
    log, cfg = measured
    msg = user_error(capsys, "calibrate", log, "--config", cfg, "--out", tmp_path)
    assert msg == f"error: --out {tmp_path} is a folder; name a file"


def test_calibrate_slowed_links_fit_the_slowed_system(capsys, measured, tmp_path):
    # a log measured on a system whose GPU 0 links run at half speed: described with the
    # heterogeneity, it fits NCCL's figures (scale 1); without it the bandwidth scale is off
    log, _ = measured
    het = {"bandwidth": {0: 2.0}}
    code, out, _ = triosim(
        capsys,
        "collectives",
        write(tmp_path, dict(SYSTEM, heterogeneity=het), "slow.yaml"),
        "-b",
        "1M",
        "-e",
        "1G",
        "-f",
        "4",
    )
    log.write_text(out)
    for name, data in (("with", dict(SYSTEM, heterogeneity=het)), ("without", SYSTEM)):
        c = write(tmp_path, data, f"{name}.yaml")
        code, _, err = triosim(
            capsys, "calibrate", log, "--config", c, "--out", tmp_path / f"{name}-c.yaml"
        )
        assert code == 0, err
    fit = {
        n: yaml.safe_load((tmp_path / f"{n}-c.yaml").read_text())["tuning"]
        for n in ("with", "without")
    }
    assert fit["with"]["bandwidth_scale_Simple"] == pytest.approx(1.0, rel=0.05)
    assert fit["without"]["bandwidth_scale_Simple"] < 0.7


def test_set_is_parsed_alike_everywhere(capsys, tmp_path):
    cfg = write(tmp_path, SYSTEM)
    msg = user_error(capsys, "collectives", cfg, "--set", "num_gpus=[2")
    assert "--set 'num_gpus=[2'" in msg and "not valid YAML" in msg
    assert re.search(
        r"--set expects FIELD=VALUE, got 'num_gpus'$",
        user_error(capsys, "collectives", cfg, "--set", "num_gpus"),
    )


# -- simulate: outputs ------------------------------------------------------------------------


@pytest.fixture
def tiny(tmp_path):
    """A fast config: the small GPT-2 trace replayed on one device."""
    p = tmp_path / "tiny.yaml"
    p.write_text(
        f"trace: {TRACE}\nnum_gpus: 1\nparallelism: {{mode: single}}\nperfmodel: {{kind: trace}}\n"
    )
    return p


def test_simulate_force_removes_what_an_earlier_run_wrote_and_nothing_else(capsys, tiny, tmp_path):
    run = tmp_path / "run"
    assert triosim(capsys, "simulate", tiny, "--out", run)[0] == 0
    assert triosim(capsys, "plot", run, "--kind", "breakdown")[0] == 0
    (run / "notes.txt").write_text("mine")
    (run / "plot-mine.png").write_text("mine too")
    assert (run / "plot-breakdown.png").exists()
    code, out, err = triosim(capsys, "simulate", tiny, "--out", run, "--force")
    assert code == 0, err
    assert "plot-breakdown.png among them" in out
    assert not (run / "plot-breakdown.png").exists()  # a figure of the earlier results
    assert (run / "notes.txt").read_text() == "mine"
    assert (run / "plot-mine.png").read_text() == "mine too"
    assert (run / "timeline.csv").exists() and (run / "summary.json").exists()


def test_simulate_never_writes_over_its_config_or_trace(capsys, tiny, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = run / "config.yaml"  # re-running a saved config into its own folder, changed
    cfg.write_text(tiny.read_text())
    msg = user_error(capsys, "simulate", cfg, "--out", run, "--force", "--set", "num_gpus=1")
    assert "its config.yaml is an input of this run" in msg and "not even with --force" in msg
    assert cfg.read_text() == tiny.read_text() and len(list(run.iterdir())) == 1
    trace = run / "trace.json.gz"
    trace.write_bytes(TRACE.read_bytes())
    other = tmp_path / "other.yaml"
    other.write_text(tiny.read_text().replace(str(TRACE), str(trace)))
    msg = user_error(capsys, "simulate", other, "--out", run, "--force")
    assert "its trace.json.gz is an input of this run" in msg
    assert trace.read_bytes() == TRACE.read_bytes()


def test_an_interrupted_trace_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    import json

    from triosim.trace import model as tr

    t = tr.load(TRACE)
    path = tmp_path / "t.trace.json.gz"
    tr.save(t, path)
    before = path.read_bytes()
    real = json.dump

    def cut(doc, f, **kw):
        f.write(json.dumps(doc)[:1000])  # half the file, then the process is stopped
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", cut)
    with pytest.raises(KeyboardInterrupt):
        tr.save(t, path)
    monkeypatch.setattr(json, "dump", real)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.trace.json.gz"]


def test_an_interrupted_figure_leaves_the_old_one_whole(capsys, tiny, tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert triosim(capsys, "simulate", tiny, "--out", run)[0] == 0
    before = (run / "timeline.png").read_bytes()
    from matplotlib.figure import Figure

    def cut(self, fname, **kw):
        Path(fname).write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", cut)
    code, _, err = triosim(
        capsys, "plot", run, "--kind", "timeline", "--out", run / "timeline.png", "--force"
    )
    assert code == 130, err
    assert (run / "timeline.png").read_bytes() == before
    assert not [p for p in run.iterdir() if "partial" in p.name]


# -- plot: a result folder cut short ----------------------------------------------------------


@pytest.mark.parametrize("cut", ["mid-line", "whole lines"])
def test_plot_refuses_a_truncated_timeline(capsys, tiny, tmp_path, cut):
    run = tmp_path / "run"
    assert triosim(capsys, "simulate", tiny, "--out", run)[0] == 0
    f = run / "timeline.csv"
    text = f.read_text()
    f.write_text(
        text[: len(text) // 2]
        if cut == "mid-line"
        else "".join(text.splitlines(keepends=True)[:100])
    )
    msg = user_error(capsys, "plot", run, "--kind", "timeline")
    assert msg.startswith(f"error: {f}: truncated or damaged ("), msg
    assert not (run / "plot-timeline.png").exists()


def test_plot_refuses_a_cut_timeline_of_an_older_folder(capsys, tiny, tmp_path):
    # a folder saved before summary.json recorded row counts: a cut line is still noticed
    import json

    run = tmp_path / "run"
    assert triosim(capsys, "simulate", tiny, "--out", run)[0] == 0
    s = json.loads((run / "summary.json").read_text())
    del s["rows"]
    (run / "summary.json").write_text(json.dumps(s))
    f = run / "timeline.csv"
    lines = f.read_text().splitlines(keepends=True)
    f.write_text("".join(lines[:50]) + lines[50][:30])
    assert "truncated or damaged" in user_error(capsys, "plot", run)


# -- search -----------------------------------------------------------------------------------


@pytest.fixture
def hopeless(tmp_path):
    """A search where no plan is valid: 3 GPUs cannot split a batch of 7, nor GPT-2's layers."""
    p = tmp_path / "s.yaml"
    p.write_text(f"trace: {TRACE}\nnum_gpus: 3\nbatch_size: 7\n")
    return p


def test_search_with_no_valid_plan(capsys, hopeless, tmp_path):
    code, out, err = triosim(capsys, "search", hopeless, "--out", tmp_path / "best.yaml")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: no plan is valid for {hopeless}")
    assert "not ranked: dp: invalid" in out and not (tmp_path / "best.yaml").exists()


def test_search_checks_out_before_searching(capsys, hopeless, tmp_path, monkeypatch):
    import triosim.studies.search

    def no_search(*a, **k):
        raise AssertionError("searched before --out was checked")

    monkeypatch.setattr(triosim.studies.search, "search", no_search)
    best = tmp_path / "best.yaml"
    best.write_text("mine")
    assert user_error(capsys, "search", hopeless, "--out", best) == (
        f"error: --out {best} exists; pass --force to overwrite it"
    )
    msg = user_error(capsys, "search", hopeless, "--out", hopeless, "--force")
    assert "is the input" in msg
    assert best.read_text() == "mine"
    assert "expected an integer >= 1" in user_error(capsys, "search", hopeless, "--workers", "0")


# -- trace ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
        (["--measure", "0"], "argument --measure: expected an integer >= 1, got '0'"),
        (["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got '-1'"),
        (["--seq-len", "0"], "argument --seq-len: expected an integer >= 1, got '0'"),
        (["--image-size", "-5"], "argument --image-size: expected an integer >= 1, got '-5'"),
    ],
)
def test_trace_arguments(capsys, tmp_path, args, expected):
    msg = user_error(capsys, "trace", "resnet18", "--batch-size", "2", "--out", tmp_path, *args)
    assert msg.endswith(expected), msg


def test_trace_refuses_an_existing_file_before_tracing(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import tracer.cli

    def no_trace(*a, **k):
        raise AssertionError("traced before the output was checked")

    monkeypatch.setattr(tracer.cli, "trace_model", no_trace)
    old = tmp_path / "resnet18-small-b2.trace.json.gz"
    old.write_text("mine")
    msg = user_error(capsys, "trace", "resnet18", "--small", "--batch-size", "2", "--out", tmp_path)
    assert msg == f"error: trace file {old} exists; pass --force to overwrite it"
    afile = tmp_path / "afile"
    afile.write_text("mine")
    msg = user_error(capsys, "trace", "resnet18", "--batch-size", "2", "--out", afile)
    assert msg == f"error: --out {afile} is a file; name a folder (the trace is written into it)"
    assert old.read_text() == "mine" and afile.read_text() == "mine"


def test_trace_file_name_is_the_one_written(tmp_path):
    from types import SimpleNamespace

    from tracer.cli import trace_file_name

    a = SimpleNamespace(
        model="gpt2", small=True, master_weights=False, shapes_only=True, seq_len=16, batch_size=2
    )
    assert trace_file_name(a) == "gpt2-small-s16-b2.trace.json.gz"
    a = SimpleNamespace(
        model="pkg.mod:make", small=False, shapes_only=False, seq_len=128, batch_size=4
    )
    assert trace_file_name(a) == "make-b4.trace.json.gz"


# -- traces: metadata ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("batch_size", "eight"),
        ("batch_size", 0),
        ("batch_size", 2.5),
        ("seq_len", [128]),
        ("gpu", 80),
    ],
)
def test_trace_metadata_that_is_not_what_it_says(capsys, tmp_path, field, value):
    import gzip
    import json

    doc = json.loads(gzip.decompress(TRACE.read_bytes()))
    doc["metadata"][field] = value
    bad = tmp_path / "bad.trace.json"
    bad.write_text(json.dumps(doc))
    msg = user_error(capsys, "info", bad)
    assert msg.startswith(f"error: file {bad}, field 'metadata.{field}': "), msg
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trace: bad.trace.json\nnum_gpus: 2\nbatch_size: 8\nparallelism: {mode: dp}\n")
    assert user_error(capsys, "simulate", cfg, "--no-save") == msg


# -- sweep --------------------------------------------------------------------------------------


def test_sweep_api_names_what_it_wants():
    from triosim.studies.sweep import sweep

    with pytest.raises(TypeError, match="base config must be a mapping of config fields"):
        sweep(str(ROOT / "examples" / "ddp.yaml"), {"num_gpus": [2]})


@pytest.fixture
def grid(tmp_path, tiny):
    g = tmp_path / "g.yaml"
    g.write_text(
        "base: tiny.yaml\ngrid:\n  topology.bandwidth: [10 GB/s, 20 GB/s]\nzip:\n  seed: [1, 2]\n"
    )
    return g


@pytest.mark.parametrize(
    "assignment,varied",
    [
        ("topology.bandwidth=5 GB/s", "topology.bandwidth"),
        ("topology={kind: ring}", "topology.bandwidth"),
        ("seed=3", "seed"),
    ],
)
def test_sweep_set_of_a_field_the_grid_varies(capsys, grid, tmp_path, assignment, varied):
    msg = user_error(capsys, "sweep", grid, "--out", tmp_path / "o", "--set", assignment)
    assert f"--set {assignment.split('=')[0]}: the grid file varies {varied}" in msg
    assert not (tmp_path / "o").exists()


def test_sweep_says_how_many_points_before_checking_them(capsys, grid, tmp_path):
    grid.write_text("base: tiny.yaml\ngrid:\n  seed: [1, 2, 3]\n  num_gpus: [1, 0]\n")
    code, out, err = triosim(capsys, "sweep", grid, "--out", tmp_path / "o")
    assert code == 2 and "error: grid point 1 (seed=1, num_gpus=0)" in err
    assert out.startswith(f"sweep {grid}: 6 points (3 seed x 2 num_gpus)")


def test_sweep_failed_point_exits_1_after_writing_the_table(capsys, grid, tmp_path):
    from triosim.studies import sweep as sw

    grid.write_text("base: tiny.yaml\ngrid:\n  num_gpus: [1, 2]\n")  # trace model: 1 GPU only
    code, out, err = triosim(capsys, "sweep", grid, "--out", tmp_path / "o", "--workers", "1")
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        "error: 1 of 2 points failed (the error_type and error columns say why)"
    )
    assert len(sw.read_table(tmp_path / "o")) == 2


def test_sweep_force_starts_clean_but_keeps_the_users_files(capsys, grid, tmp_path):
    o = tmp_path / "o"
    assert triosim(capsys, "sweep", grid, "--out", o, "--workers", "1")[0] == 0
    assert triosim(capsys, "plot", o, "--x", "topology.bandwidth")[0] == 0
    [fig] = o.glob("plot-*.png")
    (o / "mine.txt").write_text("mine")
    code, out, err = triosim(capsys, "sweep", grid, "--out", o, "--workers", "1", "--force")
    assert code == 0, err
    assert f"{fig.name} among them" in out and not fig.exists()
    assert (o / "mine.txt").read_text() == "mine" and (o / "sweep.csv").exists()


def test_sweep_force_into_a_result_folder_keeps_the_results(capsys, tiny, grid, tmp_path):
    # --force removes what an earlier run of the same command wrote, not another's results
    run = tmp_path / "run"
    assert triosim(capsys, "simulate", tiny, "--out", run)[0] == 0
    before = sorted(p.name for p in run.iterdir())
    code, _, err = triosim(capsys, "sweep", grid, "--out", run, "--workers", "1", "--force")
    assert code == 0, err
    assert set(before) <= {p.name for p in run.iterdir()}


# -- more of the same kinds ---------------------------------------------------------------------


def test_sweep_zip_of_unequal_lengths_is_refused_before_the_count(capsys, tiny, tmp_path):
    g = tmp_path / "g.yaml"
    g.write_text(
        "base: tiny.yaml\ngrid:\n  num_gpus: [1]\nzip:\n  seed: [1, 2]\n  iterations: [1]\n"
    )
    code, out, err = triosim(capsys, "sweep", g, "--out", tmp_path / "o")
    assert code == 2 and "lists of one length" in err
    assert "points" not in out  # no count printed that is not the grid's


def test_plot_hue_that_is_an_axis(capsys, grid, tmp_path):
    o = tmp_path / "o"
    assert triosim(capsys, "sweep", grid, "--out", o, "--workers", "1")[0] == 0
    msg = user_error(capsys, "plot", o, "--x", "topology.bandwidth", "--hue", "topology.bandwidth")
    assert (
        msg
        == "error: --hue 'topology.bandwidth' is the x axis itself; name another parameter (or none)"
    )


def test_calibrate_op_that_contradicts_the_log(capsys, measured, tmp_path):
    real = ROOT / "benchmarks/data/nccl_tests/h100_8gpu_allreduce_dgxc-benchmarking.txt"
    msg = user_error(
        capsys,
        "calibrate",
        real,
        "--config",
        ROOT / "examples/ddp_h100_node.yaml",
        "--out",
        tmp_path / "c.yaml",
        "--op",
        "broadcast",
    )
    assert msg.startswith(f"error: --op broadcast: table 0 of {real} is all_reduce_perf's")
    # `triosim collectives` names its test in its header: a contradicting --op is refused
    # (it was fitted as broadcast without a word)
    log, cfg = measured
    msg = user_error(
        capsys, "calibrate", log, "--config", cfg, "--out", tmp_path / "b.yaml", "--op", "broadcast"
    )
    assert msg.startswith(f"error: --op broadcast: table 0 of {log} is all_reduce_perf's")
    # a log that does not name its test (that header cut off): fitted as all_reduce, and said so
    unnamed = tmp_path / "unnamed.log"
    unnamed.write_text("".join(log.read_text().splitlines(keepends=True)[1:]))
    code, _, err = triosim(
        capsys, "calibrate", unnamed, "--config", cfg, "--out", tmp_path / "d.yaml"
    )
    assert code == 0 and "does not name its test: fitting table 0 as all_reduce" in err


def test_import_empty_gpu_name(capsys, tmp_path):
    from tests.test_trace import TENSOR_CSV, TRACE_CSV

    (tmp_path / "trace.csv").write_text(TRACE_CSV)
    (tmp_path / "tensor.csv").write_text(TENSOR_CSV)
    msg = user_error(capsys, "import", tmp_path, tmp_path / "t.trace.json", "--gpu", "")
    assert msg.startswith("error: --gpu '' is not in the catalogue")


def test_simulate_no_save_with_out(capsys, tiny, tmp_path):
    msg = user_error(capsys, "simulate", tiny, "--no-save", "--out", tmp_path / "o")
    assert (
        msg == f"error: --no-save and --out {tmp_path / 'o'}: give one (--no-save writes nothing)"
    )


def test_trace_model_options_checked_before_tracing(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import tracer.cli

    def no_trace(*a, **k):
        raise AssertionError("traced before the options were checked")

    monkeypatch.setattr(tracer.cli, "trace_model", no_trace)
    binary = tmp_path / "cal.json"
    binary.write_bytes(b"\xd0\xff" * 50)
    shape = ["trace", "gpt2", "--small", "--batch-size", "2", "--out", tmp_path, "--shapes-only"]
    msg = user_error(capsys, *shape, "--gpu", "H100-SXM", "--calibration", binary)
    assert "perfmodel.calibration" in msg and "a readable calibration table" in msg
    assert "'Z9' is not allowed" in user_error(capsys, *shape, "--gpu", "Z9")
    msg = user_error(
        capsys, "trace", "resnet18", "--batch-size", "2", "--out", tmp_path, "--calibration", binary
    )
    assert "--calibration is the table a shape-only trace is modelled with" in msg


def test_sweep_starts_no_more_workers_than_points(capsys, grid, tmp_path, monkeypatch):
    from triosim.studies import sweep as sw

    seen = []

    def fake(folder, plan, workers, scheduler=None):
        seen.append(workers)
        return sw.table(plan.points, {p.id: {"error_type": None, "error": None} for p in plan.todo})

    monkeypatch.setattr(sw, "sweep_to", fake)
    code, out, err = triosim(capsys, "sweep", grid, "--out", tmp_path / "o", "--workers", "1000")
    assert code == 0, err
    assert seen == [4] and "4 worker processes" in out  # 2 bandwidths x 2 zipped seeds


def test_plot_refuses_a_truncated_sweep_table(capsys, grid, tmp_path):
    o = tmp_path / "o"
    assert triosim(capsys, "sweep", grid, "--out", o, "--workers", "1")[0] == 0
    (o / "sweep.parquet").unlink(missing_ok=True)
    text = (o / "sweep.csv").read_text()
    (o / "sweep.csv").write_text(text[: len(text) - 40])
    msg = user_error(capsys, "plot", o / "sweep.csv")
    assert msg.startswith(f"error: sweep table {o / 'sweep.csv'}: truncated")


# -- issue 44: no writer writes over an input, --force included ---------------------------------
def test_search_and_calibrate_never_write_over_the_configs_trace(capsys, measured, tmp_path):
    """The trace a config names is an input like the config: `search --out` and `calibrate
    --out` refuse it with --force (each failed before: the trace was overwritten)."""
    import shutil

    trace = tmp_path / "mine.trace.json.gz"
    shutil.copy(TRACE, trace)
    cfg = tmp_path / "s.yaml"
    cfg.write_text(f"trace: {trace.name}\nnum_gpus: 3\nbatch_size: 7\n")
    before = trace.read_bytes()
    msg = user_error(capsys, "search", cfg, "--out", trace, "--force")
    assert "is the input" in msg and "not even with --force" in msg
    log, system = measured
    with_trace = write(tmp_path, {**SYSTEM, "trace": trace.name}, "sys-trace.yaml")
    msg = user_error(capsys, "calibrate", log, "--config", with_trace, "--out", trace, "--force")
    assert "is the input" in msg
    assert trace.read_bytes() == before


def test_export_chakra_never_writes_over_the_workload_it_runs(capsys, tmp_path):
    """A config of mode chakra exported (--force) into its own workload folder, given as a
    folder or as a prefix: refused, the workload's bytes unchanged (item 1 of issue 44:
    workload.1.et was rewritten with doubled durations)."""
    src = tmp_path / "src.yaml"
    src.write_text(f"trace: {TRACE}\nnum_gpus: 2\nbatch_size: 8\nparallelism: {{mode: ddp}}\n")
    work = tmp_path / "in3"
    assert triosim(capsys, "export-chakra", src, "--out", work)[0] == 0
    before = {f.name: f.read_bytes() for f in work.iterdir()}
    for path in (work, work / "workload"):
        cfg = write(
            tmp_path,
            {
                "num_gpus": 2,
                "parallelism": {"mode": "chakra", "path": str(path)},
                "heterogeneity": {"compute": {1: 2.0}},
            },
            "in3.yaml",
        )
        msg = user_error(capsys, "export-chakra", cfg, "--out", work, "--force")
        assert "is an input of this run" in msg and "not even with --force" in msg
    assert {f.name: f.read_bytes() for f in work.iterdir()} == before


def test_a_killed_runs_partial_file_neither_blocks_a_rerun_nor_outlives_force(
    capsys, tiny, tmp_path
):
    """A run killed while writing leaves `.timeline.partial-PID.csv` (its writer gone): a
    plain rerun into the folder is not blocked by it, and it is removed; a live writer's
    partial file is left alone."""
    import os
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(gone.stdout)
    run = tmp_path / "run"
    run.mkdir()
    stale = run / f".timeline.partial-{dead}.csv"
    stale.write_text("half a table")
    code, _, err = triosim(capsys, "simulate", tiny, "--out", run)
    assert code == 0, err
    assert not stale.exists() and (run / "timeline.csv").exists()
    live = run / f".timeline.partial-{os.getppid()}.csv"  # a live process (not this one)
    live.write_text("being written")
    stale.write_text("half a table")
    assert triosim(capsys, "simulate", tiny, "--out", run, "--force")[0] == 0
    assert not stale.exists() and live.exists()


def test_unclear_messages_of_issue_44_name_the_field_and_what_is_expected(capsys, tiny, tmp_path):
    """`parallelism: null` on 2 GPUs blamed num_gpus alone; `--out ''` was reported as
    `--out .`; perfmodel.kind's help omitted calibrated and learned."""
    from perfmodel import MODELS
    from triosim.config.loading import PerfModelConfig

    cfg = write(tmp_path, {"trace": str(TRACE), "num_gpus": 2, "parallelism": None}, "n.yaml")
    msg = user_error(capsys, "simulate", cfg, "--no-save")
    assert "'num_gpus' = 2" in msg and "name a mode" in msg
    msg = user_error(capsys, "simulate", tiny, "--out", "")  # (every command: test_bad_inputs)
    assert "--out: '': a file or folder name (an empty one is none)" in msg
    import dataclasses

    (kind,) = [f for f in dataclasses.fields(PerfModelConfig) if f.name == "kind"]
    assert set(MODELS.names()) <= set(kind.metadata["help"].replace("|", " ").split())


def test_the_search_table_says_n_a_for_a_missing_figure_in_every_row():
    """Issue 44: mfu printed None in one row and NaN in another."""
    import pandas as pd

    from triosim.cli.run import ranked_table

    frame = pd.DataFrame(
        {
            "plan": ["dp", "ddp", "tp 2"],
            "mfu": [None, float("nan"), 0.41],
            "tokens_per_s": [None] * 3,
        }
    )
    text = ranked_table(frame)
    assert "None" not in text and "NaN" not in text and "nan" not in text
    assert text.count("n/a") == 5 and "0.41" in text


def test_a_set_that_changes_the_mode_leaves_out_the_old_modes_fields_and_says_so(capsys):
    """Issue 44: `--set parallelism.mode=ddp` on a 1F1B config failed on the config's own
    `microbatches` (a field of the old mode); it now follows a sweep's rule: left out and
    said; a field the --set itself names is still refused, naming it."""
    cfg = ROOT / "examples" / "1f1b.yaml"
    code, out, err = triosim(capsys, "simulate", cfg, "--set", "parallelism.mode=ddp", "--no-save")
    assert code == 0, err
    assert "--set: left out parallelism.microbatches" in out
    msg = user_error(
        capsys,
        "simulate",
        cfg,
        "--set",
        "parallelism.mode=ddp",
        "--set",
        "parallelism.microbatches=2",
        "--no-save",
    )
    assert "'parallelism.microbatches' = 2" in msg


@pytest.mark.parametrize("input_kind", ["trace", "calibration"])
@pytest.mark.parametrize(
    "command",
    ["simulate", "sweep", "export-chakra", "search", "calibrate", "compare", "train-time"],
)
def test_no_writer_writes_over_its_configs_trace_with_force(
    capsys, measured, tmp_path, command, input_kind
):
    """Issue 44's property over the writing commands: the trace a config names, or another
    input path of it (communication.calibration), sitting where the command writes (under
    the name it writes, for a folder's outputs), is never written over, not even with
    --force: each refuses naming the input."""
    import shutil

    log, _ = measured
    out = tmp_path / "out"
    out.mkdir()
    # the file the command writes, made an input by naming it as the config's trace
    target = {
        "simulate": out / "timeline.csv",
        "sweep": out / "sweep.csv",
        "export-chakra": out / "comm_group.json",
        "search": out / "best.yaml",
        "calibrate": out / "calib.yaml",
        "compare": out / "chart.png",
        "train-time": out / "goodput.png",
    }[command]
    shutil.copy(TRACE, target)
    if target.suffix in (".json", ".png"):  # a plain JSON trace by that name
        import gzip

        target.write_bytes(gzip.decompress(TRACE.read_bytes()))
    cfg = {
        "trace": str(target),
        "num_gpus": 2,
        "batch_size": 8,
        "parallelism": {"mode": "ddp"},
        **({"gpu": "A100-80GB", "topology": SYSTEM["topology"]} if command == "calibrate" else {}),
    }
    if input_kind == "calibration":  # the NCCL model's calibration file by that name instead
        target.write_text("tuning:\n  latency_scale: 1.0\n")
        cfg["trace"] = str(TRACE)
        cfg["communication"] = {"kind": "nccl", "calibration": str(target)}
    before = target.read_bytes()
    path = write(tmp_path, cfg, "c.yaml")
    args = {
        "simulate": ["simulate", path, "--out", out, "--force"],
        "sweep": [
            "sweep",
            write(tmp_path, {"base": str(path), "grid": {"num_gpus": [2]}}, "g.yaml"),
            "--out",
            out,
            "--force",
            "--workers",
            "1",
        ],
        "export-chakra": ["export-chakra", path, "--out", out, "--force"],
        "search": ["search", path, "--out", target, "--force"],
        "calibrate": ["calibrate", log, "--config", path, "--out", target, "--force"],
        "compare": ["compare", path, path, "--out", target, "--force"],
        "train-time": ["train-time", path, "--tokens", "1e9", "--plot", target, "--force"],
    }[command]
    msg = user_error(capsys, *args)
    assert "input" in msg and "not even with --force" in msg, msg
    assert target.read_bytes() == before
