"""Run-to-run variability and stragglers (triosim/studies/variability.py): per-GPU compute
factors, log-normal with mean 1, one draw per GPU and iteration; the step waits for the
slowest GPU, against the order statistics' closed form."""

import math
from pathlib import Path

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


def _sigma_mu(cv):
    sigma = math.sqrt(math.log1p(cv * cv))
    return sigma, -sigma * sigma / 2


def test_operator_draws_by_hand():
    """heterogeneity.op_cv: GPU k's operators x numpy's default_rng([seed, draw, 0,
    k]).lognormal(mu, sigma) in the order it runs them (mean 1: sigma^2 = ln(1 + cv^2),
    mu = -sigma^2 / 2). Mode dp by hand: the all-reduce starts when the slowest GPU's
    forward and backward end, takes its deterministic time, then each GPU's optimizer: the
    step ends with the slowest of those."""
    det = Simulation(CFG, trace=chain_trace(batch=16)).run().timeline
    mine = det[(det.gpu == 0) & (det.kind == "compute")].sort_values("start")
    d = (mine.end - mine.start).to_numpy()
    before = int((mine.phase != "optimizer").sum())
    ar = det[(det.gpu == 0) & (det.kind == "comm")]
    allreduce = float((ar.end - ar.start).sum())
    sigma, mu = _sigma_mu(0.1)
    pre, post, drawn = [], [], {}
    for k in range(4):
        x = d * np.random.default_rng([5, 2, 0, k]).lognormal(mu, sigma, len(d))
        pre.append(x[:before].sum())
        post.append(x[before:].sum())
        drawn[k] = x
    cfg = {**CFG, "seed": 5, "heterogeneity": {"op_cv": 0.1, "draw": 2}, "symmetry": "auto"}
    with pytest.warns(UserWarning, match="op_cv"):
        r = Simulation(cfg, trace=chain_trace(batch=16)).run()
    assert r.iteration_time == pytest.approx(max(pre) + allreduce + max(post), rel=1e-12)
    tl = r.timeline
    two = tl[(tl.gpu == 2) & (tl.kind == "compute")].sort_values("start")
    assert (two.end - two.start).to_numpy() == pytest.approx(drawn[2], rel=1e-12)


def test_link_jitter_is_the_same_as_those_slowdowns_given_link_by_link():
    """heterogeneity.link_cv: every link's bandwidth / (1 + |e|), e from numpy's
    default_rng([seed, draw, 1]).normal(0, cv) in the topology's edge order; the same
    factors given as heterogeneity.links (another path through the code) give the same
    iteration, slower than without."""
    cfg = {**CFG, "seed": 7, "heterogeneity": {"link_cv": 0.3, "draw": 1}}
    edges = list(Simulation(CFG, trace=chain_trace(batch=16)).graph.edges())
    e = np.random.default_rng([7, 1, 1]).normal(0.0, 0.3, len(edges))
    links = [
        {"src": a, "dst": b, "factor": 1 + abs(float(x))}
        for (a, b), x in zip(edges, e, strict=True)
    ]
    jittered = Simulation(cfg, trace=chain_trace(batch=16)).run().iteration_time
    given = {**CFG, "heterogeneity": {"links": links}}
    by_hand = Simulation(given, trace=chain_trace(batch=16)).run().iteration_time
    plain = Simulation(CFG, trace=chain_trace(batch=16)).run().iteration_time
    assert jittered == pytest.approx(by_hand, rel=1e-12) and jittered > plain


def test_operator_draws_average_out_within_a_gpu():
    """A GPU's compute is a sum of n drawn operators: its coefficient of variation is
    op_cv x sqrt(sum t^2) / sum t (independent draws of mean 1), far below op_cv; over 60
    seeded runs of mode dp (the study's draws) the GPUs' compute sums have that spread
    (within 30 %: 240 samples), and a zero op_cv is the deterministic run."""
    det = Simulation(CFG, trace=chain_trace(batch=16)).run()
    tl = det.timeline
    d = (lambda c: (c.end - c.start).to_numpy())(tl[(tl.gpu == 0) & (tl.kind == "compute")])
    want = 0.2 * math.sqrt((d**2).sum()) / d.sum()
    sums = []

    seen = []
    real = Simulation.run

    def keep(self, *a, **k):
        r = real(self, *a, **k)
        seen.append(r.timeline)
        return r

    try:
        Simulation.run = keep
        times, _, _ = iteration_times(CFG, 0.0, 60, seed=9, trace=chain_trace(batch=16), op_cv=0.2)
    finally:
        Simulation.run = real
    for t in seen:
        c = t[t.kind == "compute"]
        sums.extend((c.end - c.start).groupby(c.gpu).sum().to_numpy())
    sums = np.array(sums)
    # the mean within 4 standard errors (runs' GPUs are independent draws)
    assert abs(sums.mean() - d.sum()) < 4 * want * d.sum() / math.sqrt(len(sums))
    assert sums.std(ddof=1) / sums.mean() == pytest.approx(want, rel=0.3)
    from triosim.studies.variability import effective_cv

    assert effective_cv(0.0, 0.2, d) == pytest.approx(want, rel=1e-12)
    assert effective_cv(0.03, 0.2, d) ** 2 == pytest.approx((1.0009) * (1 + want**2) - 1)
    assert len(set(times)) == 60
    zero, _, _ = iteration_times(CFG, 0.0, 2, seed=9, trace=chain_trace(batch=16), op_cv=0.0)
    assert (zero == det.iteration_time).all()


