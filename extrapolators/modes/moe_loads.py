"""Expert loads for expert parallelism: each expert's share of the routed tokens, the
tokens each expert keeps, and the bytes each GPU of an EP group sends each other.

Pure functions of numbers (no trace, no simulation), so that the expert plan
(mesh/experts.py) and its tests share one arithmetic:

- `expert_shares`: the shares p_e (sum 1, each at most 1/top_k: a token picks an expert
  once, so an expert gets at most every token) for `uniform`, `skew` (Zipf over a seeded
  random order of the experts) or `given` loads;
- `kept_tokens`: expert e's tokens from the whole EP group, ep x T x k x p_e, capped at
  its capacity where the routing drops tokens;
- `dispatch_sizes`: bytes GPU i sends GPU j in the dispatch all-to-all (every source
  sends 1/ep of each expert's tokens: sources route alike); the combine sends them back
  (the transpose).

Experts are placed as Megatron-LM places them: EP rank j holds experts j x E/ep to
(j + 1) x E/ep - 1.
"""

from __future__ import annotations

import math
import random

from triosim.common.errors import ConfigError


def expert_shares(
    num_experts: int,
    top_k: int,
    load: str = "uniform",
    skew: float = 1.0,
    seed: int = 0,
    given=None,
) -> list[float]:
    """Each expert's share of the routed token slots (sum 1, each <= 1/top_k).

    uniform: 1/E each. skew: the experts in a random order drawn from `seed`, the r-th
    (1-based) weighted r**-skew (0: uniform), then capped at 1/top_k with the excess spread
    over the others in proportion. given: `given` (one relative load per expert)
    normalised; a share above 1/top_k is a ConfigError naming `parallelism.expert_loads`."""
    e, cap = num_experts, 1.0 / top_k
    if load == "uniform":
        return [1.0 / e] * e
    if load == "skew":
        order = list(range(e))
        random.Random(seed).shuffle(order)
        w = [0.0] * e
        for r, x in enumerate(order, start=1):
            w[x] = r ** (-skew)
        return _capped([x / sum(w) for x in w], cap)
    if load == "given":
        where = "parallelism.expert_loads"
        if given is None or len(given) != e:
            raise ConfigError(where, given, f"one relative load per expert ({e} numbers)")
        if any(not (0 <= x < math.inf) for x in given) or sum(given) <= 0:
            raise ConfigError(where, given, "finite loads >= 0, not all 0")
        shares = [x / sum(given) for x in given]
        if max(shares) > cap * (1 + 1e-9):
            raise ConfigError(
                where,
                given,
                f"no expert above 1/top_k = {cap:g} of the routed tokens (a token picks an "
                f"expert once); expert {shares.index(max(shares))} has {max(shares):.4g}",
            )
        return shares
    raise ConfigError("parallelism.load", load, "uniform, skew or given")


def _capped(shares: list[float], cap: float) -> list[float]:
    """Shares with none above `cap`: the excess goes to the uncapped experts in proportion
    to their shares, until none is above it (water-filling; len(shares) x cap >= 1)."""
    out = list(shares)
    for _ in range(len(out)):
        over = [i for i, x in enumerate(out) if x > cap]
        if not over:
            break
        excess = sum(out[i] - cap for i in over)
        for i in over:
            out[i] = cap
        free = [i for i, x in enumerate(out) if x < cap]
        room = sum(out[i] for i in free)
        for i in free:
            out[i] += excess * out[i] / room
    return out


def kept_tokens(
    shares: list[float], tokens: float, top_k: int, ep: int, capacity_factor: float | None
) -> list[float]:
    """Tokens each expert processes from its EP group of `ep` GPUs of `tokens` each:
    ep x tokens x top_k x share, at most capacity_factor x the balanced load (ep x tokens x
    top_k / E) where the routing drops tokens (capacity_factor not None)."""
    routed = [ep * tokens * top_k * p for p in shares]
    if capacity_factor is None:
        return routed
    cap = capacity_factor * ep * tokens * top_k / len(shares)
    return [min(x, cap) for x in routed]


def per_gpu(kept: list[float], ep: int) -> list[float]:
    """Tokens each EP rank's experts process (rank j: experts j x E/ep ...)."""
    local = len(kept) // ep
    return [sum(kept[j * local : (j + 1) * local]) for j in range(ep)]


def dispatch_sizes(kept: list[float], ep: int, token_bytes: float) -> tuple:
    """sizes[i][j]: bytes EP rank i sends rank j in the dispatch all-to-all: 1/ep of the
    tokens of rank j's experts (every rank routes alike), token_bytes each (hidden x the
    dispatched dtype's size)."""
    return tuple(tuple(x * token_bytes / ep for x in per_gpu(kept, ep)) for _ in range(ep))


def transpose(sizes: tuple) -> tuple:
    """The combine's sizes: every dispatched token goes back to where it came from."""
    return tuple(zip(*sizes, strict=True))
