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


# -- DeepEP's dispatch: one copy per node over the NICs, forwarded over NVLink ---------------
def hit_probability(counts: list[int], group_size: int, top_groups: int, top_k: int) -> float:
    """P(a token hits at least one expert of a set A): the token picks `top_groups` of the
    len(counts) expert groups (group_size experts each) uniformly, then top_k distinct
    experts uniformly among theirs (DeepSeek-V3's group-limited routing; one group of all
    experts: plain top-k). counts[g] = |A and group g|.

    P(miss A) = sum over the group choices S of C(m X - a_S, k) / C(m X, k) / C(G, m), a_S
    the experts of A in S: the choices counted by a_S in a dynamic programme over the groups
    (ways[c][s]: c groups chosen holding s experts of A)."""
    G, m, X, k = len(counts), top_groups, group_size, top_k
    if not 1 <= m <= G or not 1 <= k <= m * X:
        raise ValueError(f"top_groups {m} of {G} groups of {X} experts, top_k {k}")
    ways = [dict() for _ in range(m + 1)]
    ways[0][0] = 1
    for a in counts:
        for c in range(min(m, G) - 1, -1, -1):  # each group chosen at most once
            for s, w in ways[c].items():
                ways[c + 1][s + a] = ways[c + 1].get(s + a, 0) + w
    total = math.comb(m * X, k) * math.comb(G, m)
    miss = sum(w * math.comb(m * X - s, k) for s, w in ways[m].items())
    return 1.0 - miss / total


def node_members(node_of: list) -> dict:
    """Node -> the EP ranks on it, in rank order (`node_of[j]`: rank j's node); ValueError
    unless every node holds as many (DeepEP's gateway is the GPU at the sender's position
    in the other node)."""
    members: dict = {}
    for j, n in enumerate(node_of):
        members.setdefault(n, []).append(j)
    if len({len(v) for v in members.values()}) != 1:
        raise ValueError(
            f"the EP group's {len(node_of)} GPUs are spread unevenly over nodes "
            f"({sorted(len(v) for v in members.values())} per node)"
        )
    return members


def deepep_sizes(
    sizes: tuple, node_of: list, experts: int, top_k: int, groups: int = 1, top_groups: int = 1
) -> tuple:
    """The dispatch's bytes matrix as DeepEP's normal (NVLink + RDMA) kernels move it, from
    the all-to-all dispatcher's `sizes` (one copy per routed expert): EP rank i sends
    - a GPU of its own node each token routed to that GPU's experts once (not once per
      expert): sizes[i][j] x f_gpu[j];
    - each other node B one copy of each token routed there, over the NICs to its gateway,
      B's GPU at i's position in its node: sum over j in B of sizes[i][j] x f_node[B];
      the gateway forwards each to B's GPUs holding its experts over NVLink (once per GPU:
      sizes[i][j] x f_gpu[j] on the link gateway -> j, none to itself).
    f = P(a token hits the GPU's / node's experts) / (the expert copies it sends there),
    both under uniform group-limited routing (hit_probability; experts j x E/ep ... of
    rank j, groups of E/groups consecutive experts): 1 where each token picks at most one
    expert there. With uneven loads the uniform ratios scale the uneven copies, each
    capped at the sender's tokens (a token reaches a GPU or a node once).
    `node_of[j]`: EP rank j's node; every node must hold as many ranks of the group (the
    gateway is by position), else ValueError."""
    ep = len(sizes)
    members = node_members(node_of)
    per_rank, X = experts // ep, experts // groups

    def f(ranks) -> float:
        held = [e for j in ranks for e in range(j * per_rank, (j + 1) * per_rank)]
        counts = [0] * groups
        for e in held:
            counts[e // X] += 1
        copies = top_k * len(held) / experts  # expected copies of a token sent there
        return hit_probability(counts, X, top_groups, top_k) / copies

    f_gpu = [f([j]) for j in range(ep)]
    f_node = {n: f(v) for n, v in members.items()}
    pos = {j: v.index(j) for v in members.values() for j in v}
    out = [[0.0] * ep for _ in range(ep)]
    for i in range(ep):
        a = node_of[i]
        whole = sum(sizes[i]) / top_k  # i's tokens: none goes anywhere twice
        for n, ranks in members.items():
            if n == a:
                for j in ranks:
                    out[i][j] += min(sizes[i][j] * f_gpu[j], whole)
                continue
            gate = ranks[pos[i]]
            out[i][gate] += min(sum(sizes[i][j] for j in ranks) * f_node[n], whole)
            for j in ranks:
                if j != gate:
                    out[gate][j] += min(sizes[i][j] * f_gpu[j], whole)
    return tuple(tuple(row) for row in out)
