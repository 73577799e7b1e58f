"""compare, plot and the outputs of one run: per-GPU layers, the Chrome trace's tracks,
figures that say what they show, the progress bar."""

import io
import json
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import chain_trace
from tests.conftest import run_cli as triosim
from triosim.cli.main import main
from triosim.results import figures, link_plots, plots
from triosim.simulation.progress import RunProgress, run_with_progress
from triosim.simulation.wiring import Simulation
from triosim.studies import compare

ROOT = Path(__file__).resolve().parents[1]
GPT2 = str(ROOT / "traces/cpu/gpt2-small-b8.trace.json.gz")


@pytest.fixture(autouse=True)
def _in_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def dp_yaml(tmp_path_factory):
    f = tmp_path_factory.mktemp("cfg") / "dp.yaml"
    f.write_text(
        f"trace: {GPT2}\nnum_gpus: 4\nbatch_size: 32\nperfmodel: {{kind: trace}}\n"
        "parallelism: {mode: dp}\ntopology: {kind: ring, bandwidth: 10 GB/s}\n"
    )
    return f


@pytest.fixture(scope="module")
def saved_dp(tmp_path_factory, dp_yaml):
    """A DP config simulated and saved by the command line."""
    out = tmp_path_factory.mktemp("dp")
    assert main(["simulate", str(dp_yaml), "--out", str(out), "--force"]) == 0
    return out


def test_compare_a_run_with_itself_shows_zero_differences(capsys, saved_dp, dp_yaml, tmp_path):
    code, out, err = triosim(capsys, "compare", dp_yaml, saved_dp, "--out", tmp_path / "c.png")
    assert code == 0, err
    assert "(simulated now: dp, 4 GPUs)" in out and "(saved result: dp, 4 GPUs)" in out
    rows = [line for line in out.splitlines() if "(ms)" in line or "(MB)" in line or "(GB)" in line]
    assert [r.split()[0] for r in rows] == [
        "iteration",
        "compute",
        "communication",
        "exposed",
        "idle",
        "bytes",
        "peak",
    ]
    for r in rows:
        *_, diff, ratio = r.split()
        assert diff == "+0.0000" and ratio in ("1.0000x", "n/a"), r
    df = compare.table([compare.load(saved_dp), compare.load(saved_dp)])
    assert (df.iloc[:, 2] == 0).all()  # "dp (2) - dp": exactly zero
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_compare_shows_peak_memory_when_a_summary_has_it(saved_dp, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    s = json.loads((saved_dp / "summary.json").read_text())
    base = s["peak_memory_gb_max"]
    s.update(peak_memory_gb_max=3.0, iteration_time_ms=2 * s["iteration_time_ms"])
    (other / "summary.json").write_text(json.dumps(s))
    text = compare.format_table([compare.load(saved_dp), compare.load(other)])
    line = next(x for x in text.splitlines() if x.startswith("peak memory / GPU (GB)"))
    assert [float(x) for x in line.split()[5:7]] == pytest.approx([base, 3.0], abs=1e-4)
    it = next(x for x in text.splitlines() if x.startswith("iteration time"))
    assert it.split()[-1] == "2.0000x"


@pytest.mark.parametrize(
    "args,match",
    [
        (["examples/dp.yaml"], "two runs or more"),
        (["examples/dp.yaml", "nowhere.yaml"], "nowhere.yaml does not exist"),
        (["examples/dp.yaml", "examples"], "without summary.json"),
        (["examples/dp.yaml", "examples/dp.yaml", "--out", "README.md"], "name a .png file"),
    ],
)
def test_compare_mistakes_are_one_error_line_before_any_run(capsys, args, match):
    code, out, err = triosim(capsys, "compare", *args)
    assert code == 2 and match in err and "Traceback" not in err and "iteration" not in out


def test_plot_of_a_result_folder_and_its_mistakes(capsys, saved_dp, tmp_path):
    code, out, err = triosim(
        capsys, "plot", saved_dp, "--kind", "breakdown", "--out", tmp_path / "b.png"
    )
    assert code == 0 and (tmp_path / "b.png").stat().st_size > 10_000, err
    code, _, err = triosim(capsys, "plot", saved_dp, "--out", tmp_path / "b.png")
    assert code == 2 and "exists; pass --force" in err
    code, _, err = triosim(capsys, "plot", saved_dp, "--x", "num_gpus")
    assert code == 2 and "--x, --y and --hue are for a sweep table" in err
    code, _, err = triosim(capsys, "plot", tmp_path)
    assert code == 2 and "neither summary.json" in err


def test_plot_of_a_sweep_table(capsys, tmp_path):
    from triosim.studies import sweep as sw

    df = sw.sweep(
        {"trace": GPT2, "perfmodel": {"kind": "trace"}},
        {"parallelism.mode": ["dp", "ddp"]},
        zipped={"num_gpus": [1, 2, 4], "batch_size": [8, 16, 32]},
        progress=False,
    )
    sw.write_table(df, tmp_path)
    assert sw.parameters(df) == ["parallelism.mode", "num_gpus", "batch_size"]
    assert sw.axes(df) == (
        "num_gpus",
        "iteration_time_ms",
        ["parallelism.mode"],
        ["batch_size varies with num_gpus (one value per num_gpus)"],
    )
    code, out, err = triosim(
        capsys,
        "plot",
        tmp_path / "sweep.csv",
        "--y",
        "exposed_comm_ms_mean",
        "--hue",
        "parallelism.mode",
    )
    png = tmp_path / "plot-exposed_comm_ms_mean-vs-num_gpus.png"
    assert code == 0 and png.stat().st_size > 10_000, err
    code, _, err = triosim(capsys, "plot", tmp_path, "--y", "speed")
    assert code == 2 and "--y 'speed' is not a column" in err and "iteration_time_ms" in err


def test_per_layer_is_per_gpu_not_averaged():
    t = chain_trace(batch=8)
    r = Simulation(
        {"num_gpus": 2, "parallelism": {"mode": "gpipe", "microbatches": 2}}, trace=t
    ).run()
    pl = r.per_layer()
    assert list(pl.columns) == ["gpu", "layer", "compute", "comm"]
    stage0 = set(pl[pl["gpu"] == 0]["layer"])
    stage1 = set(pl[pl["gpu"] == 1]["layer"])
    assert {"layer0", "layer1"} <= stage0 and "layer0" not in stage1
    tl = r.timeline
    mine = tl[(tl.gpu == 0) & (tl.layer == "layer0") & (tl.kind == "compute")]
    row = pl[(pl.gpu == 0) & (pl.layer == "layer0")].iloc[0]
    assert row["compute"] == pytest.approx((mine.end - mine.start).sum(), rel=1e-12)


def test_chrome_trace_has_integer_named_threads_and_a_track_per_direction(tmp_path):
    r = Simulation(
        {"num_gpus": 3, "parallelism": {"mode": "gpipe", "microbatches": 2}},
        trace=chain_trace(batch=8, layers=6),
    ).run()
    events = json.loads(r.to_chrome_trace(tmp_path / "t.json").read_text())["traceEvents"]
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["tid"], int) for e in events)
    assert {(e["pid"], e["tid"]) for e in spans} <= set(names)  # every track is named
    net = [
        e
        for e in events
        if e["ph"] == "M"
        and e["name"] == "process_name"
        and e["args"]["name"].startswith("network")
    ][0]["pid"]
    tracks = {names[net, e["tid"]] for e in spans if e["pid"] == net}
    pairs = {
        f"GPU {s} -> GPU {d}" for s, d in zip(r.transfers().src, r.transfers().dst, strict=True)
    }
    assert tracks == pairs and {"GPU 0 -> GPU 1", "GPU 1 -> GPU 0"} <= tracks
    assert names[0, 0] == "compute stream" and names[0, 1] == "send_fwd stream"  # pipeline sends
    assert all("nbytes" in e["args"] for e in spans)


