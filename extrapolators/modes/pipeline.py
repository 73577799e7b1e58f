"""A pipeline's cut: the forward operators in S contiguous chunks balanced by time (S: the
plan's GPUs, one per chunk), or where the user says; the mesh (mesh/) and mode ep run each
chunk on a stage under a schedule (schedules.py). Balanced cuts fall between layers (the
units of the model's repeated blocks, blocks.block_depth) as the frameworks split models,
where there are at least S of them; else between any two forward operators.

The cuts minimise the slowest chunk, where a chunk costs one micro-batch's forward (twice
where it is recomputed) and backward time plus, at each of its boundaries, the activation
crossing it one way and its gradient the other: 2 x (bytes / bandwidth + latency) over the
slowest path between consecutive chunks' GPUs (nothing when the plan has no topology). A
backward operator belongs to the chunk of the forward operator it differentiates (fwd_id),
or else of the latest forward tensor it reads. `boundary[k]` is the activation bytes (at
the traced batch) crossing the cut between chunks k and k + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import networkx as nx
import numpy as np

from extrapolators.modes.base import Extrapolator
from extrapolators.modes.blocks import block_depth, layer_prefix
from perfmodel import Target
from perfmodel.base import batch_ratio
from triosim.common.errors import ConfigError
from triosim.common.schema import option


def _double(bits: int) -> float:
    return float(np.int64(bits).view(np.float64))


def balanced_cuts(costs, parts: int, boundary=None) -> list[int]:
    """Start positions of `parts` non-empty contiguous groups of `costs` minimising the largest
    group cost, where a group [i, j) costs boundary[i] + sum(costs[i:j]) + boundary[j]
    (`boundary`: n + 1 values, the cost of cut j to each group beside it; boundary[0] and
    boundary[n] are ignored).

    Bisection on the largest cost with an exact feasibility test (can [0, n) be cut into
    exactly `parts` groups of cost <= limit?), run layer by layer over the cut positions in
    O(parts x n), at most 64 times; the cuts come from the last feasible test's own
    arithmetic, so they always exist: no rounding can leave a group missing or add one.
    """
    c = np.asarray(costs, float)
    n = len(c)
    if parts > n:
        raise ConfigError("num_gpus", parts, f"at most {n}: the trace has {n} forward operators")
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    w = np.zeros(n + 1) if boundary is None else np.array(boundary, float)
    if w.shape != (n + 1,):
        raise ValueError(f"boundary needs {n + 1} values (one per cut), got {w.shape}")
    if not (np.isfinite(c).all() and np.isfinite(w).all() and (c >= 0).all() and (w >= 0).all()):
        raise ValueError("costs and boundary costs must be finite and >= 0")
    if parts == 1:
        return [0]
    w[0] = w[n] = 0.0  # the ends of the sequence are not cuts
    top = max(float(c.max()), float(w.max()))
    if top > 0:  # (n + 2) x top bounds every group's cost; keep it far from overflowing
        excess = math.log2(top) + math.log2(n + 2) - 995  # 2**995 ~ 4e299
        if excess > 0:  # scale by a power of two: exact, and order-preserving
            c, w = np.ldexp(c, -math.ceil(excess)), np.ldexp(w, -math.ceil(excess))
    prefix = np.concatenate(([0.0], np.cumsum(c)))
    end_cost, start = prefix + w, prefix - w  # a group [i, j) costs end_cost[j] - start[i]

    def layers(limit):
        """ok[s][j]: [0, j) splits into s + 1 groups of cost <= limit, the last ending at j."""
        out, prev = [], np.zeros(n + 1, bool)
        prev[0] = True
        for _ in range(parts):
            reach = np.maximum.accumulate(np.where(prev, start, -np.inf))
            ok = np.concatenate(([False], reach[:-1] >= end_cost[1:] - limit))
            out.append(ok)
            prev = ok
        return out

    # bisection over the bit patterns of the limit (ordered like the non-negative doubles
    # they encode): at most 64 tests reach the smallest feasible double, at any magnitude
    every = 2 * (float(end_cost.max()) - float(start.min())) + 1.0  # all groups fit
    hi_bits = int(np.float64(every).view(np.int64))
    lo_bits = -1  # below 0.0: infeasible
    best = layers(_double(hi_bits))
    while hi_bits - lo_bits > 1:
        mid = (lo_bits + hi_bits) // 2
        trial = layers(_double(mid))
        if trial[-1][n]:
            hi_bits, best = mid, trial
        else:
            lo_bits = mid
    hi = _double(hi_bits)
    starts, j = [], n
    for s in range(parts - 1, 0, -1):  # walk back through the feasible layers
        i = int(np.nonzero(best[s - 1][:j] & (start[:j] >= end_cost[j] - hi))[0][-1])
        starts.append(i)
        j = i
    return [0, *reversed(starts)]


@dataclass(frozen=True)
class PipelineOptions:
    microbatches: int = option(1, ge=1, help="micro-batches the mini-batch is split into")
    stages: list[int | str] = option(
        factory=list,
        help="where stages 2..S begin: layer names or forward-op positions (default: balanced)",
    )
    split: Literal["balanced", "uniform"] = option(
        "balanced",
        help="where cuts fall without `stages`: balanced (by time and boundary bytes, between "
        "layers); uniform (the trace's numbered layers in equal numbers a chunk, what comes "
        "before them with the first, after them with the last: Megatron's default split)",
    )
    recompute: Literal["none", "except_last", "all"] = option(
        "none",
        help="activation checkpointing: re-run a stage's forward for a micro-batch just before "
        "its backward; except_last: every micro-batch but the last (the default of "
        "torch.distributed.pipeline.sync.Pipe, checkpoint='except_last')",
    )


class StageCut(Extrapolator):
    """The cut (module docstring) of the trace over `gpus`, one chunk each: `fwd_ops[k]`,
    `bwd_ops[k]`, `starts` (forward positions where chunks begin), `boundary`, and
    `stage_cost[k]` (what the balancing weighed)."""

    name = "cut"
    Options = PipelineOptions

    def check(self):
        m = self.options.microbatches
        if self.batch is not None and m > self.batch:
            raise ConfigError(
                "parallelism.microbatches", m, f"at most the batch size ({self.batch})"
            )
        if self.batch is None and m > 1:
            raise ConfigError("batch_size", None, "a batch size to split into micro-batches")
        self.per_gpu_batch(m)
        self._assign()

    # -- partition ----------------------------------------------------------------------------
    def _assign(self):
        trace, S = self.trace, len(self.gpus)
        fwd = [i for i, op in enumerate(trace.operators) if op.phase == "forward"]
        if not fwd:
            raise ConfigError("parallelism.mode", self.name, "a trace with forward operators")
        fpos = {trace.operators[i].id: k for k, i in enumerate(fwd)}
        producer = {}
        for k, i in enumerate(fwd):
            for t in trace.operators[i].outputs:
                producer.setdefault(t, k)
            for t in trace.operators[i].inputs:
                if trace.tensors[t].category == "weight":
                    producer.setdefault(t, k)
        owner = {}  # backward op position -> forward position it belongs to
        last = len(fwd) - 1
        for i, op in enumerate(trace.operators):
            if op.phase != "backward":
                continue
            if op.fwd_id is not None and op.fwd_id in fpos:
                k = fpos[op.fwd_id]
            else:
                seen = [producer[t] for t in op.inputs if t in producer]
                k = min(max(seen), last) if seen else last
            owner[i] = last = k
        # what one micro-batch of each forward position costs on its stage: its forward (twice
        # where it is recomputed), its backward, at the micro-batch size the schedule runs
        m = self.options.microbatches
        target = self.target(self.per_gpu_batch(m))
        again = {"none": 0.0, "all": 1.0, "except_last": (m - 1) / m}[self.options.recompute]
        cost = np.array([self.model.time(trace.operators[i], target) for i in fwd]) * (1 + again)
        for i, k in owner.items():
            cost[k] += self.model.time(trace.operators[i], target)
        self.cut_bytes = self._cut_bytes(fwd)
        bw, lat = self.link()
        # a cut costs both stages beside it the activation going one way and its gradient the
        # other: the transfer delays the sender's downstream work and the receiver's
        crossing = self.cut_bytes * self._mb_ratio()
        boundary = np.where(crossing > 0, 2 * (crossing / bw + lat), 0.0)
        boundary[0] = boundary[-1] = 0.0
        if self.options.stages and self.options.split == "uniform":
            raise ConfigError(
                "parallelism.split", "uniform", "balanced where stages names the cuts"
            )
        if self.options.stages:
            starts = self._user_cuts(fwd)
        elif self.options.split == "uniform":
            starts = self._uniform(fwd, S)
        else:
            starts = self._balanced(fwd, cost, boundary, S)
        stage_of_fwd = np.searchsorted(np.array(starts), np.arange(len(fwd)), side="right") - 1
        self.stage_of = {}
        for k, i in enumerate(fwd):
            self.stage_of[i] = int(stage_of_fwd[k])
        for i, k in owner.items():
            self.stage_of[i] = int(stage_of_fwd[k])
        self.fwd_ops = [[] for _ in range(S)]
        self.bwd_ops = [[] for _ in range(S)]
        for i, op in enumerate(trace.operators):
            if op.phase == "forward":
                self.fwd_ops[self.stage_of[i]].append(op)
            elif op.phase == "backward":
                self.bwd_ops[self.stage_of[i]].append(op)
        self.starts = list(starts)
        ends = [*starts[1:], len(fwd)]
        self.stage_cost = [
            float(boundary[starts[s]] + cost[stage_of_fwd == s].sum() + boundary[ends[s]])
            for s in range(S)
        ]
        # bytes (at the traced batch) crossing each stage boundary s -> s+1 in forward
        self.boundary = [float(self.cut_bytes[starts[b + 1]]) for b in range(S - 1)]

    def link(self) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest path between consecutive stages' GPUs: the
        narrowest link on the shortest route, and its summed latency. (inf, 0) when the plan
        was not given the topology."""
        if self.graph is None or len(self.gpus) < 2:
            return math.inf, 0.0
        bw, lat = math.inf, 0.0
        for a, b in zip(self.gpus, self.gpus[1:], strict=False):
            path = nx.shortest_path(self.graph, a, b)
            edges = [self.graph.edges[u, v] for u, v in zip(path, path[1:], strict=False)]
            bw = min(bw, *(e["bandwidth"] for e in edges))
            lat = max(lat, sum(e.get("latency", 0.0) for e in edges))
        return bw, lat

    def _balanced(self, fwd, cost, boundary, S) -> list[int]:
        """Balanced cuts between layers where the trace has at least S of them (a
        framework splits a model between its modules: torchtitan at module names, Megatron
        whole layers a stage), else between any two forward operators."""
        allowed = self._layer_starts(fwd)
        if len(allowed) < S:  # (a loss that reads an early layer bans too many cuts)
            allowed = self._layer_starts(fwd, loss=False)
        if len(allowed) < S:
            return balanced_cuts(cost, S, boundary)
        group = np.searchsorted(np.array(allowed), np.arange(len(fwd)), side="right") - 1
        cost_g = np.bincount(group, weights=cost, minlength=len(allowed))
        boundary_g = np.append(boundary[allowed], boundary[len(fwd)])
        return [allowed[g] for g in balanced_cuts(cost_g, S, boundary_g)]

    def _uniform(self, fwd, S) -> list[int]:
        """Chunk k starts at numbered layer floor(k L / S) of the L in the trace (Megatron:
        num_layers / (pp x vp) a chunk); the operators before the first layer (the
        embedding) go with the first chunk, those after the last (norm, head, loss) with
        the last."""
        layers = self._layer_starts(fwd, numbered=True)
        if len(layers) < S:
            raise ConfigError(
                "parallelism.split",
                "uniform",
                f"a trace with at least {S} numbered layers for {S} chunks (it has "
                f"{len(layers)}): use balanced, or stages",
            )
        return [0, *(layers[k * len(layers) // S] for k in range(1, S))]

    def _layer_starts(self, fwd, numbered: bool = False, loss: bool = True) -> list[int]:
        """Forward positions where a layer begins: a unit of the model's repeated blocks
        (blocks.block_depth: `layers.3`, `layer1.0`; depth 1 where the trace has none);
        `numbered`: only those named with a number after their first part (not the
        embedding, stem or head: "(model)", "conv1"; not an imported trace's "0"). No cut
        between the loss and what it reads (the heads): a stage would send the logits
        (DeepSeek-V3's main and MTP heads: 1-2 GB a micro-batch), which no framework does
        (`loss=False`: where a loss reading an early layer, an auxiliary loss, would leave
        too few)."""
        ops = self.trace.operators
        depth = block_depth(self.trace) or 1
        names = [layer_prefix(ops[i], depth) for i in fwd]
        made, banned = {}, set()
        for k, i in enumerate(fwd):
            if loss and ops[i].layer == "loss":
                for t in ops[i].inputs:
                    banned.update(range(made.get(t, k) + 1, k + 1))
            for t in ops[i].outputs:
                made.setdefault(t, k)
        return [
            k
            for k in range(len(fwd))
            if (k == 0 or (names[k] != names[k - 1] and k not in banned))
            and (not numbered or any(p.isdigit() for p in names[k].split(".")[1:]))
        ]

    def _cut_bytes(self, fwd) -> np.ndarray:
        """Activation bytes (traced batch) crossing cut j, between forward positions j-1 and j,
        for j = 0..len(fwd): a tensor made at position p and last read at q crosses p < j <= q."""
        trace = self.trace
        made, last_read = {}, {}
        for k, i in enumerate(fwd):
            op = trace.operators[i]
            for t in op.inputs:
                if t in made and made[t] < k and trace.tensors[t].category == "activation":
                    last_read[t] = k
            for t in op.outputs:
                made.setdefault(t, k)
        diff = np.zeros(len(fwd) + 2)
        for t, q in last_read.items():
            diff[made[t] + 1] += trace.tensors[t].nbytes
            diff[q + 1] -= trace.tensors[t].nbytes
        return np.cumsum(diff)[: len(fwd) + 1]

    def _user_cuts(self, fwd) -> list[int]:
        S, ops = len(self.gpus), self.trace.operators
        if len(self.options.stages) != S - 1:
            raise ConfigError(
                "parallelism.stages",
                list(self.options.stages),
                f"{S - 1} stage starts (layer names or forward-op positions) for {S} GPUs",
            )
        starts = [0]
        for s in self.options.stages:
            if isinstance(s, int) and not isinstance(s, bool):
                k = s
            else:
                hits = [
                    k
                    for k, i in enumerate(fwd)
                    if ops[i].layer == s or ops[i].layer.startswith(f"{s}.")
                ]
                if not hits:
                    raise ConfigError("parallelism.stages", s, "a layer name found in the trace")
                k = hits[0]
            if not (starts[-1] < k < len(fwd)):
                raise ConfigError(
                    "parallelism.stages", s, f"increasing forward-op positions in 1..{len(fwd) - 1}"
                )
            starts.append(k)
        return starts

    def _mb_ratio(self) -> float:
        """A micro-batch's share of the trace's batch-sized tensors."""
        mb = self.per_gpu_batch(self.options.microbatches)
        return batch_ratio(self.trace, Target(batch_size=mb))