def test_the_command_takes_operator_and_network_draws(capsys):
    from pathlib import Path

    from tests.conftest import run_cli

    example = Path(__file__).resolve().parents[1] / "examples" / "ddp.yaml"
    code, out, err = run_cli(
        capsys, "variability", str(example), "--op-cv", "0.05", "--net-cv", "0.1", "--runs", "2"
    )
    assert code == 0, err
    assert "2 runs, 4 GPUs, compute cv 0 per GPU, 0.05 per operator, links cv 0.1" in out
    # the runs are those of the study with the same draws: jitter alone never speeds a run
    from triosim.config.loading import read_yaml

    cfg = read_yaml(example)
    times, _, _ = iteration_times(cfg, 0.0, 2, 0, example.parent, op_cv=0.05, link_cv=0.1)
    (line,) = [x for x in out.splitlines() if x.startswith("iteration ms")]
    assert f"mean {times.mean() * 1e3:.4f}" in line and times[0] != times[1]
    det = Simulation(example).run().iteration_time
    jitter, _, _ = iteration_times(cfg, 0.0, 3, 0, example.parent, link_cv=0.1)
    assert (jitter >= det * (1 - 1e-12)).all() and jitter.max() > det
    code, _, err = run_cli(capsys, "variability", str(example), "--op-cv", "1.5")
    assert code == 2 and "argument --op-cv: a coefficient of variation in [0, 1), got '1.5'" in err


@pytest.mark.parametrize("field", ["op_cv", "link_cv"])
def test_a_chakra_export_refuses_draws_it_cannot_carry(field):
    from triosim.common.errors import ConfigError
    from triosim.simulation.chakra_export import workload_nodes

    sim = Simulation({**CFG, "heterogeneity": {field: 0.1}}, trace=chain_trace(batch=16))
    with pytest.raises(ConfigError, match=f"heterogeneity.{field}"):
        workload_nodes(sim)


@pytest.mark.no_cover
def test_the_step_at_scale_is_every_gpu_at_the_slowest_factor():
    """Mode dp: with every GPU x f the step is T_compute x f + the rest (by hand from the
    deterministic timeline), so the mean of seeded runs is that at the slowest factor's
    mean (linear: exact), here within 4 standard errors of 120 runs."""
    from triosim.studies.variability import uniform_step

    t, compute = deterministic()
    for f in (1.0, 1.1, 1.37):
        want = compute * f + (t - compute)
        assert uniform_step(CFG, f, trace=chain_trace(batch=16)) == pytest.approx(want, rel=1e-12)
    times, _, _ = iteration_times(CFG, 0.05, 120, seed=21, trace=chain_trace(batch=16))
    at = uniform_step(CFG, slowest_factor(0.05, 4), trace=chain_trace(batch=16))
    assert abs(times.mean() - at) < 4 * times.std(ddof=1) / math.sqrt(len(times))


def test_with_pipeline_stages_every_gpu_at_the_slowest_is_an_upper_bound():
    """1F1B over 2 stages x 2 replicas: only the slowest GPU is that slow, so each draw's
    step is at most the step with every GPU at its draw's largest factor (a slower GPU
    never makes a run faster), and more than with every GPU at its smallest."""
    from triosim.studies.variability import uniform_step

    cfg = {**CFG, "parallelism": {"mode": "3d", "pp": 2, "dp": 2, "microbatches": 4}}
    trace = chain_trace(batch=16)
    times, drawn, _ = iteration_times(cfg, 0.1, 4, seed=2, trace=trace)
    for step, f in zip(times, drawn, strict=True):
        assert uniform_step(cfg, float(f.min()), trace=trace) <= step
        assert step <= uniform_step(cfg, float(f.max()), trace=trace) * (1 + 1e-12)


