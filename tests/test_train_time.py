"""The time to train (triosim/studies/train_time.py): Daly's expected wall time against
its closed-form limits and a seeded Monte Carlo of the same failures, the best checkpoint
interval against Young's and Daly's approximations, and the command."""

import math
from pathlib import Path

import numpy as np
import pytest

from triosim.studies.train_time import (
    TrainTimeOptions,
    best_interval,
    estimate,
    expected_time,
    simulate_failures,
    young_interval,
)

H = 3600.0


def test_without_failures_the_time_is_the_work_and_its_checkpoints():
    # 100 h of work, a checkpoint of 6 min every hour: 100 x 1.1 h
    assert expected_time(100 * H, H, 0.1 * H, 0.2 * H, math.inf) == pytest.approx(110 * H)
    # failures rarer and rarer: Daly's time tends to it
    assert expected_time(100 * H, H, 0.1 * H, 0.2 * H, 1e12) == pytest.approx(110 * H, rel=1e-6)


def test_dalys_expected_time_is_the_mean_of_the_failure_process():
    """100 h of work in 1 h segments, 6-min checkpoints, 12-min restarts, a failure every
    10 h on average: the mean of 3,000 seeded draws of the process within 3 standard
    errors of Daly's expression; the same seed gives the same draws, another seed others."""
    args = (100 * H, H, 0.1 * H, 0.2 * H, 10 * H)
    draws = simulate_failures(*args, runs=3000, seed=7)
    want = expected_time(*args)
    se = draws.std(ddof=1) / math.sqrt(len(draws))
    assert abs(draws.mean() - want) < 3 * se, (draws.mean() / H, want / H, se / H)
    assert want > 110 * H  # failures cost time
    assert np.array_equal(draws[:50], simulate_failures(*args, runs=50, seed=7))
    assert not np.array_equal(draws[:50], simulate_failures(*args, runs=50, seed=8))


@pytest.mark.parametrize("delta, mtbf", [(60.0, 3 * H), (30.0, 20 * H), (600.0, 50 * H)])
def test_the_best_interval_is_youngs_and_dalys_while_a_checkpoint_is_short(delta, mtbf):
    """The interval minimising the expected time against Young's sqrt(2 delta M) (first
    order: within 10 % while delta << M) and Daly's higher-order estimate (within 1 %):
    sqrt(2 delta M) (1 + sqrt(delta / (2M)) / 3 + delta / (18 M)) - delta."""
    best = best_interval(1e4 * H, delta, 300.0, mtbf)
    young = young_interval(delta, mtbf)
    x = delta / (2 * mtbf)
    daly = young * (1 + math.sqrt(x) / 3 + x / 9) - delta
    assert best == pytest.approx(young, rel=0.1)
    assert best == pytest.approx(daly, rel=0.01)
    t = lambda tau: expected_time(1e4 * H, tau, delta, 300.0, mtbf)  # noqa: E731
    assert t(best) <= min(t(best * 0.9), t(best * 1.1))


def test_an_estimate_by_hand():
    """1.5 s steps of 4M tokens for 15T tokens on 16,384 GPUs (Llama 3's failure rate:
    MTBF 2,111.5 GPU-days, so 3.09 h for the run), a 2 TB checkpoint at 2 TB/s: steps
    3,576,279; work 62.09 days; at the best interval the goodput is below 1 and above the
    first-order estimate 1 - sqrt(2 delta / M) - R / M."""
    o = TrainTimeOptions(tokens=15e12)
    t = estimate(1.5, 4 * 2**20, 16384, 2e12, o)
    assert t.steps == pytest.approx(15e12 / 2**22)
    assert t.work == pytest.approx(t.steps * 1.5)
    # Llama 3's cluster itself (2,048 hosts of 8, a NIC link a GPU): its 419 in 54 days
    assert (t.nodes, t.links) == (2048, 16384)
    assert t.mtbf == pytest.approx(54 * 24 * H / 419) and t.mtbf / H == pytest.approx(
        3.09, abs=0.01
    )
    assert t.checkpoint_write == pytest.approx(1.0)
    first_order = 1 - math.sqrt(2 * 1.0 / t.mtbf) - o.restart / t.mtbf
    assert first_order < t.goodput < 1


