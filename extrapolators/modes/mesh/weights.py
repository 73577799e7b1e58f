"""What each pipeline stage's GPUs hold and how their gradients are grouped: the weights of
each model chunk, the bytes a GPU holds of each (a TP-split weight 1/tp), per stage, and the
stage's DDP gradient buckets in the order its schedule completes them.

`StageWeights(trace, chunk_fwd, chunk_bwd, orders, pp, split, tp)`: `chunk_weights[c]` (the
weights chunk c's forward operators read first), `wbytes[w]`, `stage_bytes[p]`, and
`buckets(p, first, cap)`: [(trace position after which the bucket is complete, bytes)]:
chunks by their last backward step in stage p's schedule, and within a chunk as PyTorch DDP
fills them (by the backward operator that finishes each gradient, the later weight first on
a tie), the first bucket capped at `first` bytes, the others at `cap`; a gradient that no
backward operator of the chunk finishes is ready at the chunk's last backward operator.
"""

from __future__ import annotations

from extrapolators.modes.base import gradient_ready


class StageWeights:
    """The held weights and gradient buckets of a pipeline cut (module docstring)."""

    def __init__(self, trace, chunk_fwd, chunk_bwd, orders, pp: int, split: set, tp: int):
        self.trace, self.chunk_bwd, self.orders, self.pp = trace, chunk_bwd, orders, pp
        self.chunk_weights: list[list[int]] = [[] for _ in chunk_fwd]
        seen: set = set()
        for c, ops in enumerate(chunk_fwd):
            for op in ops:
                for t in op.inputs:
                    if trace.tensors[t].category == "weight" and t not in seen:
                        seen.add(t)
                        self.chunk_weights[c].append(t)
        self.wbytes = {t: trace.tensors[t].nbytes / (tp if t in split else 1) for t in seen}
        chunks = len(chunk_fwd)
        self.stage_bytes = [
            sum(self.wbytes[t] for c in range(p, chunks, pp) for t in self.chunk_weights[c])
            for p in range(pp)
        ]

    def stage_chunks(self, p: int) -> range:
        return range(p, len(self.chunk_weights), self.pp)

    def buckets(self, p: int, first: float, cap: float) -> list[tuple[int, float]]:
        ready = gradient_ready(self.trace)
        order = self.orders[p]
        last_b = {j: k for k, (kind, _, j) in enumerate(order) if kind == "B"}
        pos = {op.id: i for i, op in enumerate(self.trace.operators)}
        out, size, last = [], 0.0, -1
        for j in sorted(last_b, key=last_b.get):
            c = j * self.pp + p
            mine = {pos[op.id] for op in self.chunk_bwd[c]}
            end = max(mine, default=-1)
            for w in sorted(self.chunk_weights[c], key=lambda w: (ready[w], -w)):
                size += self.wbytes[w]
                last = ready[w] if ready[w] in mine else end
                if size >= (first if not out else cap):
                    out.append((last, size))
                    size, last = 0.0, -1
        if size:
            out.append((last, size))
        return out
