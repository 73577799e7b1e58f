"""Pipeline parallelism inside expert parallelism: mode `ep` with `pp` > 1, as Megatron-Core
runs an MoE model with PP (Mixtral 8x7B and DeepSeek-V3 were trained so).

The grid (ep_grid: Megatron-Core's order tp-cp-ep-dp-pp, PP outermost): stage p is the s =
num_gpus / pp GPUs p x s .. (p + 1) x s - 1; inside a stage the dense layers are tp x dp
and the routed experts etp x ep x edp exactly as mode `ep` lays them out on s GPUs, and a
pipeline group is the pp GPUs with the same local index. The model is cut as mode `3d`
cuts it (pipeline.StageCut: the forward operators into pp x v contiguous chunks,
v = `virtual_stages`, balanced by time and boundary bytes, each backward operator with
its forward's chunk; a cut falling inside an MoE layer's routed experts is moved to just
after them, so a layer's dispatch and combine run on one stage); chunk c is on stage c %
pp, and each stage runs the schedule mode `3d` names (extrapolators.modes.schedules: 1f1b
by default, gpipe, interleaved) over M = `accumulation_steps` micro-batches of a
replica's batch (Megatron's num_microbatches = global batch / (micro-batch x dp), dp = s /
tp).

Per GPU, on the compute stream, each schedule step (F|B, m, chunk c) runs chunk c's
forward (or backward) operators of micro-batch m as mode `ep` runs them (its template
restricted to the chunk's operators: the dispatch and combine all-to-alls over the GPU's
EP group, the expert-TP gathers, the dense TP collectives), after receiving the
activation from the stage holding chunk c - 1 (F, c > 0) or the gradient from chunk c +
1's (B, c < pp x v - 1). Its sends run on "send_fwd" and "send_bwd" streams as in `3d`:
the activation crossing the cut (the cut's boundary bytes at a micro-batch) / tp (sequence
parallel: each TP rank holds and passes 1/tp of the sequence, Megatron's p2p tensor shape
seq / tp), to the GPU with the same local index in the next chunk's stage, its gradient
back the same way. After the schedule (and both send streams), the gradients a GPU holds
are reduced as mode `ep` reduces them, over its stage's groups: its dense share over the
dense DP group (s / tp GPUs), its experts' over its expert-DP group (s / (ep x etp));
all-reduce, or with the distributed optimizer reduce-scatter and, after the step,
all-gather. The sequence-parallel weights' gradients (norms, router) are all-reduced over
the TP group first, the whole trace's bytes on every stage, as mode `3d` does.

What a GPU holds is its stage's share (`stage_held[p]` = (dense, expert) bytes): the
weights its chunks' forward operators read first (a weight two stages read, a tied
embedding, counted in the first, as `3d`), dense ones / tp where TP-split, experts /
(ep x etp). The optimizer step's time is scaled by it (and by 1/dp, 1/edp with the
distributed optimizer). Activations need nothing here: the memory model follows each GPU's
timeline, per micro-batch, so 1F1B's in-flight micro-batches (pp - p on stage p) come out
of it.

`EPPipeline` is a part of `ExpertParallel` (its mixin): `_plan_pipeline()` in `check`,
`_pipeline_compute(gpu)` and `_pipeline_sends(gpu, kind, name)` the streams. It needs of
the mode: `grid`, `gpus`, `trace`, `model`, `options` (accumulation_steps, schedule),
`split_weights`, `expert_weights`, `_template(j, mb, part)`, `_tasks(gpu, items, mb)`,
`_step(gpu)` and `tpx`; with dp_overlap, `_make_stage_buckets` gives each stage its own
gradient buckets (mode ep's, of the stage's weights), reduced over the stage's groups as
its last micro-batch's backward completes them; with overlap_param_gather each stage
gathers its own weights' updated shards before its first micro-batch's forward reads
them (`stage_gathers`, made in `check`). With pp > 1 the mode refuses fsdp (its units are
planned for one stage).
"""

from __future__ import annotations

from extrapolators.execution.tasks import Collective, Recv, Signal, Wait
from extrapolators.modes import ep_buckets
from extrapolators.modes.pipeline import PipelineOptions, StageCut
from extrapolators.modes.pipeline_sends import chunk_sends
from extrapolators.modes.schedules import schedule
from triosim.common.errors import ConfigError


