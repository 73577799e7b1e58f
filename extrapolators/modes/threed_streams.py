"""3D parallelism's streams: each GPU's compute, send and data-parallel reduce streams.

`ThreeDStreams` is a part of `ThreeD` (its mixin). What it provides: `streams()`, for every
GPU a "compute" stream (its stage's schedule of forward and backward steps, each chunk's
operators with their tensor-parallel collectives, receives of activations and gradients,
signals for the send streams and the gradient buckets, then the optimizer), "send_fwd" and
"send_bwd" streams (a step's activations or gradients to the next stage, once the compute
stream signals the step done), a "dp" stream (the gradient all-reduces; with the distributed
optimizer reduce-scatters, then the parameters' all-gather after the step) and, with ring
attention (cp > 1), a "cp" stream (its key/value blocks, in the schedule's order). Two ways give
the same tasks: from a template built once per stage (`compute_runs`, ComputeRuns shared by
every GPU of the stage) or one task per operator.
What it needs: the grid (threed_grid.ThreeDGrid), the buckets and held bytes
(threed_buckets.StageBuckets), `orders` (each stage's (F|B, micro-batch, chunk) steps),
`pipe` (the chunks' operators and boundary bytes), `tpx` (the TP roles and collectives),
`micro` (the micro-batch per GPU), and of `Extrapolator`: `options`, `trace`, `target`,
`compute`, `ops`, `per_gpu_batch`, `collective` and `compute_runs`.
"""

from __future__ import annotations

import dataclasses

from extrapolators.execution.tasks import Collective, ComputeRun, Recv, Signal, Wait
from extrapolators.modes.cp_attention import ring_compute, ring_sends, ulysses
from extrapolators.modes.cp_plan import kv_block_bytes, ulysses_bytes
from extrapolators.modes.dist_optimizer import grad_reduction, param_gather
from extrapolators.modes.pipeline_sends import chunk_sends
from extrapolators.modes.tp_roles import SHARDED, SPLIT