def test_the_command_plots_the_step_at_scale(capsys, tmp_path):
    """--runs 0 --at: no seeded runs, the step at each count (every GPU at the slowest's
    factor); mode dp's config, so by hand T_compute x f + the rest; --plot a PNG."""
    import yaml

    from tests.conftest import run_cli
    from triosim.studies.variability import effective_cv

    trace = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz"
    cfg = {**CFG, "trace": str(trace), "batch_size": 8}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    png = tmp_path / "steps.png"
    code, out, err = run_cli(
        capsys,
        "variability",
        str(path),
        "--cv",
        "0.04",
        "--runs",
        "0",
        "--at",
        "64,4096",
        "--plot",
        str(png),
    )
    assert code == 0, err
    det = Simulation(cfg).run()
    tl = det.timeline
    mine = tl[(tl.gpu == 0) & (tl.kind == "compute")]
    compute = float((mine.end - mine.start).sum())
    assert effective_cv(0.04, 0.0, [1.0]) == pytest.approx(0.04)
    f = slowest_factor(0.04, 4096)
    want = (compute * f + det.iteration_time - compute) * 1e3
    line = next(x for x in out.splitlines() if x.startswith("step at 4,096 GPUs"))
    assert float(line.split("mean")[1].split()[0]) == pytest.approx(want, abs=1e-4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out
    code, _, err = run_cli(capsys, "variability", str(path), "--runs", "0")
    assert code == 2 and "--runs 0 without --at" in err


def test_each_runs_slowest_gpu_is_the_one_with_the_largest_draw(capsys):
    """Mode dp with per-GPU draws: a run's GPU with the most compute is the one drawn
    slowest (the others wait for it at the all-reduce), and the command names the GPUs
    most often slowest."""
    slowest: list = []
    _, drawn, gpus = iteration_times(
        CFG, 0.05, 6, seed=3, trace=chain_trace(batch=16), slowest=slowest
    )
    assert slowest == [gpus[int(np.argmax(row))] for row in drawn]
    from tests.conftest import run_cli

    example = Path(__file__).resolve().parents[1] / "examples" / "ddp.yaml"
    code, out, err = run_cli(capsys, "variability", str(example), "--cv", "0.03", "--runs", "4")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("slowest GPUs (most compute)"))
    from collections import Counter

    from triosim.config.loading import read_yaml

    again: list = []
    iteration_times(read_yaml(example), 0.03, 4, 0, example.parent, slowest=again)
    want = ", ".join(f"GPU {g} in {n} of 4 runs" for g, n in Counter(again).most_common(3))
    assert line.endswith(want)


def test_a_draw_of_nothing_is_refused():
    from triosim.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"heterogeneity\.draw.*nothing is drawn"):
        Simulation({**CFG, "heterogeneity": {"draw": 3}}, trace=chain_trace(batch=16))


def test_a_configs_own_draws_are_kept_and_drawn_per_run():
    """The review's cases: the config's link_cv stays when --op-cv is given (it was
    overwritten by the flag's 0); the config's own op_cv draws anew in every run (each
    reused draw 0); the config's persistent random slow-downs stay what its seed made them
    (the seed was shifted, so they were redrawn)."""
    t = chain_trace(batch=16)
    with_link = {**CFG, "heterogeneity": {"link_cv": 0.5}}
    a, _, _ = iteration_times(CFG, 0.0, 3, seed=1, trace=t, op_cv=0.05)
    b, _, _ = iteration_times(with_link, 0.0, 3, seed=1, trace=t, op_cv=0.05)
    assert (b > a).all()  # the jittered links (never faster) are still there
    own = {**CFG, "heterogeneity": {"op_cv": 0.1}}
    c, _, _ = iteration_times(own, 0.0, 4, seed=0, trace=t)
    assert len(set(c)) == 4
    slowed = {**CFG, "heterogeneity": {"random": [{"target": "compute", "low": 1, "high": 3}]}}
    fixed = Simulation(slowed, trace=t).run().iteration_time
    d, _, _ = iteration_times(slowed, 0.0, 2, seed=5, trace=t, op_cv=1e-9)
    assert d == pytest.approx([fixed, fixed], rel=1e-6)


def test_the_slowest_of_n_counts_the_operator_draws_and_one_iteration(capsys, tmp_path):
    """With --op-cv the 'slowest of N' lines use a GPU's effective cv (they said factor
    1.0000 while the step at scale used 1.03); that cv is a step's, the same with
    iterations: 4 as with 1; --net-cv with --runs 0 is refused (no jitter in the step at
    scale)."""
    import yaml

    from tests.conftest import run_cli

    example = Path(__file__).resolve().parents[1] / "examples" / "dp.yaml"
    code, out, err = run_cli(
        capsys, "variability", str(example), "--op-cv", "0.1", "--runs", "2", "--at", "64"
    )
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("slowest of 64 GPUs")]
    assert float(line.split("mean")[1].split()[0]) > 1.01

    def cv_of(iterations):
        cfg = yaml.safe_load(example.read_text())
        cfg["iterations"] = iterations
        cfg["trace"] = str(example.parent / cfg["trace"])
        path = tmp_path / f"i{iterations}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        code, out, err = run_cli(
            capsys, "variability", str(path), "--op-cv", "0.1", "--runs", "0", "--at", "64"
        )
        assert code == 0, err
        return next(x for x in out.splitlines() if "compute cv" in x).split("compute cv")[1]

    assert cv_of(1) == cv_of(4)
    code, _, err = run_cli(
        capsys, "variability", str(example), "--net-cv", "0.1", "--runs", "0", "--at", "64"
    )
    assert code == 2 and "--net-cv 0.1: only with seeded runs" in err
