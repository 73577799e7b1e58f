"""Run-to-run variability and stragglers: each GPU's compute in an iteration takes its
deterministic time x a factor drawn per GPU and iteration, log-normal with mean 1 and a
coefficient of variation `cv` (the shared H100 timings vary 0.2-8 % from run to run); a
synchronous step waits for its slowest GPU.

`iteration_times(config, cv, runs, seed)`: `runs` seeded simulations of the config, each
with its GPUs' compute slowed by one draw per GPU (the config's heterogeneity.compute; the
network as it is): the iteration time's distribution. Zero cv is the deterministic run.

`slowest_factor(cv, n)` and `slowest_quantile(cv, n, q)`: the slowest of n GPUs' factors
by order statistics, no simulation: F_max(x) = F(x)^n, so its q-quantile is
exp(mu + sigma x Phi^-1(q^(1/n))) and its mean the integral of 1 - F(x)^n (sigma^2 =
ln(1 + cv^2), mu = -sigma^2 / 2). Where the iteration is compute then a collective that
waits for every GPU (mode dp: the step is T_compute x the slowest factor + the rest),
that is the step's distribution at any scale: at 16,384 GPUs as at 4.

The step at a scale not simulated (`uniform_step`): the config's iteration with every
GPU's compute x the slowest-of-N factor. Exact where compute ends in a collective every GPU
waits for (mode dp: T_compute x f + the rest); elsewhere an upper bound, since only the
slowest GPU is that slow: with pipeline stages, the slow stage's neighbours are not, so
the fill and drain cost less than with every stage slowed (tested against seeded runs).
Per-operator draws (`op_cv`) add to a GPU's factor as `effective_cv` says.

Persistent stragglers (`slow`: a fraction of the GPUs, chosen once from the seed, slower by
`slow_factor` >= 1 in every iteration: a throttled or degraded GPU, a slow node): a GPU's
factor is its draw x slow_factor where it is slow. With k = round(slow x n) slow GPUs the
slowest of n has F_max(x) = F(x)^(n - k) F(x / s)^k: once one GPU is slow, every step
waits for it and grows by about s.
"""

from __future__ import annotations

import copy
import math

import numpy as np
from scipy import integrate, optimize, stats

from triosim.config.heterogeneity import lognormal


def factors(
    cv: float, n: int, runs: int, seed: int, slow: float = 0.0, slow_factor: float = 1.0
) -> np.ndarray:
    """(runs, n) compute factors: one per GPU and run, seeded; round(slow x n) GPUs (the
    same in every run, chosen from the seed) x slow_factor."""
    rng = np.random.default_rng(seed)
    out = np.ones((runs, n))
    if cv > 0:
        mu, sigma = lognormal(cv)
        out = rng.lognormal(mu, sigma, size=(runs, n))
    k = round(slow * n)
    if k and slow_factor != 1.0:
        out[:, rng.choice(n, size=k, replace=False)] *= slow_factor
    return out


def _max_cdf(cv: float, n: int, slow: float, slow_factor: float):
    """x -> P(the largest of n factors <= x): n - k draws and k = round(slow x n) draws x
    slow_factor (module docstring)."""
    mu, sigma = lognormal(cv)
    base = stats.lognorm(s=sigma, scale=math.exp(mu)).cdf
    k = round(slow * n)
    return lambda x: base(x) ** (n - k) * base(x / slow_factor) ** k


def _plain(cv, n, slow, slow_factor) -> bool:
    return round(slow * n) == 0 or slow_factor == 1.0


def slowest_quantile(
    cv: float, n: int, q: float, slow: float = 0.0, slow_factor: float = 1.0
) -> float:
    """The q-quantile of the largest of n independent factors."""
    if _plain(cv, n, slow, slow_factor):
        if cv == 0:
            return 1.0
        mu, sigma = lognormal(cv)
        return math.exp(mu + sigma * stats.norm.ppf(q ** (1.0 / n)))
    if cv == 0:  # a slow GPU is always among them
        return slow_factor
    cdf = _max_cdf(cv, n, slow, slow_factor)
    return float(optimize.brentq(lambda x: cdf(x) - q, 1e-9, 10.0 * slow_factor))


def slowest_factor(cv: float, n: int, slow: float = 0.0, slow_factor: float = 1.0) -> float:
    """The mean of the largest of n independent factors: the integral of 1 - F_max."""
    plain = _plain(cv, n, slow, slow_factor)
    if cv == 0:
        return 1.0 if plain else slow_factor
    mu, sigma = lognormal(cv)
    dist = stats.lognorm(s=sigma, scale=math.exp(mu))
    hi = dist.ppf(1 - 1e-12 / max(n, 1))
    if plain:
        value, _ = integrate.quad(lambda x: 1 - dist.cdf(x) ** n, 0, hi, limit=200)
        return value
    cdf = _max_cdf(cv, n, slow, slow_factor)
    value, _ = integrate.quad(lambda x: 1 - cdf(x), 0, hi * slow_factor, limit=200)
    return value


