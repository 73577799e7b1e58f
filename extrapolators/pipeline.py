"""Pipeline parallelism: GPipe and 1F1B schedules over stages balanced by time.

Forward operators are cut into S contiguous stages (S = number of GPUs) that balance
each stage's forward + backward time (not its operator count), or where the user says.
A backward operator belongs to the stage of the forward operator it differentiates
(fwd_id), or else of the latest forward tensor it reads. The mini-batch is split into
M micro-batches; a stage sends its boundary activations to the next stage and the
gradients back, on its comm stream. The optimizer step of a stage takes the stage's
share of the weight bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from extrapolators.base import Extrapolator
from extrapolators.tasks import Recv, Send, Signal, Wait
from perfmodel import Target
from perfmodel.base import batch_ratio
from triosim.errors import ConfigError
from triosim.schema import option


def balanced_cuts(costs, parts: int) -> list[int]:
    """Start positions of `parts` contiguous groups minimising the largest group cost."""
    costs = np.asarray(costs, float)
    n = len(costs)
    if parts > n:
        raise ConfigError("num_gpus", parts, f"at most {n}: the trace has {n} forward operators")

    def cuts_for(limit):
        starts, acc = [0], 0.0
        for i, c in enumerate(costs):
            if acc + c > limit and acc > 0:
                starts.append(i)
                acc = 0.0
            acc += c
        return starts

    lo, hi = float(costs.max(initial=0.0)), float(costs.sum())
    for _ in range(100):  # bisection on the largest stage cost
        mid = (lo + hi) / 2
        if len(cuts_for(mid)) <= parts:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * max(hi, 1e-30):
            break
    starts = cuts_for(hi)
    # fewer groups than parts (many zero-cost ops): split the largest groups further
    while len(starts) < parts:
        bounds = starts + [n]
        sizes = [bounds[k + 1] - bounds[k] for k in range(len(starts))]
        k = int(np.argmax(sizes))
        starts.insert(k + 1, bounds[k] + sizes[k] // 2)
    return starts


@dataclass(frozen=True)
class PipelineOptions:
    microbatches: int = option(1, ge=1, help="micro-batches the mini-batch is split into")
    stages: list[int | str] = option(factory=list, help="where stages 2..S begin: layer names "
                                     "or forward-op positions (default: balanced)")  # fmt: skip


class GPipe(Extrapolator):
    name = "gpipe"
    Options = PipelineOptions
    hybrid_inner = True

    def check(self):
        m = self.options.microbatches
        if self.batch is not None and m > self.batch:
            raise ConfigError("parallelism.microbatches", m,
                              f"at most the batch size ({self.batch})")  # fmt: skip
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
        target = self.target(None)
        cost = np.array([self.model.time(trace.operators[i], target) for i in fwd])
        for i, k in owner.items():
            cost[k] += self.model.time(trace.operators[i], target)
        starts = self._user_cuts(fwd) if self.options.stages else balanced_cuts(cost, S)
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
        self.stage_cost = [float(cost[stage_of_fwd == s].sum()) for s in range(S)]
        self._boundaries(fwd, stage_of_fwd)
        self._weights_share(fwd, stage_of_fwd)

    def _user_cuts(self, fwd) -> list[int]:
        S, ops = len(self.gpus), self.trace.operators
        if len(self.options.stages) != S - 1:
            raise ConfigError("parallelism.stages", list(self.options.stages),
                              f"{S - 1} stage starts (layer names or forward-op positions) for "
                              f"{S} GPUs")  # fmt: skip
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
                raise ConfigError("parallelism.stages", s,
                                  f"increasing forward-op positions in 1..{len(fwd) - 1}")  # fmt: skip
            starts.append(k)
        return starts

    def _boundaries(self, fwd, stage_of_fwd):
        """Bytes (at the traced batch) crossing each stage boundary s -> s+1 in forward."""
        S, trace = len(self.gpus), self.trace
        made = {}
        for k, i in enumerate(fwd):
            for t in trace.operators[i].outputs:
                made.setdefault(t, stage_of_fwd[k])
        self.boundary = [0.0] * max(S - 1, 0)
        crossing = [set() for _ in range(max(S - 1, 0))]
        for k, i in enumerate(fwd):
            s = stage_of_fwd[k]
            for t in trace.operators[i].inputs:
                if t in made and made[t] < s and trace.tensors[t].category == "activation":
                    for b in range(made[t], s):
                        crossing[b].add(t)
        for b in range(S - 1):
            self.boundary[b] = sum(trace.tensors[t].nbytes for t in crossing[b])

    def _weights_share(self, fwd, stage_of_fwd):
        S, trace = len(self.gpus), self.trace
        owner = {}
        for k, i in enumerate(fwd):
            for t in trace.operators[i].inputs:
                if trace.tensors[t].category == "weight":
                    owner.setdefault(t, stage_of_fwd[k])
        total = trace.weight_bytes()
        share = [0.0] * S
        for t, s in owner.items():
            share[s] += trace.tensors[t].nbytes
        self.weight_share = [x / total if total else 1.0 / S for x in share]

    def held_weight_bytes(self, gpu) -> float:
        return self.weight_share[self.gpus.index(gpu)] * self.trace.weight_bytes()

    def op_batch(self):
        return self.per_gpu_batch(self.options.microbatches)

    # -- schedule -------------------------------------------------------------------------------
    def order(self, s: int) -> list[tuple[str, int]]:
        """GPipe: all forwards, then all backwards (last micro-batch first)."""
        m = self.options.microbatches
        return [("F", k) for k in range(m)] + [("B", k) for k in reversed(range(m))]

    def streams(self):
        out = {}
        for s, g in enumerate(self.gpus):
            out[(g, "compute")] = self._compute(s)
            out[(g, "comm")] = self._comm(s)
        return out

    def _mb_bytes(self, b: int) -> float:
        mb = self.per_gpu_batch(self.options.microbatches)
        return self.boundary[b] * batch_ratio(self.trace, Target(batch_size=mb))

    def _compute(self, s):
        S, g = len(self.gpus), self.gpus
        target = self.target(self.per_gpu_batch(self.options.microbatches))
        for kind, m in self.order(s):
            if kind == "F":
                if s > 0:
                    yield Recv(g[s - 1], f"act{s - 1}.{m}", phase="forward")
                for op in self.fwd_ops[s]:
                    yield self.compute(op, target, mb=m)
            else:
                if s < S - 1:
                    yield Recv(g[s + 1], f"grad{s + 1}.{m}", phase="backward")
                for op in self.bwd_ops[s]:
                    yield self.compute(op, target, mb=m)
            yield Signal(f"{g[s]}:{kind}{m}")
        yield Wait(f"{g[s]}:sent")
        full = self.target(self.per_gpu_batch(1))
        for op in self.ops("optimizer"):
            yield self.compute(op, full, self.weight_share[s])

    def _comm(self, s):
        S, g = len(self.gpus), self.gpus
        for kind, m in self.order(s):
            yield Wait(f"{g[s]}:{kind}{m}")
            if kind == "F" and s < S - 1:
                yield Send(g[s + 1], self._mb_bytes(s), f"act{s}.{m}", phase="forward")
            elif kind == "B" and s > 0:
                yield Send(g[s - 1], self._mb_bytes(s - 1), f"grad{s}.{m}", phase="backward")
        yield Signal(f"{g[s]}:sent")


class OneFOneB(GPipe):
    """1F1B (PipeDream-flush): S-s-1 warm-up forwards, then one forward / one backward."""

    name = "1f1b"

    def order(self, s: int) -> list[tuple[str, int]]:
        m, S = self.options.microbatches, len(self.gpus)
        warm = min(S - s - 1, m)
        seq = [("F", k) for k in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                seq.append(("F", f))
                f += 1
            seq.append(("B", b))
            b += 1
        return seq
