"""What each pipeline stage's GPUs hold and how their gradients are grouped: the weights of
each model chunk, the bytes a GPU holds of each (a TP-split weight 1/tp), per stage, and the
stage's DDP gradient buckets in the order its schedule completes them.

`StageWeights(trace, chunk_fwd, chunk_bwd, orders, place, split, tp, experts, expert_parts,
precision)`: `chunk_weights[c]` (the weights chunk c's forward operators read first),
`wbytes[w]` (a TP-split weight 1/tp, a routed expert's 1/expert_parts: 1/(ep x etp)) as
stored, `gbytes[w]` and `rbytes[w]` the same weight as gathered and as its gradient is
reduced (triosim.trace.precision; the stored bytes by default), `stage_bytes[p]`, split as
`dense_bytes[p]` and `expert_bytes[p]` (reduced over different groups), `held(p, kind,
what)`, and `buckets(p, first, cap)` (of reduced bytes): [(trace position after which the bucket is complete, bytes,
kind)]: chunks by their last backward step in stage p's schedule, and within a chunk as
PyTorch DDP fills them (by the backward operator that finishes each gradient, the later
weight first on a tie), the first bucket capped at `first` bytes, the others at `cap`; a
gradient that no backward operator of the chunk finishes is ready at the chunk's last
backward operator. Dense and expert gradients fill buckets of their own (kind "dense",
"expert"), merged in the order they are ready.

`param_buckets(trace, experts, cap, wbytes, only)`: the distributed optimizer's parameter
all-gathers overlapped with the forward pass (Megatron's --overlap-param-gather):
[(position of the first forward operator reading the bucket's first weight, bytes, kind)]
in the order the forward pass needs them, each kind's weights in buckets of their own cut
at `cap` bytes.
"""

from __future__ import annotations

import heapq

from extrapolators.modes.base import gradient_ready
from extrapolators.modes.schedules import split_steps


class StageWeights:
    """The held weights and gradient buckets of a pipeline cut (module docstring)."""

    def __init__(
        self,
        trace,
        chunk_fwd,
        chunk_bwd,
        orders,
        place,
        split: set,
        tp: int,
        experts=(),
        expert_parts: int = 1,
        precision=None,
    ):
        self.trace, self.chunk_bwd, self.orders, self.place = trace, chunk_bwd, orders, place
        self._ready_pos = None
        pp = place.stages
        self.experts = frozenset(experts)
        self.chunk_weights: list[list[int]] = [[] for _ in chunk_fwd]
        seen: set = set()
        for c, ops in enumerate(chunk_fwd):
            for op in ops:
                for t in op.inputs:
                    if trace.tensors[t].category == "weight" and t not in seen:
                        seen.add(t)
                        self.chunk_weights[c].append(t)
        ex = self.experts
        parts = {t: expert_parts if t in ex else tp if t in split else 1 for t in seen}
        self.wbytes = {t: trace.tensors[t].nbytes / parts[t] for t in seen}
        self.gbytes, self.rbytes = self.wbytes, self.wbytes
        if precision is not None and precision.options.params != "trace":
            self.gbytes = {t: precision.gathered(t) / parts[t] for t in seen}
        if precision is not None and precision.options.reduce != "trace":
            self.rbytes = {t: precision.reduced(t) / parts[t] for t in seen}

        def held(p, kinds, of=self.wbytes):
            return sum(
                of[t]
                for c in place.stage_chunks(p)
                for t in self.chunk_weights[c]
                if (t in ex) in kinds
            )

        self.stage_bytes = [held(p, (False, True)) for p in range(pp)]
        self.dense_bytes = [held(p, (False,)) for p in range(pp)] if ex else self.stage_bytes
        self.expert_bytes = [held(p, (True,)) for p in range(pp)] if ex else [0.0] * pp
        self._as = {"stored": (self.dense_bytes, self.expert_bytes)}
        for what, of in (("gathered", self.gbytes), ("reduced", self.rbytes)):
            if of is self.wbytes:
                self._as[what] = self._as["stored"]
            else:
                dense = [held(p, (False,), of) for p in range(pp)]
                self._as[what] = (dense, [held(p, (True,), of) for p in range(pp)])
        self.stage_reduced = self.stage_bytes  # (Megatron's gradient buffer: all of them)
        if self.rbytes is not self.wbytes:
            self.stage_reduced = [held(p, (False, True), self.rbytes) for p in range(pp)]

    def held(self, p: int, kind: str = "dense", what: str = "stored") -> float:
        """The bytes of `kind` ("dense" or "expert") a GPU of stage p holds, as stored,
        "gathered" or "reduced" (their gradients)."""
        dense, expert = self._as[what]
        return dense[p] if kind == "dense" else expert[p]

    def stage_chunks(self, p: int) -> list[int]:
        return self.place.stage_chunks(p)

    def buckets(self, p: int, first: float, cap: float) -> list[tuple[int, float, str]]:
        made = self._buckets(p, first, cap, "dense")
        if self.experts:  # each kind's in its own order, merged by when they are ready
            expert = self._buckets(p, first, cap, "expert")
            made = list(heapq.merge(made, expert, key=lambda b: b[0]))
        return [(pos, size, kind) for (_, pos), size, kind in made]

    def _ready(self) -> tuple[dict, dict]:
        """(gradient_ready of the trace, each op id's position), made once: every stage's
        buckets of each kind read them (DeepSeek-V3's 16 stages walked the trace 64 times)."""
        if self._ready_pos is None:
            ops = self.trace.operators
            self._ready_pos = (gradient_ready(self.trace), {op.id: i for i, op in enumerate(ops)})
        return self._ready_pos

    def _buckets(self, p: int, first: float, cap: float, kind: str) -> list:
        ready, pos = self._ready()
        order = self.orders[p]
        last_b = split_steps(order)[1]  # (a chunk's gradients: after its last W or B)
        out, size, last, at = [], 0.0, -1, 0
        expert = kind == "expert"
        for j in sorted(last_b, key=last_b.get):
            c = self.place.chunk(p, j)
            mine = {pos[op.id] for op in self.chunk_bwd[c]}
            end = max(mine, default=-1)
            weights = [w for w in self.chunk_weights[c] if (w in self.experts) == expert]
            for w in sorted(weights, key=lambda w: (ready[w], -w)):
                size += self.rbytes[w]
                last, at = (ready[w] if ready[w] in mine else end), last_b[j]
                if size >= (first if not out else cap):
                    out.append(((at, last), size, kind))
                    size, last = 0.0, -1
        if size:
            out.append(((at, last), size, kind))
        return out


def param_buckets(trace, experts, cap: float, wbytes: dict, only=None) -> list:
    """The parameter all-gathers of --overlap-param-gather (module docstring)."""
    first: dict = {}
    for pos, op in enumerate(trace.operators):
        if op.phase == "forward":
            for t in op.inputs:
                first.setdefault(t, pos)
    end, out = len(trace.operators), []
    for kind in ("dense", "expert"):
        mine = [w for w in wbytes if (w in experts) == (kind == "expert")]
        if only is not None:  # one pipeline stage's weights
            mine = [w for w in mine if w in only]
        mine.sort(key=lambda w: (first.get(w, end), w))
        size, need = 0.0, None
        for w in mine:
            if need is None:
                need = first.get(w, end)
            size += wbytes[w]
            if size >= cap:
                out.append((need, size, kind))
                size, need = 0.0, None
        if size > 0:
            out.append((need, size, kind))
    return sorted(out, key=lambda b: b[0])