class ThreeDStreams:
    """The streams of a 3D plan (module docstring: what it gives, what it needs)."""

    # the template of a stage's compute stream: ComputeRuns (shared by every GPU of the
    # stage) and, for the tasks that name a GPU, a tag and the key's stage-wide suffix
    _COLL, _RECV, _SIGNAL, _WAIT, _ATTN = range(5)

    def streams(self):
        out = {}
        for g, (d, p, t) in self.coord.items():
            out[(g, "compute")] = self._compute(d, p, t)
            out[(g, "send_fwd")] = self._sends(d, p, t, "F", "send_fwd")
            out[(g, "send_bwd")] = self._sends(d, p, t, "B", "send_bwd")
            out[(g, "dp")] = self._reduce(d, p, t)
            if self.cp > 1 and self.options.cp_comm == "p2p":
                out[(g, "cp")] = self._cp_sends(d, p, t)
        return out

    def _compute(self, d, p, t):
        if self.compute_runs:
            return self._compute_from_template(d, p, t)
        return self._compute_per_op(d, p, t)

    def _template(self, p) -> list:
        """Stage p's compute stream as `_compute_per_op` yields it, with the computes
        between two other tasks as one ComputeRun (the same Compute tasks, in the same
        order) and the other tasks as (tag, ...) with their keys' GPU-independent parts:
        built once per stage instead of walking the operators for every GPU."""
        cache = self.__dict__.setdefault("_templates", {})
        items = cache.get(p)
        if items is not None:
            return items
        items, run = [], []

        def other(item):
            if run:
                items.append(ComputeRun(run))
                run.clear()
            items.append(item)

        S, C = self.pp, self.pp * self.v
        tpx, n = self.tpx, self.tp
        comm = n > 1
        split, whole = self.target(self.op_micro, tp=n), self.target(self.op_micro)

        def op_tasks(op, m):
            if comm:
                for c in tpx.before.get(op.id, ()):
                    other((self._COLL, c, f"p{p}m{m}/{c.key}"))
            role = tpx.roles.get(op.id)
            if op.id in self._attention:  # context parallelism: across the CP group
                other((self._ATTN, op, self._attention_step(op, split, whole, m), m))
            elif role in SHARDED:
                run.append(self.compute(op, split, 1.0 if op.tp_split else 1.0 / n, mb=m))
            elif op.tp_split and (role in SPLIT or op.id in tpx._orphan_ids):
                run.append(self.compute(op, split, mb=m))
            else:
                run.append(self.compute(op, whole, mb=m))
            if comm:
                for c in tpx.after.get(op.id, ()):
                    other((self._COLL, c, f"p{p}m{m}/{c.key}"))

        order, last_b, pos, by_pos, n_buckets = self._bucket_plan(p)
        fired = set()
        for step, (kind, m, j) in enumerate(order):
            c = j * S + p
            if kind == "F":
                if c > 0:
                    other((self._RECV, (c - 1) % S, f"act{c - 1}.{m}", "forward"))
                for op in self.pipe.fwd_ops[c]:
                    op_tasks(op, m)
            else:
                if c < C - 1:
                    other((self._RECV, (c + 1) % S, f"grad{c + 1}.{m}", "backward"))
                final = last_b[j] == step
                for op in self.pipe.bwd_ops[c]:
                    op_tasks(op, m)
                    if final:
                        for k in by_pos.get(pos[op.id], ()):
                            fired.add(k)
                            other((self._SIGNAL, f"bucket{k}"))
            other((self._SIGNAL, f"{kind}{m}.{c}"))
        for k in range(n_buckets):
            if k not in fired:
                other((self._SIGNAL, f"bucket{k}"))
        other((self._WAIT, "send_fwd done"))
        other((self._WAIT, "send_bwd done"))
        if not self.options.dp_overlap:
            other((self._SIGNAL, "grads"))
        other((self._WAIT, "reduced"))
        full = self.target(self.per_gpu_batch(self.dp), tp=self.tp)
        scale = self._optimizer_scale(p)
        for op in self.ops("optimizer"):
            if self.tp > 1:
                for c in self.tpx.before.get(op.id, ()):
                    other((self._COLL, c, f"p{p}/{c.key}"))
            run.append(self.compute(op, full, scale))
        if self.options.distributed_optimizer:  # the updated shards come back (dp stream)
            other((self._SIGNAL, "stepped"))
            other((self._WAIT, "params"))
        if run:
            items.append(ComputeRun(run))
        cache[p] = items
        return items

    def _compute_from_template(self, d, p, t):
        """`_compute_per_op`'s tasks from stage p's template: the shared runs as they are,
        the other tasks completed with this GPU's names (the same keys, groups, peers).
        A collective is the same task for every rank of the tensor-parallel group (its
        group and key do not name the rank): built by the first rank to reach it and
        shared while any rank's stream of (d, p) is running."""
        g, grid = self.grid[d, p, t], self.grid
        group = self.tp_group(d, p)
        gk, dk, dt = f"{g}:", f"d{d}", f"d{d}t{t}/"
        COLL, RECV, SIGNAL = self._COLL, self._RECV, self._SIGNAL
        template = self._template(p)
        users = self.__dict__.setdefault("_shared_colls", {})
        slot = users.get((d, p))
        if slot is None:
            slot = users[(d, p)] = [0, [None] * len(template)]
        slot[0] += 1
        shared = slot[1]
        for i, item in enumerate(template):
            if type(item) is ComputeRun:
                yield item
                continue
            tag = item[0]
            if tag == COLL:
                task = shared[i]
                if task is None:
                    c = item[1]
                    task = shared[i] = Collective(
                        c.op, group, c.nbytes, dk + item[2], c.layer, c.phase, c.algorithm, c.root
                    )
                yield task
            elif tag == RECV:
                yield Recv(grid[d, item[1], t], dt + item[2], phase=item[3])
            elif tag == SIGNAL:
                yield Signal(gk + item[1])
            elif tag == self._ATTN:
                yield from self._attend(d, p, t, *item[1:])
            else:
                yield Wait(gk + item[1])
        slot[0] -= 1
        if not slot[0]:  # the last running rank: free the shared tasks
            del users[(d, p)]

    def _compute_per_op(self, d, p, t):
        """One task per operator (the straightforward path: `compute_runs = False`)."""
        g, S, C = self.grid[d, p, t], self.pp, self.pp * self.v
        group = self.tp_group(d, p)
        order, last_b, pos, by_pos, n_buckets = self._bucket_plan(p)
        fired = set()
        for step, (kind, m, j) in enumerate(order):
            c = j * S + p
            if kind == "F":
                if c > 0:
                    src = self.grid[d, (c - 1) % S, t]
                    yield Recv(src, f"d{d}t{t}/act{c - 1}.{m}", phase="forward")
                for op in self.pipe.fwd_ops[c]:
                    yield from self._op_tasks(op, d, p, m, group, t)
            else:
                if c < C - 1:
                    src = self.grid[d, (c + 1) % S, t]
                    yield Recv(src, f"d{d}t{t}/grad{c + 1}.{m}", phase="backward")
                final = last_b[j] == step
                for op in self.pipe.bwd_ops[c]:
                    yield from self._op_tasks(op, d, p, m, group, t)
                    if final:
                        for k in by_pos.get(pos[op.id], ()):
                            fired.add(k)
                            yield Signal(f"{g}:bucket{k}")
            yield Signal(f"{g}:{kind}{m}.{c}")
        for k in range(n_buckets):  # gradients no backward operator of this stage made
            if k not in fired:
                yield Signal(f"{g}:bucket{k}")
        yield Wait(f"{g}:send_fwd done")
        yield Wait(f"{g}:send_bwd done")
        if not self.options.dp_overlap:  # after the whole schedule, as the hybrid mode
            yield Signal(f"{g}:grads")
        yield Wait(f"{g}:reduced")
        full = self.target(self.per_gpu_batch(self.dp), tp=self.tp)
        scale = self._optimizer_scale(p)
        for op in self.ops("optimizer"):
            yield from self._op_tasks_opt(op, d, p, group, full, scale)
        if self.options.distributed_optimizer:
            yield Signal(f"{g}:stepped")
            yield Wait(f"{g}:params")

    def _op_tasks(self, op, d, p, m, group, t=0):
        """One operator at the micro-batch on the TP group: Megatron's collectives around it
        (re-grouped and re-keyed for this group and micro-batch), at its shard's time."""
        tpx, n = self.tpx, self.tp
        comm = n > 1
        if comm:
            for c in tpx.before.get(op.id, ()):
                yield dataclasses.replace(c, group=group, key=f"d{d}p{p}m{m}/{c.key}")
        role = tpx.roles.get(op.id)
        split, whole = self.target(self.op_micro, tp=n), self.target(self.op_micro)
        if op.id in self._attention:  # context parallelism: across the CP group
            yield from self._attend(d, p, t, op, self._attention_step(op, split, whole, m), m)
        elif role in SHARDED:
            yield self.compute(op, split, 1.0 if op.tp_split else 1.0 / n, mb=m)
        elif op.tp_split and (role in SPLIT or op.id in tpx._orphan_ids):
            yield self.compute(op, split, mb=m)
        else:
            yield self.compute(op, whole, mb=m)
        if comm:
            for c in tpx.after.get(op.id, ()):
                yield dataclasses.replace(c, group=group, key=f"d{d}p{p}m{m}/{c.key}")

    # -- context parallelism (cp > 1): attention across the CP group ---------------------------
    def _attention_step(self, op, split, whole, m):
        """One ring step of attention `op` (1/cp of the GPU's attention), or the whole of it
        (Ulysses), at its TP role's shard as any operator (mode cp with tp)."""
        scale = 1 / self.cp if self.options.cp_comm == "p2p" else 1.0
        role = self.tpx.roles.get(op.id)
        if role in SHARDED:
            s = scale if op.tp_split else scale / self.tp
            return self.compute(op, split, s, mb=m)
        if op.tp_split and (role in SPLIT or op.id in self.tpx._orphan_ids):
            return self.compute(op, split, scale, mb=m)
        return self.compute(op, whole, scale, mb=m)

    def _cp_tag(self, d, p, t, op, phase, m) -> str:
        return f"cp{d // self.cp}p{p}t{t}:{m}:{op.id}:{phase}"

    def _cp_ratio(self) -> float:
        """The GPU's share of the trace's batch-sized tensors: its tokens of a micro-batch."""
        return self.op_micro / self.trace.batch_size

    def _attend(self, d, p, t, op, step, m):
        """The compute stream's tasks of one attention operator on slot d's GPU at (p, t):
        ring attention's steps with their receives, or Ulysses' all-to-alls around it
        (cp_attention.py)."""
        g, group = self.grid[d, p, t], self.cp_group(d, p, t)
        tag, forward = self._cp_tag(d, p, t, op, step.phase, m), op.phase == "forward"
        if self.options.cp_comm == "p2p":
            yield from ring_compute(g, group, step, tag, forward)
            return
        a = self._attention[op.id]
        qkv, out = ulysses_bytes(self.trace, a, self._cp_ratio(), self.tp)
        before, after = (qkv, out) if forward else (out, qkv)
        yield from ulysses(group, step, before, after, tag, self.collective)

    def _cp_sends(self, d, p, t):
        """Ring attention's sends of slot d's GPU at (p, t), in the order its compute stream
        reaches the attention operators (its stage's schedule)."""
        g, group, S = self.grid[d, p, t], self.cp_group(d, p, t), self.pp
        ratio = self._cp_ratio()
        for kind, m, j in self.orders[p]:
            c = j * S + p
            for op in self.pipe.fwd_ops[c] if kind == "F" else self.pipe.bwd_ops[c]:
                a = self._attention.get(op.id)
                if a is None:
                    continue
                nbytes = kv_block_bytes(self.trace, a, ratio, self.tp)
                tag = self._cp_tag(d, p, t, op, op.phase, m)
                yield from ring_sends(
                    g, group, nbytes, tag, op.phase == "forward", op.layer, op.phase
                )

    def _op_tasks_opt(self, op, d, p, group, full, scale):
        if self.tp > 1:  # sequence parallelism reduces the partial weight gradients here
            for c in self.tpx.before.get(op.id, ()):
                yield dataclasses.replace(c, group=group, key=f"d{d}p{p}/{c.key}")
        yield self.compute(op, full, scale)

    def _sends(self, d, p, t, kinds, name):
        ratio = self.pipe._mb_ratio() / (self.tp if self.options.sequence_parallel else 1)
        if self.cp > 1:  # each CP rank passes on its tokens' activations
            ratio /= self.cp
        yield from chunk_sends(
            self.grid[d, p, t],
            self.orders[p],
            kinds,
            p,
            self.pp,
            self.pipe.boundary,
            ratio,
            lambda q: self.grid[d, q, t],
            f"d{d}t{t}",
            name,
        )

    def _reduce(self, d, p, t):
        """The "dp" stream: the stage's gradients reduced over its dp x cp GPUs at (p, t),
        in buckets or at once; with the distributed optimizer reduce-scattered, and the
        updated shard all-gathered once the compute stream has stepped."""
        g = self.grid[d, p, t]
        peers = self.dp_group(p, t)
        distopt = self.options.distributed_optimizer
        kind = grad_reduction(distopt)
        if self.options.dp_overlap:
            for k, (_, size) in enumerate(self._buckets[p]):
                yield Wait(f"{g}:bucket{k}")
                if len(peers) > 1:
                    yield Collective(
                        kind,
                        peers,
                        size,
                        f"dp:p{p}t{t}:bucket{k}",
                        layer=f"bucket{k}",
                        phase="backward",
                        algorithm=self.collective,
                    )
        else:
            yield Wait(f"{g}:grads")
            if len(peers) > 1:
                yield Collective(
                    kind,
                    peers,
                    self.stage_bytes[p],
                    f"dp:p{p}t{t}",
                    layer="gradients",
                    phase="backward",
                    algorithm=self.collective,
                )
        yield Signal(f"{g}:reduced")
        if distopt:
            yield Wait(f"{g}:stepped")
            c = param_gather(peers, self.stage_bytes[p], f"distopt:p{p}t{t}", self.collective)
            if c is not None:
                yield c
            yield Signal(f"{g}:params")
