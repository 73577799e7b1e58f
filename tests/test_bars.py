"""Progress where the output is not a terminal (issue 44: a sweep and a search printed
nothing for minutes into a log, or a bar of carriage returns): plain lines."""

import io
import re

from triosim.common.bars import LineBar, bar


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_off_a_terminal_a_line_every_interval_and_one_at_the_end(monkeypatch):
    import triosim.common.bars as bars

    clock = Clock()
    monkeypatch.setattr(bars.time, "monotonic", clock)
    out = io.StringIO()  # not a terminal
    b = bar(range(5), desc="sweep", unit="point", file=out, every=10.0)
    assert isinstance(b, LineBar)
    seen = []
    for i in b:
        clock.t += 6.0  # each point 6 s: a line after points 2 and 4 (12 s, 24 s)
        seen.append(i)
    lines = out.getvalue().splitlines()
    assert seen == [0, 1, 2, 3, 4]
    assert lines == [
        "sweep: 2/5 points (0:00:12)",
        "sweep: 4/5 points (0:00:24)",
        "sweep: 5/5 points (0:00:30)",
    ]
    assert "\r" not in out.getvalue()


def test_the_last_count_is_not_repeated_on_close(monkeypatch):
    """A line at the last point is the end: closing does not print the same count again
    (a sweep's log ended `2/2 points (0:00:44)`, `2/2 points (0:00:55)`)."""
    import triosim.common.bars as bars

    clock = Clock()
    monkeypatch.setattr(bars.time, "monotonic", clock)
    out = io.StringIO()
    for _ in bar(range(2), desc="sweep", unit="point", file=out, every=10.0):
        clock.t += 11.0
    assert out.getvalue().splitlines() == [
        "sweep: 1/2 points (0:00:11)",
        "sweep: 2/2 points (0:00:22)",
    ]


def test_a_short_run_writes_nothing_and_disabled_writes_nothing():
    out = io.StringIO()
    assert list(bar(range(3), desc="search", file=out)) == [0, 1, 2]
    assert out.getvalue() == ""
    b = bar(total=3, desc="sweep", enabled=False, file=out)
    b.update(3)
    b.close()
    assert out.getvalue() == ""


def slow_point(config):
    """A sweep point that takes `config["sleep"]` seconds (run in a worker process)."""
    import time as _time

    _time.sleep(config["sleep"])
    return {"slept": config["sleep"]}


def test_ctrl_c_stops_local_worker_processes_at_once(monkeypatch):
    """Issue 44: Ctrl-C during a sweep on local worker processes kept them running every
    queued point (the executor's exit waits for all); interrupted after the first point,
    the sweep returns within seconds, with that point's row kept, and no point of 30 s
    runs on."""
    import time as _time

    import pytest

    from triosim.studies import sweep

    monkeypatch.setattr(sweep, "run_point", slow_point)
    todo = [sweep.Point(0, {}, {"sleep": 0.05}, "a")] + [
        sweep.Point(i, {}, {"sleep": 30.0}, f"p{i}") for i in range(1, 5)
    ]
    rows = {}

    def done(p, row):
        rows[p.id] = row
        raise KeyboardInterrupt

    t0 = _time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        sweep._run_processes(todo, 2, done)
    assert _time.monotonic() - t0 < 10
    assert rows == {"a": {"slept": 0.05}}


def test_a_heartbeat_names_the_stage_while_work_that_counts_nothing_runs():
    """Issue 44: `trace --shapes-only` printed nothing for minutes; a heartbeat line every
    interval names the stage, and one says when it is done; a short run writes nothing."""
    import time as _time

    from triosim.common.bars import Heartbeat

    out = io.StringIO()
    with Heartbeat("tracing resnet152", every=0.05, file=out) as beat:
        beat.stage("running the model on the meta device")
        _time.sleep(0.13)
        beat.stage("timing 100 operators")
        _time.sleep(0.13)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("tracing resnet152: running the model on the meta device (")
    assert any(x.startswith("tracing resnet152: timing 100 operators (") for x in lines)
    assert lines[-1].startswith("tracing resnet152 done (")
    quiet = io.StringIO()
    with Heartbeat("tracing tiny", every=10.0, file=quiet):
        pass
    assert quiet.getvalue() == ""


# -- the commands use them (items 12, 13: the helpers alone were tested) -----------------------
def _cli_config(tmp_path):
    from pathlib import Path

    trace = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz"
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        f"trace: {trace}\nnum_gpus: 2\nbatch_size: 16\nparallelism: {{mode: ddp}}\n"
        "perfmodel: {kind: trace}\n"
    )
    return cfg, trace


