"""Run-to-run variability and stragglers (triosim/studies/variability.py): per-GPU compute
factors, log-normal with mean 1, one draw per GPU and iteration; the step waits for the
slowest GPU, against the order statistics' closed form."""

import math

import numpy as np
import pytest

from tests.conftest import chain_trace
from triosim.simulation.wiring import Simulation
from triosim.studies.variability import (
    factors,
    iteration_times,
    slowest_factor,
    slowest_quantile,
)

CFG = {
    "num_gpus": 4,
    "batch_size": 16,
    "parallelism": {"mode": "dp"},
    "topology": {"kind": "ring", "bandwidth": "10 GB/s", "latency": "1 us"},
    "communication": {"kind": "textbook"},
}


def deterministic():
    r = Simulation(CFG, trace=chain_trace(batch=16)).run()
    tl = r.timeline
    compute = tl[(tl.gpu == 0) & (tl.kind == "compute")]
    return r.iteration_time, float((compute.end - compute.start).sum())


def test_zero_variability_is_the_deterministic_run_exactly():
    t, _ = deterministic()
    times, drawn, _ = iteration_times(CFG, 0.0, 3, seed=1, trace=chain_trace(batch=16))
    assert (drawn == 1).all() and (times == t).all()


def test_each_draw_is_the_slowest_gpus_compute_plus_the_rest_by_hand():
    """Mode dp: forward and backward, one all-reduce that waits for every GPU, then the
    optimizer: the step is T_compute x the slowest GPU's factor + the all-reduce (every
    GPU's optimizer step after the same all-reduce: the slowest ends last)."""
    t, compute = deterministic()
    times, drawn, _ = iteration_times(CFG, 0.05, 6, seed=3, trace=chain_trace(batch=16))
    want = compute * drawn.max(axis=1) + (t - compute)
    assert times == pytest.approx(want, rel=1e-9)
    again, _, _ = iteration_times(CFG, 0.05, 6, seed=3, trace=chain_trace(batch=16))
    assert np.array_equal(times, again)  # the same seed, the same numbers
    assert np.percentile(times, 99) >= np.percentile(times, 50)


@pytest.mark.parametrize("cv, n", [(0.02, 4), (0.05, 64), (0.08, 16384)])
def test_the_slowest_factor_is_the_order_statistic(cv, n):
    """The closed forms against 4,000 seeded draws of n factors: the mean of the largest
    within 4 standard errors, its median and 90th percentile within 1 %; the mean of one
    factor is 1; the slowest of more GPUs is slower."""
    runs = 4000 if n < 1000 else 400
    big = factors(cv, n, runs, seed=11).max(axis=1)
    se = big.std(ddof=1) / math.sqrt(runs)
    assert abs(big.mean() - slowest_factor(cv, n)) < 4 * se
    for q in (0.5, 0.9):
        assert np.quantile(big, q) == pytest.approx(slowest_quantile(cv, n, q), rel=0.01)
    assert factors(cv, 1, 20000, seed=2).mean() == pytest.approx(1.0, abs=4 * cv / math.sqrt(20000))
    assert slowest_factor(cv, 2 * n) > slowest_factor(cv, n) > 1
    assert slowest_quantile(cv, n, 0.99) >= slowest_quantile(cv, n, 0.5)


def test_the_command_prints_percentiles_and_the_slowest_at_scale(capsys):
    from pathlib import Path

    from tests.conftest import run_cli

    example = Path(__file__).resolve().parents[1] / "examples" / "ddp.yaml"
    code, out, err = run_cli(
        capsys, "variability", str(example), "--cv", "0.03", "--runs", "3", "--at", "16384"
    )
    assert code == 0, err
    assert "3 runs, 4 GPUs" in out and "P99" in out
    assert f"slowest of 16,384 GPUs    factor mean {slowest_factor(0.03, 16384):.4f}" in out
    code, _, err = run_cli(capsys, "variability", str(example), "--cv", "2")
    assert code == 2 and "--cv: a coefficient of variation in [0, 1), got '2'" in err


def test_persistent_stragglers_by_hand_and_by_order_statistics():
    """A fraction of GPUs slower in every iteration: on 4 GPUs with no variability and one
    GPU 1.5x slower (slow 0.25), every step of mode dp is compute x 1.5 + the all-reduce,
    the same slow GPU in every run; with variability, the slowest of n (k = round(slow x n)
    slow draws) against seeded draws: F_max(x) = F(x)^(n-k) F(x/s)^k."""
    t, compute = deterministic()
    times, drawn, _ = iteration_times(
        CFG, 0.0, 3, seed=4, trace=chain_trace(batch=16), slow=0.25, slow_factor=1.5
    )
    assert times == pytest.approx([compute * 1.5 + (t - compute)] * 3, rel=1e-9)
    assert (drawn == 1.5).sum(axis=1).tolist() == [1, 1, 1]
    assert len({tuple(row) for row in drawn}) == 1  # the same GPU every run
    assert slowest_factor(0.0, 4, 0.25, 1.5) == slowest_quantile(0.0, 4, 0.5, 0.25, 1.5) == 1.5
    cv, n, slow, s = 0.03, 1024, 0.002, 1.2
    big = factors(cv, n, 20000, seed=7, slow=slow, slow_factor=s).max(axis=1)
    se = big.std(ddof=1) / math.sqrt(len(big))
    assert abs(big.mean() - slowest_factor(cv, n, slow, s)) < 4 * se
    for q in (0.5, 0.9, 0.99):
        assert np.quantile(big, q) == pytest.approx(slowest_quantile(cv, n, q, slow, s), rel=0.01)
    assert slowest_factor(cv, n, slow, s) > s > slowest_factor(cv, n)  # they set the step