# draws a seed of `iteration_times` may take: run k of seed s is draw s x DRAWS + k
DRAWS = 1 << 20


def effective_cv(cv: float, op_cv: float, durations) -> float:
    """The coefficient of variation of a GPU's compute factor: its own draw (cv) times the
    mean of its operators' draws weighted by their times, whose cv is op_cv x sqrt(sum
    t^2) / sum t (independent draws of mean 1); the two independent factors' product has
    (1 + cv^2)(1 + cv_op^2) - 1 for its squared cv. Taken as log-normal for the order
    statistics (the sum of many operators' draws is nearly normal, and its cv small)."""
    d = np.asarray(durations, dtype=float)
    within = op_cv * math.sqrt(float((d * d).sum())) / float(d.sum()) if d.sum() > 0 else 0.0
    return math.sqrt((1 + cv * cv) * (1 + within * within) - 1)


def uniform_step(config: dict, factor: float, base_dir=".", trace=None) -> float:
    """The config's iteration with every GPU's compute `factor` x slower (on top of its own
    fixed slow-downs; without its draws, op_cv and link_cv): the step when the slowest
    GPU's factor holds everyone back. Every GPU alike, so a symmetric config stays
    symmetric."""
    return step_run(config, factor, base_dir, trace).iteration_time


def step_run(config: dict, factor: float = 1.0, base_dir=".", trace=None):
    """The Result of `uniform_step`'s run (factor 1: the config without its draws)."""
    cfg = without_draws(config)
    het = cfg["heterogeneity"]
    if factor != 1.0:  # every GPU x factor: a "draw" from [factor, factor], so that no
        # GPU list is needed (building the plan once more only to learn it costs minutes)
        het["random"] = [
            *(het.get("random") or []),
            {"target": "compute", "low": factor, "high": factor},
        ]
    return _simulation(cfg, base_dir, trace).run()


def without_draws(config: dict) -> dict:
    """A copy of the config without its draws (heterogeneity op_cv, link_cv, draw): the
    deterministic step that every draw varies."""
    cfg = copy.deepcopy(config)
    het = dict(cfg.get("heterogeneity") or {})
    for name in ("op_cv", "link_cv", "draw"):
        het.pop(name, None)
    cfg["heterogeneity"] = het
    return cfg


def draws_of(config: dict, op_cv: float = 0.0, link_cv: float = 0.0) -> tuple[float, float]:
    """(op_cv, link_cv) a run draws: the given ones, else the config's own."""
    own = config.get("heterogeneity") or {}
    return op_cv or own.get("op_cv") or 0.0, link_cv or own.get("link_cv") or 0.0


def _simulation(config: dict, base_dir, trace):
    """The Simulation of a config mapping: a Python caller's trace object, or the config's
    own trace file (relative to base_dir)."""
    from triosim.config.loading import from_dict
    from triosim.simulation.wiring import Simulation

    return Simulation(
        config if trace is not None else from_dict(config, base_dir=base_dir), trace=trace
    )


def iteration_times(
    config: dict,
    cv: float,
    runs: int,
    seed: int,
    base_dir=".",
    trace=None,
    slow: float = 0.0,
    slow_factor: float = 1.0,
    op_cv: float = 0.0,
    link_cv: float = 0.0,
    slowest: list | None = None,
):
    """(iteration times of `runs` seeded draws, the compute factors drawn, GPU ids); a list
    given as `slowest` gets each run's GPU with the most compute time (the one the others
    wait for where compute ends in a collective). Run k of seed s draws every operator's
    time and every link's bandwidth where op_cv / link_cv (the arguments, else the config's
    heterogeneity.op_cv / link_cv) are set, as draw s x DRAWS + k of the config's seed (the
    config's seed and its other random slow-downs stay as they are)."""
    first = _simulation(config, base_dir, trace)
    gpus = list(first.gpus)
    drawn = factors(cv, len(gpus), runs, seed, slow, slow_factor)
    op_cv, link_cv = draws_of(config, op_cv, link_cv)
    if runs > DRAWS:
        raise ValueError(f"at most {DRAWS} runs a seed, got {runs}")
    out = np.empty(runs)
    for k in range(runs):
        cfg = copy.deepcopy(config)
        het = cfg.setdefault("heterogeneity", {}) or {}
        cfg["heterogeneity"] = het
        compute = dict(het.get("compute") or {})
        for g, f in zip(gpus, drawn[k], strict=True):
            compute[g] = compute.get(g, 1.0) * float(f)
        het["compute"] = compute
        if op_cv or link_cv:
            het.update(op_cv=op_cv, link_cv=link_cv, draw=seed * DRAWS + k)
        cfg["symmetry"] = "off"  # the GPUs differ now
        result = _simulation(cfg, base_dir, trace).run()
        out[k] = result.iteration_time
        if slowest is not None:
            slowest.append(result.per_gpu()["compute"].idxmax())
    return out, drawn, gpus