def test_saved_tables_name_bytes_nbytes(tmp_path):
    r = Simulation({"num_gpus": 2, "parallelism": {"mode": "dp"}}, trace=chain_trace()).run()
    r.save(tmp_path)
    for f in ("timeline.csv", "links.csv"):
        cols = pd.read_csv(tmp_path / f).columns
        assert "nbytes" in cols and "bytes" not in cols, f
    assert list(pd.read_csv(tmp_path / "per_layer.csv").columns) == [
        "gpu",
        "layer",
        "compute",
        "comm",
    ]


def test_timeline_says_which_gpus_it_shows_and_has_a_legend():
    shown, note = plots.sample_gpus(list(range(84)))
    assert len(shown) == 16 and shown[:2] == [0, 1] and shown[-2:] == [82, 83]
    assert note.startswith("16 of 84 GPUs shown")
    assert plots.sample_gpus(list(range(16)))[1] == "all 16 GPUs"
    r = Simulation(
        {"num_gpus": 20, "batch_size": 20, "parallelism": {"mode": "ddp"}},
        trace=chain_trace(batch=20),
    ).run()
    ax = plots.timeline_figure(r.timeline, r.gpus, "t")
    shown, note = plots.sample_gpus(r.gpus)
    assert note == "12 of 20 GPUs shown: the first 2, the last 2 and every 2nd in between"
    assert note in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "forward",
        "backward",
        "optimizer",
        "communication",
    ]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"GPU {g}" for g in reversed(shown)]
    figures.pyplot().close(ax.figure)


def test_link_figure_draws_rings_and_grids_and_lists_the_rest():
    def fig(n, topology):
        r = Simulation(
            {"num_gpus": n, "batch_size": 8, "parallelism": {"mode": "dp"}, "topology": topology},
            trace=chain_trace(batch=8),
        ).run()
        ax = link_plots.links_figure(r.links, r.gpus, r.topology_layout(), "t")
        figures.pyplot().close(ax.figure)
        return ax, r.links

    ax, links = fig(4, {"kind": "ring"})
    assert len([c for c in ax.get_children() if type(c).__name__ == "Annotation"]) == len(links)
    assert "circle" in ax.get_title()
    ax, links = fig(8, {"kind": "torus2d", "rows": 2, "cols": 4})
    assert "wrap-around links as stubs" in ax.get_title()
    ax, links = fig(4, {"kind": "switch"})
    assert "all 8 link directions" in ax.get_title() and len(ax.patches) == 8


def test_progress_bar_counts_tasks_of_a_running_simulation():
    sim = Simulation({"num_gpus": 2, "parallelism": {"mode": "ddp"}}, trace=chain_trace())
    out = io.StringIO()
    r = run_with_progress(sim, file=out, enabled=True, delay=0, interval=0.001)
    last = out.getvalue().strip().split("\r")[-1]  # the bar's final state
    done = int(last.split("simulating 2 GPUs: ")[1].split(" tasks done")[0])
    assert done >= int((r.timeline["kind"] == "compute").sum()) > 0
    assert f"tasks done, {r.total_time * 1e3:.3f} ms simulated" in last
    quiet = io.StringIO()
    with RunProgress(file=quiet):  # not a terminal: no bar
        pass
    assert quiet.getvalue() == ""