def test_sweep_and_search_off_a_terminal_print_progress_lines(capsys, monkeypatch, tmp_path):
    """`triosim sweep` and `triosim search` into a log (capsys is no terminal) print plain
    progress lines; a clock that moves 11 s at each look stands in for a long run (before:
    tqdm, which prints nothing off a terminal)."""
    import types

    import triosim.common.bars as bars
    from tests.conftest import run_cli

    clock = Clock()

    def tick():
        clock.t += 11.0
        return clock.t

    # the bars' clock only (the simulation's own clock stays)
    monkeypatch.setattr(bars, "time", types.SimpleNamespace(monotonic=tick))
    cfg, _ = _cli_config(tmp_path)
    grid = tmp_path / "g.yaml"
    grid.write_text("base: tiny.yaml\ngrid:\n  topology.bandwidth: [10 GB/s, 20 GB/s]\n")
    code, out, err = run_cli(capsys, "sweep", grid, "--out", tmp_path / "o", "--workers", "1")
    assert code == 0, err
    assert "sweep: 2/2 points (" in err and "\r" not in err, err
    code, out, err = run_cli(capsys, "search", cfg, "--out", tmp_path / "best.yaml")
    assert code == 0, err
    assert re.search(r"search: (\d+)/\1 plans \(", err) and "\r" not in err, err


def test_trace_prints_what_it_runs_while_it_runs(capsys, monkeypatch, tmp_path):
    """`triosim trace` of a model that takes a while: a line naming the stage while it runs
    and one when it is done (before: nothing for minutes). The model is stood in for by a
    sleep and the saved trace; the heartbeat's interval is made short."""
    import time as _time

    import tracer.cli
    import triosim.common.bars as bars
    from tests.conftest import run_cli
    from triosim.trace.model import load

    _, path = _cli_config(tmp_path)

    def slow_model(*a, **k):
        _time.sleep(0.3)
        return load(path)

    monkeypatch.setattr(tracer.cli, "trace_model", slow_model)
    monkeypatch.setattr(bars.Heartbeat.__init__, "__defaults__", (0.05, None))
    code, out, err = run_cli(capsys, "trace", "resnet18", "--batch-size", "2", "--out", tmp_path)
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("tracing resnet18: running the model ("), err
    assert lines[-1].startswith("tracing resnet18 done ("), err


def test_import_and_export_print_what_they_run_while_they_run(capsys, monkeypatch, tmp_path):
    """Issue 44 ("progress everywhere a run can take more than ~10 s: ... import, export"):
    `import ET KINETO OUT` and `export-chakra` say what runs while it runs and when it is
    done (before: nothing). Each stand-in sleeps; the heartbeat's interval is made short."""
    import time as _time

    import tracer.profile_import
    import triosim.common.bars as bars
    import triosim.simulation.chakra_export as chakra_export
    from tests.conftest import run_cli
    from triosim.trace.model import load

    cfg, trace = _cli_config(tmp_path)
    monkeypatch.setattr(bars.Heartbeat.__init__, "__defaults__", (0.05, None))

    def slow_import(*a, **k):
        _time.sleep(0.3)
        t = load(trace)
        t.metadata.update(profiled_step="ProfilerStep#2", batch_size_source="given")
        return t

    monkeypatch.setattr(tracer.profile_import, "import_profile", slow_import)
    for name in ("a.et.json", "a.kineto.json"):
        (tmp_path / name).write_text("{}")
    pair = [tmp_path / "a.et.json", tmp_path / "a.kineto.json", tmp_path / "a.trace.json.gz"]
    code, out, err = run_cli(capsys, "import", *pair, "--batch-size", "8")
    assert code == 0, err
    assert err.startswith("importing a.et.json: reading the Execution Trace"), err
    assert err.splitlines()[-1].startswith("importing a.et.json done ("), err
    real = chakra_export.export_chakra

    def slow_export(*a, **k):
        _time.sleep(0.3)
        return real(*a, **k)

    monkeypatch.setattr(chakra_export, "export_chakra", slow_export)
    code, out, err = run_cli(capsys, "export-chakra", cfg, "--out", tmp_path / "ex")
    assert code == 0, err
    assert err.startswith("exporting tiny.yaml: simulating 2 GPUs and writing"), err
    assert err.splitlines()[-1].startswith("exporting tiny.yaml done ("), err
