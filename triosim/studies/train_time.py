"""The time to train: one simulated iteration x the steps a token budget needs, with the
failures, checkpoints and restarts of a large run (`triosim train-time`).

Inputs (each a field of `TrainTimeOptions`, its default's source in its help):
  - the iteration time t and the tokens per step (global batch x sequence) of a simulated
    config: steps S = tokens / tokens per step, failure-free work W = S x t;
  - failures, exponential (a memoryless rate), a mean time between failures per component:
    per GPU, per node (its host, software, NICs, storage) and per link into the network
    (one a GPU where the run spans nodes): the run fails at rate lambda = GPUs / mtbf_gpu +
    nodes / mtbf_node + links / mtbf_link (system MTBF M = 1 / lambda);
  - a checkpoint every tau seconds of work, written in delta = state bytes / storage
    bandwidth (the state: weights and optimizer states every GPU holds, from the memory
    model), the training stopped while it is written;
  - a restart R after each failure (rescheduling, loading the checkpoint), then the work
    since the last checkpoint again.

Expected wall time (Daly 2006, "A higher order estimate of the optimum checkpoint interval
for restart dumps", eq. 13, exponential failures, failures during restarts and
checkpoints included): T(tau) = M e^(R/M) (e^((tau + delta)/M) - 1) W / tau. Goodput is W /
T. The interval minimising T is found numerically; Young's first-order optimum sqrt(2
delta M) (Young 1974) is printed beside it as the check (they agree while delta << M).
`simulate_failures` draws the same process (seeded) for the Monte Carlo check of T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from triosim.common.schema import option

DAY = 86400.0
# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4, Table 5): 419
# unexpected interruptions in 54 days of pre-training on 16,384 H100s (2,048 hosts of 8):
# 246 GPU issues (the paper's 58.7 % of them; faulty GPUs 148 and HBM3 72 the largest),
# 35 (8.4 %) network switches and cables, the other 138 software, hosts, NICs and storage
LLAMA3_GPUS, LLAMA3_NODES, LLAMA3_DAYS = 16384, 2048, 54
LLAMA3_MTBF_GPU = LLAMA3_GPUS * LLAMA3_DAYS * DAY / 246
LLAMA3_MTBF_NODE = LLAMA3_NODES * LLAMA3_DAYS * DAY / 138
LLAMA3_MTBF_LINK = LLAMA3_GPUS * LLAMA3_DAYS * DAY / 35  # a GPU's one NIC link there
GPUS_PER_NODE = 8  # where the topology names no nodes
# the same paper (section 3.3.1): Tectonic, Meta's storage for checkpoints, sustains 2 TB/s
LLAMA3_STORAGE = 2e12


@dataclass(frozen=True)
class TrainTimeOptions:
    tokens: float = option(gt=0, help="tokens to train on")
    mtbf_gpu: float = option(
        LLAMA3_MTBF_GPU,
        unit="seconds",
        plausible="duration",
        gt=0,
        help="mean time between GPU failures per GPU (default: Llama 3's 246 GPU issues in 54 "
        "days on 16,384 H100s, 3,596.5 GPU-days)",
    )
    mtbf_node: float = option(
        LLAMA3_MTBF_NODE,
        unit="seconds",
        plausible="duration",
        gt=0,
        help="mean time between other failures per node: host, software, NICs, storage "
        "(default: Llama 3's other 138 interruptions on 2,048 hosts, 801.4 node-days)",
    )
    mtbf_link: float = option(
        LLAMA3_MTBF_LINK,
        unit="seconds",
        plausible="duration",
        gt=0,
        help="mean time between failures per link into the network, a GPU's where the run "
        "spans nodes (default: Llama 3's 35 switch and cable failures on 16,384 GPUs' "
        "links, 25,278.2 link-days)",
    )
    storage_bandwidth: float = option(
        LLAMA3_STORAGE,
        unit="bandwidth",
        gt=0,
        help="checkpoint write bandwidth of the whole run (default: Llama 3's Tectonic, 2 TB/s "
        "sustained)",
    )
    restart: float = option(
        600.0,
        unit="seconds",
        plausible="duration",
        ge=0,
        help="from a failure to training again: rescheduling, loading the checkpoint "
        "(default: 10 minutes, an assumption: no published number for Llama 3)",
    )
    checkpoint_interval: float | None = option(
        None,
        unit="seconds",
        plausible="duration",
        gt=0,
        help="seconds of training between checkpoints (default: the best)",
    )


def expected_time(work: float, tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Daly's expected wall time of `work` seconds of training (module docstring); `mtbf`
    inf: no failures, work plus the checkpoints."""
    if math.isinf(mtbf):
        return work * (tau + delta) / tau
    M = mtbf
    return M * math.exp(restart / M) * math.expm1((tau + delta) / M) * work / tau