class EPPipeline:
    """Pipeline stages of mode `ep` (module docstring: what it gives, what it needs)."""

    def _plan_pipeline(self) -> None:
        o, pp, grid = self.options, self.grid.pp, self.grid
        M, v = o.accumulation_steps, o.virtual_stages
        order_of = schedule(o.schedule)
        self.orders = [order_of(p, pp, M, v) for p in range(pp)]
        self.v, self.chunks = v, pp * v  # chunk c on stage c % pp
        self.pipe = self._cut(M, [])
        starts = self._whole_moe_layers(self.pipe.starts)
        if starts != self.pipe.starts:
            self.pipe = self._cut(M, starts[1:])
        T, seen = self.trace.tensors, set()
        self.stage_held, self.stage_weights = [], []
        self.stage_buckets = [[] for _ in range(pp)]  # with dp_overlap: _make_stage_buckets
        self.stage_unfired = [[] for _ in range(pp)]
        for p in range(pp):
            dense = expert = 0.0
            self.stage_weights.append(set())
            for op in (op for c in range(p, self.chunks, pp) for op in self.pipe.fwd_ops[c]):
                for w in op.inputs:
                    if T[w].category != "weight" or w in seen:
                        continue
                    seen.add(w)
                    self.stage_weights[-1].add(w)
                    if w in self.expert_weights:
                        expert += T[w].nbytes / (grid.ep * grid.etp)
                    else:
                        dense += T[w].nbytes / (grid.tp if w in self.split_weights else 1)
            self.stage_held.append((dense, expert))

    def _cut(self, M: int, stages: list):
        """The pipeline mode's cut (stage p's GPUs as one, at a replica's batch): balanced
        by time, or at the forward positions `stages`."""
        grid = self.grid
        return StageCut(
            self.trace,
            self.model,
            [self.gpus[c % grid.pp * grid.s] for c in range(self.chunks)],
            PipelineOptions(microbatches=M, stages=stages),
            batch_size=self.per_gpu_batch(grid.dp),
            gpu=self.gpu,
            graph=self.graph,
            host=self.host,
        )

    def _whole_moe_layers(self, starts: list) -> list:
        """Stage starts (forward positions) with a cut inside an MoE layer's routed experts
        moved to just after them: the dispatch and combine of a layer run on one stage's EP
        group (Megatron-Core cuts between transformer layers)."""
        fwd = self.ops("forward")
        span: dict = {}
        for k, op in enumerate(fwd):
            if op.id in self.expert_ops:
                span.setdefault(op.layer, [k, k])[1] = k
        moved = [next((b + 1 for a, b in span.values() if a < s <= b), s) for s in starts]
        if any(b <= a for a, b in zip(moved, moved[1:], strict=False)) or moved[-1] >= len(fwd):
            raise ConfigError(
                "parallelism.pp",
                self.grid.pp,
                f"at most as many stages as the model has cuts outside its MoE layers' "
                f"experts (stage starts {starts} would become {moved} of {len(fwd)} "
                f"forward operators)",
            )
        return moved

    def _make_stage_buckets(self, share) -> None:
        """dp_overlap: each stage's gradient buckets (mode ep's, of the stage's weights),
        signalled after the operator completing them in the stage's last micro-batch's
        backward; one whose operator is not the stage's (`stage_unfired`) after the
        schedule."""
        o, ops = self.options, self.trace.operators
        self.stage_buckets, self.stage_unfired = [], []
        for p, weights in enumerate(self.stage_weights):
            made = ep_buckets.buckets(
                self.trace,
                self.expert_weights,
                self.ep,
                o.first_bucket_size,
                o.bucket_size,
                share,
                only=weights,
            )
            mine = {
                op.id for c in range(p, self.chunks, self.grid.pp) for op in self.pipe.bwd_ops[c]
            }
            self.stage_buckets.append(made)
            self.stage_unfired.append([])
            for k, (pos, _, _) in enumerate(made):
                if ops[pos].id in mine:
                    self.signals_after.setdefault(ops[pos].id, []).append(k)
                else:
                    self.stage_unfired[-1].append(k)

    def _send_ratio(self) -> float:
        """A micro-batch's share of the traced boundary bytes on one GPU: its replica's
        micro-batch, 1/tp of the sequence (sequence parallel)."""
        return self.pipe._mb_ratio() / self.grid.tp

    def _pipeline_compute(self, gpu):
        i = self.gpus.index(gpu)
        grid, pp, C = self.grid, self.grid.pp, self.chunks
        p, j, loc = grid.stage(i), grid.expert(i)[1], i % grid.s
        for kind, m, jj in self.orders[p]:
            c = jj * pp + p  # the model chunk of this step
            if kind == "F" and c > 0:
                src = self.gpus[grid.pp_peer(i, (c - 1) % pp)]
                yield Recv(src, f"l{loc}/act{c - 1}.{m}", phase="forward")
            elif kind == "B" and c < C - 1:
                src = self.gpus[grid.pp_peer(i, (c + 1) % pp)]
                yield Recv(src, f"l{loc}/grad{c + 1}.{m}", phase="backward")
            yield from self._tasks(gpu, self._template(j, m, (c, kind)), m)
            yield Signal(f"{gpu}:{kind}{m}.{c}")
        yield Wait(f"{gpu}:send_fwd done")
        yield Wait(f"{gpu}:send_bwd done")
        if self.tpx is not None:  # sequence-parallel weights' gradients (TP group)
            group = self._ring_order(self.gpus[k] for k in grid.tp_group(i))
            key = f"s{p}r{grid.dense(i)[1]}:grads"
            for op in self.ops("optimizer"):
                for c in self.tpx.before.get(op.id, ()):
                    yield Collective(
                        c.op, group, c.nbytes, f"{key}/{c.key}", c.layer, c.phase, c.algorithm
                    )
        yield from self._step(gpu)

    def _pipeline_sends(self, gpu, kinds: str, name: str):
        """The activations (kinds "F") or gradients ("B") this GPU passes on, each once its
        schedule step is done."""
        i = self.gpus.index(gpu)
        grid = self.grid
        p = grid.stage(i)
        yield from chunk_sends(
            gpu,
            self.orders[p],
            kinds,
            p,
            grid.pp,
            self.pipe.boundary,
            self._send_ratio(),
            lambda q: self.gpus[grid.pp_peer(i, q)],
            f"l{i % grid.s}",
            name,
        )