def test_failures_add_up_by_component():
    """Llama 3's Table 5 split by component, by hand: 246 GPU issues on 16,384 GPUs, 138
    others on 2,048 hosts, 35 switch and cable failures on 16,384 GPUs' links, all in 54
    days. One node of 8 GPUs has no link into a network: 8/m_gpu + 1/m_node; 64 GPUs on 8
    nodes add 64 links."""
    day = 24 * H
    m_gpu, m_node, m_link = 16384 * 54 * day / 246, 2048 * 54 * day / 138, 16384 * 54 * day / 35
    o = TrainTimeOptions(tokens=1e12)
    assert o.mtbf_gpu / day == pytest.approx(3596.5, abs=0.1)
    one = estimate(1.0, 1e6, 8, 1e9, o)
    assert (one.nodes, one.links) == (1, 0)
    assert one.mtbf == pytest.approx(1 / (8 / m_gpu + 1 / m_node))
    eight = estimate(1.0, 1e6, 64, 1e9, o, nodes=8)
    assert eight.links == 64
    assert eight.mtbf == pytest.approx(1 / (64 / m_gpu + 8 / m_node + 64 / m_link))
    # 4 GPUs a node: twice the hosts of the same GPUs, so more failures
    assert estimate(1.0, 1e6, 64, 1e9, o, nodes=16).mtbf < eight.mtbf


def test_the_command_plots_goodput_against_the_interval(capsys, tmp_path):
    from pathlib import Path

    from tests.conftest import run_cli

    example = Path(__file__).resolve().parents[1] / "examples" / "titan_llama8b_fsdp.yaml"
    png = tmp_path / "goodput.png"
    code, out, err = run_cli(
        capsys, "train-time", str(example), "--tokens", "1T", "--plot", str(png)
    )
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out
    code, _, err = run_cli(capsys, "train-time", str(example), "--tokens", "1T", "--plot", str(png))
    assert code == 2 and "exists; pass --force" in err
    code, _, err = run_cli(
        capsys, "train-time", str(example), "--tokens", "1T", "--plot", str(example)
    )
    assert code == 2 and "name a .png file" in err


def test_the_command_prints_the_estimate(capsys):
    from pathlib import Path

    from tests.conftest import run_cli

    example = Path(__file__).resolve().parents[1] / "examples" / "titan_llama8b_fsdp.yaml"
    code, out, err = run_cli(
        capsys, "train-time", str(example), "--tokens", "1T", "--restart", "1200 s"
    )
    assert code == 0, err
    assert "steps                    7,629,395 for 1e+12 tokens" in out  # 1e12 / (16 x 8192)
    assert "restart                  20.0 min" in out and "goodput" in out
    code, _, err = run_cli(capsys, "train-time", str(example), "--tokens", "many")
    assert code == 2 and "argument --tokens: a count such as 15e12 or 15T, got 'many'" in err


