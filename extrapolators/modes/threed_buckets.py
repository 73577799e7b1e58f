"""3D parallelism's weights and gradient buckets, per pipeline stage.

`StageBuckets` is a part of `ThreeD` (its mixin). What it provides: after `_held()`, the
weights of each model chunk (`chunk_weights`), the bytes each GPU holds of each weight
(`wbytes`: a TP-split one 1/tp) and of each stage (`stage_bytes`); `_make_buckets(p)`,
stage p's DDP gradient buckets in the order its schedule completes them, which `check`
keeps in `_buckets` (empty without dp_overlap); `_bucket_plan(p)`, where in the stage's
schedule each bucket fires; `_optimizer_scale(p)`; and the mode's `held_weight_bytes`,
`buffer_bytes` and `state_fractions_of` (the distributed optimizer's shares).
What it needs: the grid (threed_grid: `pp`, `tp`, `v`, `coord`), the pipeline mode that cut
the model (`pipe`: `fwd_ops` and `bwd_ops` per chunk), the tensor-parallel plan (`tpx`:
`sharded_weights()`), each stage's schedule (`orders`), `trace` and `options` (bucket_size,
first_bucket_size, distributed_optimizer), and `reps` (dp x cp).
"""

from __future__ import annotations

from extrapolators.modes import dist_optimizer
from extrapolators.modes.base import gradient_ready


class StageBuckets:
    """The held weights and gradient buckets of a 3D plan (module docstring: the contract)."""

    def _held(self):
        """Weight bytes each stage's GPUs hold (its chunks' weights, split ones 1/tp), and the
        weights of each chunk."""
        trace, pipe = self.trace, self.pipe
        split = self.tpx.sharded_weights() if self.tp > 1 else set()
        self.chunk_weights: list[list[int]] = [[] for _ in range(self.pp * self.v)]
        seen = set()
        for c, ops in enumerate(pipe.fwd_ops):
            for op in ops:
                for t in op.inputs:
                    if trace.tensors[t].category == "weight" and t not in seen:
                        seen.add(t)
                        self.chunk_weights[c].append(t)
        self.wbytes = {t: trace.tensors[t].nbytes / (self.tp if t in split else 1) for t in seen}
        self.stage_bytes = [
            sum(
                self.wbytes[t]
                for c in range(p, self.pp * self.v, self.pp)
                for t in self.chunk_weights[c]
            )
            for p in range(self.pp)
        ]

    def held_weight_bytes(self, gpu) -> float:
        return self.stage_bytes[self.coord[gpu][1]]

    def buffer_bytes(self, gpu) -> float:
        p = self.coord[gpu][1]
        if self.options.distributed_optimizer:  # Megatron's gradient buffer, all run long
            return self.stage_bytes[p]
        return sum(size for _, size in self._buckets.get(p, ()))

    def state_fractions_of(self, gpu) -> dict | None:
        """The distributed optimizer: the stage's weights whole (as shares of all the
        trace's), its gradients in the buffer, its optimizer states / (dp x cp)."""
        if not self.options.distributed_optimizer:
            return None
        total = self.trace.weight_bytes()
        held = self.stage_bytes[self.coord[gpu][1]] / total if total else 0.0
        return dist_optimizer.state_fractions(held, self.reps)

    def _make_buckets(self, p) -> list[tuple[int, float]]:
        """[(ready trace position, bytes)] of stage p's gradient buckets, in the order its
        schedule completes them: chunks by their last backward step, and within a chunk as
        DDP (by the backward operator that finishes each gradient)."""
        ready = gradient_ready(self.trace)
        order = self.orders[p]
        last_b = {j: k for k, (kind, _, j) in enumerate(order) if kind == "B"}
        pos = {op.id: i for i, op in enumerate(self.trace.operators)}
        out, size, last = [], 0.0, -1
        o = self.options
        for j in sorted(last_b, key=last_b.get):
            c = j * self.pp + p
            mine = {pos[op.id] for op in self.pipe.bwd_ops[c]}
            end = max(mine, default=-1)
            ws = sorted(self.chunk_weights[c], key=lambda w: (ready[w], -w))
            for w in ws:
                size += self.wbytes[w]
                last = ready[w] if ready[w] in mine else end
                if size >= (o.first_bucket_size if not out else o.bucket_size):
                    out.append((last, size))
                    size, last = 0.0, -1
        if size:
            out.append((last, size))
        return out

    def _bucket_plan(self, p):
        """Stage p's schedule and where its DP buckets fire: (order, the step of each
        chunk's last backward, each operator's trace position, bucket numbers by the
        position of the operator that completes them, number of buckets)."""
        order = self.orders[p]
        last_b = {j: k for k, (kind, _, j) in enumerate(order) if kind == "B"}
        pos = {op.id: i for i, op in enumerate(self.trace.operators)}
        buckets = self._buckets.get(p, [])
        by_pos: dict[int, list[int]] = {}
        for k, (q, _) in enumerate(buckets):
            by_pos.setdefault(q, []).append(k)
        return order, last_b, pos, by_pos, len(buckets)

    def _optimizer_scale(self, p) -> float:
        """The optimizer's time x the share of the weights stage p steps: its TP shard, of
        which 1 / (dp x cp) with the distributed optimizer."""
        total = self.trace.weight_bytes()
        scale = self.stage_bytes[p] / total if total else 1.0 / (self.pp * self.tp)
        return scale / self.reps if self.options.distributed_optimizer else scale
