"""Heterogeneous systems for every mode: slower GPUs, slower links, and random draws of either.

    heterogeneity:
      compute: {3: 2.0}            # GPU 3 computes 2x slower
      bandwidth: {0: 4.0}          # every link to or from GPU 0 is 4x slower
      links: [{src: 0, dst: 1, factor: 3}]   # one link (one direction unless both)
      random:                      # the paper's Hop study: each GPU's bandwidth slowed by a
        - {target: bandwidth, low: 1, high: 10}   # factor drawn uniformly in [1, 10]
      op_cv: 0.05                  # every operator on every GPU x a log-normal draw
      link_cv: 0.1                 # every link's bandwidth / (1 + |a normal draw|)

Factors divide speeds (a factor of 2 halves a bandwidth and doubles a compute time); a link
between two slowed GPUs runs at the slower end's rate. Random draws use the config's seed
(or their own), one draw per GPU in GPU order, so a run is reproducible.

Run-to-run variability (`triosim variability` sets `draw` to the run's number):
- `op_cv`: each operator's GPU time on each GPU x a factor drawn per GPU and operator,
  log-normal with mean 1 and coefficient of variation op_cv (kernels vary from run to
  run); GPU k's draws come from numpy's default_rng([seed, draw, 0, k]) (k its position
  in the topology), in the order its streams run its operators.
- `link_cv`: network jitter: each link's bandwidth divided by 1 + |e|, e normal with
  standard deviation link_cv, drawn per link (default_rng([seed, draw, 1]), in the
  topology's edge order): a link is never faster than its rating, and on average
  1 + link_cv x sqrt(2 / pi) slower.
Either makes every GPU different, so such a run is never symmetric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from triosim.common.errors import ConfigError
from triosim.common.schema import option


def lognormal(cv: float) -> tuple[float, float]:
    """(mu, sigma) of the log-normal with mean 1 and coefficient of variation cv: sigma^2 =
    ln(1 + cv^2), mu = -sigma^2 / 2 (op_cv's draws here, triosim variability's per GPU)."""
    sigma = math.sqrt(math.log1p(cv * cv))
    return -sigma * sigma / 2, sigma


@dataclass(frozen=True)
class LinkSlowdown:
    src: int | str = option(help="one end")
    dst: int | str = option(help="the other end")
    factor: float = option(help="bandwidth divided by this", gt=0, lt=math.inf, plausible="factor")
    both: bool = option(False, help="both directions")


@dataclass(frozen=True)
class RandomSlowdown:
    target: Literal["bandwidth", "compute"] = option("bandwidth", help="what is slowed")
    distribution: Literal["uniform", "loguniform"] = option("uniform", help="how factors are drawn")
    low: float = option(1.0, gt=0, lt=math.inf, plausible="factor", help="smallest factor")
    high: float = option(10.0, gt=0, lt=math.inf, plausible="factor", help="largest factor")
    seed: int | None = option(None, ge=0, help="seed of the draw (default: the config's seed)")
    gpus: list[int] | None = option(None, help="GPUs drawn for (default: all)")


@dataclass(frozen=True)
class Heterogeneity:
    compute: dict[int, float] = option(
        factory=dict, gt=0, lt=math.inf, plausible="factor", help="GPU -> compute slow-down factor"
    )
    bandwidth: dict[int, float] = option(
        factory=dict,
        gt=0,
        lt=math.inf,
        plausible="factor",
        help="GPU -> slow-down of every link it touches",
    )
    links: list[LinkSlowdown] = option(factory=list, help="per-link slow-downs")
    random: list[RandomSlowdown] = option(factory=list, help="random per-GPU slow-downs")
    op_cv: float = option(
        0.0,
        ge=0,
        lt=1,
        help="each operator's time on each GPU x a log-normal draw of mean 1 and this "
        "coefficient of variation (seeded; kernels' run-to-run variability)",
    )
    link_cv: float = option(
        0.0,
        ge=0,
        lt=1,
        help="network jitter: each link's bandwidth / (1 + |e|), e normal with this standard "
        "deviation, drawn per link (seeded)",
    )
    draw: int = option(
        0,
        ge=0,
        help="which draw of op_cv and link_cv for the config's seed (triosim variability "
        "takes one per run)",
    )

    def is_empty(self) -> bool:
        return not (
            self.compute
            or self.bandwidth
            or self.links
            or self.random
            or self.op_cv
            or self.link_cv
        )

    def op_noise(self, gpus, seed: int) -> dict | None:
        """GPU -> a function n -> n factors for its next n operators (module docstring), or
        None without op_cv."""
        if not self.op_cv:
            return None
        mu, sigma = lognormal(self.op_cv)

        def draws(rng):
            return lambda n: rng.lognormal(mu, sigma, n)

        key = [seed, self.draw]
        return {g: draws(np.random.default_rng([*key, 0, k])) for k, g in enumerate(gpus)}

    def jittered(self, graph, seed: int):
        """A copy of the topology with every link's bandwidth / (1 + |N(0, link_cv)|)."""
        g = graph.copy()
        edges = list(g.edges(data=True))
        rng = np.random.default_rng([seed, self.draw, 1])  # apart from the GPUs' [.., 0, k]
        for (_, _, d), e in zip(edges, rng.normal(0.0, self.link_cv, len(edges)), strict=True):
            d["bandwidth"] = d["bandwidth"] / (1.0 + abs(float(e)))
        return g

    def factors(self, gpus, seed: int) -> tuple[dict, dict]:
        """(compute factor per GPU, bandwidth factor per GPU), random draws included."""
        compute = dict.fromkeys(gpus, 1.0)
        bandwidth = dict.fromkeys(gpus, 1.0)
        for name, given, out in (
            ("compute", self.compute, compute),
            ("bandwidth", self.bandwidth, bandwidth),
        ):
            for g, f in given.items():
                if g not in out:
                    raise ConfigError(f"heterogeneity.{name}[{g!r}]", f, "a GPU of the topology")
                out[g] *= f
        for k, r in enumerate(self.random):
            if r.high < r.low:
                raise ConfigError(f"heterogeneity.random[{k}].high", r.high, f">= low ({r.low})")
            who = list(gpus) if r.gpus is None else r.gpus
            for g in who:
                if g not in compute:
                    raise ConfigError(f"heterogeneity.random[{k}].gpus", g, "GPUs of the topology")
            rng = np.random.default_rng(seed if r.seed is None else r.seed)
            u = rng.random(len(who))
            if r.distribution == "uniform":
                draws = r.low + u * (r.high - r.low)
            else:
                draws = np.exp(np.log(r.low) + u * (np.log(r.high) - np.log(r.low)))
            out = compute if r.target == "compute" else bandwidth
            for g, f in zip(who, draws, strict=True):
                out[g] *= float(f)
        return compute, bandwidth

    def apply_to_graph(self, graph, bandwidth_factors: dict):
        """A copy of the topology with slowed links (GPU factors, then per-link ones)."""
        g = graph.copy()
        for u, v, d in g.edges(data=True):
            f = max(bandwidth_factors.get(u, 1.0), bandwidth_factors.get(v, 1.0))
            d["bandwidth"] = d["bandwidth"] / f
        for k, link in enumerate(self.links):
            pairs = [(link.src, link.dst)] + ([(link.dst, link.src)] if link.both else [])
            for a, b in pairs:
                if not g.has_edge(a, b):
                    raise ConfigError(
                        f"heterogeneity.links[{k}]", {"src": a, "dst": b}, "a link of the topology"
                    )
                g.edges[a, b]["bandwidth"] /= link.factor
        return g