def test_with_variability_the_step_is_the_mean_of_the_seeded_runs(capsys, tmp_path):
    """--cv: the step the estimate uses is the mean of `triosim variability`'s seeded runs
    (the same draws), its P50 and P99 printed; --cv 0 is the deterministic step."""
    import yaml

    from tests.conftest import run_cli
    from triosim.studies.variability import iteration_times

    root = Path(__file__).resolve().parents[1]
    cfg = {
        "trace": str(root / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz"),
        "num_gpus": 4,
        "batch_size": 16,
        "parallelism": {"mode": "dp"},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    times, _, _ = iteration_times(cfg, 0.05, 3, seed=4, base_dir=tmp_path)
    code, out, err = run_cli(
        capsys,
        "train-time",
        str(path),
        "--tokens",
        "1e9",
        "--cv",
        "0.05",
        "--runs",
        "3",
        "--seed",
        "4",
    )
    assert code == 0, err
    assert f"iteration                {times.mean() * 1e3:.4f} ms" in out
    assert "P99" in out
    # --runs 0: the step with every GPU at the slowest of 4's mean factor (mode dp: the
    # compute x that factor + the rest, exactly)
    from triosim.studies.variability import slowest_factor, uniform_step

    step = uniform_step(cfg, slowest_factor(0.05, 4), tmp_path)
    code, out, err = run_cli(
        capsys, "train-time", str(path), "--tokens", "1e9", "--cv", "0.05", "--runs", "0"
    )
    assert code == 0, err
    assert f"iteration                {step * 1e3:.4f} ms" in out
    assert step > times.min() and "slowest of 4's mean factor 1.05" in out


def test_the_wall_times_spread_is_that_of_whole_runs():
    """P10 and P90 of the wall time by the central limit theorem over the segments (one
    segment's variance in closed form) against 3,000 whole runs drawn by simulate_failures: 100 h of
    work in 1 h segments, a failure every 10 h. Each quantile within 1.5 % of the runs'
    (their sampling error about 0.5 %), the P10-P90 width within 10 % of theirs (7.3 h of
    118.6), the interval around Daly's mean, and narrower for
    a 10x longer run relative to its mean (sqrt(n))."""
    from triosim.studies.train_time import wall_time_interval

    args = (100 * H, H, 0.1 * H, 0.2 * H, 10 * H)
    runs = simulate_failures(*args, runs=3000, seed=3)
    lo, hi = wall_time_interval(*args)
    assert lo == pytest.approx(np.quantile(runs, 0.1), rel=0.015)
    assert hi == pytest.approx(np.quantile(runs, 0.9), rel=0.015)
    assert lo < expected_time(*args) < hi
    width = np.quantile(runs, 0.9) - np.quantile(runs, 0.1)
    assert hi - lo == pytest.approx(width, rel=0.1)  # the spread itself, not just the place
    long = (1000 * H, *args[1:])
    lo10, hi10 = wall_time_interval(*long)
    assert (hi10 - lo10) / expected_time(*long) < 0.5 * (hi - lo) / expected_time(*args)
    assert wall_time_interval(*args[:4], math.inf) == (expected_time(*args[:4], math.inf),) * 2


def test_a_segments_moments_in_closed_form():
    """One segment (1.1 h of work and checkpoint, 12-min restarts, a failure every 10 h):
    the mean is Daly's term M e^(R/M) (e^(L/M) - 1); mean and variance against 100,000
    seeded segments of the process (within 4 standard errors; the variance within 3 %).
    A segment far longer than the MTBF gives a (huge) finite answer at once: the interval
    does not hang where retries almost never succeed."""
    from triosim.studies.train_time import segment_moments, wall_time_interval

    L, R, M = 1.1 * H, 0.2 * H, 10 * H
    mean, var = segment_moments(L, R, M)
    assert mean == pytest.approx(M * math.exp(R / M) * math.expm1(L / M), rel=1e-12)
    rng = np.random.default_rng(4)
    t = np.zeros(100_000)
    pending = np.zeros(len(t))
    left = np.arange(len(t))
    while len(left):
        fail = rng.exponential(M, len(left))
        ok = fail >= pending[left] + L
        t[left[ok]] += pending[left[ok]] + L
        bad = left[~ok]
        t[bad] += fail[~ok]
        pending[bad] = R
        left = bad
    assert abs(t.mean() - mean) < 4 * t.std() / math.sqrt(len(t))
    assert t.var() == pytest.approx(var, rel=0.03)
    lo, hi = wall_time_interval(1000 * H, 100 * H, 10.0, 600.0, 3 * H)
    assert math.isfinite(lo) and lo < hi


def test_a_runs_times_take_hours_and_days_without_a_warning(capsys, recwarn):
    """A training run's times are minutes to years: `--mtbf-gpu 100d`, `--restart 20min`,
    `--checkpoint-interval 1h` read in those units (86,400, 60 and 3,600 s) and no
    plausibility warning (the generic time range, 1 ns to 100 ms, is a network's);
    `--seed` with `--runs 0` refused (nothing is drawn)."""
    from tests.conftest import run_cli
    from triosim.common.units import parse

    assert parse("100d", "seconds", "x") == 100 * 86400.0
    assert parse("20min", "seconds", "x") == 1200.0 and parse("1h", "seconds", "x") == 3600.0
    example = Path(__file__).resolve().parents[1] / "examples" / "titan_llama8b_fsdp.yaml"
    code, out, err = run_cli(
        capsys,
        "train-time",
        str(example),
        "--tokens",
        "1T",
        "--mtbf-gpu",
        "100d",
        "--restart",
        "20min",
        "--checkpoint-interval",
        "1h",
    )
    assert code == 0, err
    assert "restart                  20.0 min" in out and "warning" not in err
    assert not [w for w in recwarn if "far above" in str(w.message)]
    code, _, err = run_cli(
        capsys,
        "train-time",
        str(example),
        "--tokens",
        "1T",
        "--cv",
        "0.1",
        "--runs",
        "0",
        "--seed",
        "3",
    )
    assert code == 2 and "--seed 3: only with seeded runs" in err