def best_interval(work: float, delta: float, restart: float, mtbf: float) -> float:
    """The checkpoint interval minimising `expected_time` (bounded search on a log scale)."""
    from scipy.optimize import minimize_scalar

    if math.isinf(mtbf):
        return work
    young = young_interval(delta, mtbf)
    lo, hi = math.log(young / 100), math.log(min(work, young * 100))
    res = minimize_scalar(
        lambda x: expected_time(work, math.exp(x), delta, restart, mtbf),
        bounds=(lo, max(hi, lo + 1e-9)),
        method="bounded",
        options={"xatol": 1e-9},
    )
    return math.exp(res.x)


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum: sqrt(2 x checkpoint time x MTBF)."""
    return math.sqrt(2 * delta * mtbf)


def simulate_failures(
    work: float, tau: float, delta: float, restart: float, mtbf: float, runs: int, seed: int
) -> np.ndarray:
    """Wall times of `runs` seeded draws of the process Daly's formula averages: segments of
    tau seconds of work each followed by a delta-second checkpoint (the last segment the
    work left, then its checkpoint), exponential failures at rate 1 / mtbf at any time (in
    a restart too); a failure loses the segment in progress and costs a restart."""
    rng = np.random.default_rng(seed)
    out = np.empty(runs)
    full, last = divmod(work, tau)
    segments = [tau] * int(full) + ([last] if last > 1e-12 * tau else [])
    for k in range(runs):
        t = 0.0
        pending = 0.0  # a restart to go through before the next segment
        for seg in segments:
            need = seg + delta
            while True:
                fail = rng.exponential(mtbf)
                if fail >= pending + need:
                    t += pending + need
                    pending = 0.0
                    break
                t += fail
                pending = restart  # lost: restart, then the segment again
        out[k] = t
    return out


def segment_moments(length: float, restart: float, mtbf: float) -> tuple[float, float]:
    """(mean, variance) of the time to get one segment of `length` seconds (work and its
    checkpoint) done, failures exponential at rate 1/mtbf at any time and a restart before
    each retry (the process `simulate_failures` draws), in closed form: the first attempt
    succeeds with probability p = e^(-L/M), else it fails at X < L and a retry of R + L
    (a task restarted from scratch until done: mean M (e^(a/M) - 1), variance M^2 (e^(2a/M)
    - 1 - 2 (a/M) e^(a/M))) follows. The mean is Daly's segment term, M e^(R/M)
    (e^(L/M) - 1)."""
    M, L, a = mtbf, length, restart + length
    x = L / M
    p = math.exp(-x)
    mean_r = M * math.expm1(a / M)
    var_r = M * M * (math.expm1(2 * a / M) - 2 * (a / M) * math.exp(a / M))
    fail_x = M * (1 - p * (1 + x))  # (1 - p) E[X | X < L]
    fail_x2 = 2 * M * M * (1 - p * (1 + x + x * x / 2))  # (1 - p) E[X^2 | X < L]
    mean = p * L + fail_x + (1 - p) * mean_r
    second = p * L * L + fail_x2 + 2 * fail_x * mean_r + (1 - p) * (var_r + mean_r**2)
    return mean, max(second - mean * mean, 0.0)


def wall_time_interval(
    work: float,
    tau: float,
    delta: float,
    restart: float,
    mtbf: float,
    q: tuple = (0.1, 0.9),
) -> tuple[float, float]:
    """The q-quantiles of the wall time (the failures' spread): a run is its segments'
    times added, independent and alike, so for many segments their sum is nearly normal
    (the central limit theorem), around Daly's mean with work / tau times one segment's
    variance (`segment_moments`; Daly counts the segments the same way). Checked against
    whole runs drawn by `simulate_failures`."""
    from scipy import stats

    mean = expected_time(work, tau, delta, restart, mtbf)
    if math.isinf(mtbf) or math.isinf(mean):
        return mean, mean
    _, var = segment_moments(tau + delta, restart, mtbf)
    sd = math.sqrt(work / tau * var)
    lo, hi = (mean + float(stats.norm.ppf(x)) * sd for x in q)
    return lo, hi


@dataclass
class TrainTime:
    """What `estimate` gives (seconds unless said)."""

    iteration: float
    steps: float
    work: float  # failure-free training time, no checkpoints
    gpus: int
    state_bytes: float  # what a checkpoint writes
    checkpoint_write: float  # delta
    mtbf: float  # the run's (system) MTBF
    nodes: int
    links: int
    interval: float  # checkpoint interval used
    best: float  # the interval minimising the expected time
    young: float
    expected: float  # expected wall time with failures, at `interval`
    no_failures: float  # wall time without failures (checkpoints included)
    spread: tuple = (math.nan, math.nan)  # P10, P90 of the wall time (failures' spread)

    @property
    def goodput(self) -> float:
        return self.work / self.expected


def run_mtbf(o: TrainTimeOptions, gpus: int, nodes: int, links: int) -> float:
    """The run's mean time between failures: its components' rates add."""
    return 1.0 / (gpus / o.mtbf_gpu + nodes / o.mtbf_node + links / o.mtbf_link)


def estimate(
    iteration: float,
    tokens_per_step: float,
    gpus: int,
    state_bytes: float,
    o: TrainTimeOptions,
    nodes: int | None = None,
) -> TrainTime:
    """The time to train `o.tokens` tokens (module docstring); `nodes`: the hosts the GPUs
    are in (default: GPUS_PER_NODE a node); a run on more than one has a link into the
    network a GPU."""
    nodes = nodes or -(-gpus // GPUS_PER_NODE)
    links = gpus if nodes > 1 else 0
    steps = o.tokens / tokens_per_step
    work = steps * iteration
    delta = state_bytes / o.storage_bandwidth
    mtbf = run_mtbf(o, gpus, nodes, links)
    best = best_interval(work, delta, o.restart, mtbf)
    tau = o.checkpoint_interval or best
    return TrainTime(
        iteration=iteration,
        steps=steps,
        work=work,
        gpus=gpus,
        state_bytes=state_bytes,
        checkpoint_write=delta,
        mtbf=mtbf,
        nodes=nodes,
        links=links,
        interval=tau,
        best=best,
        young=young_interval(delta, mtbf),
        expected=expected_time(work, tau, delta, o.restart, mtbf),
        no_failures=expected_time(work, tau, delta, o.restart, math.inf),
        spread=wall_time_interval(work, tau, delta, o.restart, mtbf),
    )
