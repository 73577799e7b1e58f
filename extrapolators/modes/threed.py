"""3D parallelism: data x tensor x pipeline parallelism on a process grid (Megatron-LM's).

The N GPUs form a grid of dp x pp x tp (product N). `placement` maps grid positions
(d, p, t) onto GPU ids: `tp-pp-dp` (default) puts TP innermost (consecutive ids, e.g. one
NVSwitch node), then PP, then DP; `dp-pp-tp` the reverse; or a list of the N GPU ids in
tp-pp-dp grid order (position d * pp * tp + p * tp + t).

The existing modes are composed, not rewritten:
  - the pipeline mode (`GPipe`) cuts the forward operators into pp x v chunks (v =
    `virtual_stages`, 1 unless the schedule is interleaved); stage p holds chunks p, p + pp,
    ...; a chunk's backward operators follow its forward ones;
  - the tensor-parallel mode (`TensorParallel`, Megatron roles and collectives) runs every
    chunk's operators on the stage's TP group at the micro-batch size; its collectives run
    within that group (each group its own key), on the compute stream;
  - a schedule (extrapolators.modes.schedules: gpipe, 1f1b, interleaved, or one registered) orders
    each stage's (F|B, micro-batch, chunk) steps; activations and gradients go between the
    corresponding TP ranks of the stages holding consecutive chunks, on send_fwd/send_bwd
    streams (each TP rank sends the whole activation; 1/tp of it with sequence_parallel);
  - data parallelism: the GPUs at the same (p, t) in every replica all-reduce the gradients
    they hold on their "dp" stream. With `dp_overlap` (default) as DDP: bucketed (PyTorch's
    caps) in the order the stage's last micro-batch backward produces them, each bucket
    reduced as soon as it is ready, overlapping the rest of the backward; otherwise one
    all-reduce after the whole backward, as the dp mode.
Every collective and send goes through the one network, so groups contend where they
share links. Each GPU's optimizer step touches the weights it holds: its chunks' weights,
the TP-split ones 1/tp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from extrapolators.execution.symmetry import Symmetry
from extrapolators.execution.tasks import Collective, ComputeRun, Recv, Send, Signal, Wait
from extrapolators.modes.base import Extrapolator, gradient_ready
from extrapolators.modes.pipeline import GPipe, PipelineOptions
from extrapolators.modes.schedules import schedule
from extrapolators.modes.tensor_parallel import SHARDED, SPLIT, TensorParallel, TPOptions
from triosim.common.errors import ConfigError
from triosim.common.schema import option


class _TensorParallel(TensorParallel):
    """A 3D grid's tensor-parallel plan: its degree is parallelism.tp."""

    degree_field = "parallelism.tp"


@dataclass(frozen=True)
class ThreeDOptions:
    dp: int = option(1, ge=1, help="data-parallel degree (replicas)")
    tp: int = option(1, ge=1, help="tensor-parallel degree (GPUs per stage)")
    pp: int = option(0, ge=0, help="pipeline-parallel degree (stages); 0: num_gpus / (dp x tp)")
    microbatches: int = option(1, ge=1, help="micro-batches each replica's batch is split into")
    schedule: str = option(
        "1f1b",
        help="pipeline schedule: gpipe, 1f1b, interleaved (or one "
        "registered in extrapolators.modes.schedules)",
    )
    virtual_stages: int = option(1, ge=1, help="model chunks per pipeline stage (interleaved)")
    placement: list[int | str] | str = option(
        "tp-pp-dp",
        help="grid onto GPUs: tp-pp-dp (TP innermost), dp-pp-tp (DP innermost), or the GPU "
        "ids in tp-pp-dp grid order",
    )
    dp_overlap: bool = option(
        True,
        help="bucketed gradient all-reduce overlapping backward "
        "(DDP); false: one all-reduce after backward",
    )
    bucket_size: float = option(25 * 2**20, unit="bytes", gt=0, help="gradient bucket cap")
    first_bucket_size: float = option(2**20, unit="bytes", gt=0, help="the first bucket's cap")
    tp_style: Literal["megatron", "channel"] = option("megatron", help="as mode tp")
    sequence_parallel: bool = option(False, help="as mode tp")


class ThreeD(Extrapolator):
    name = "3d"
    Options = ThreeDOptions

    # -- the grid ----------------------------------------------------------------------------
    def check(self):
        o, n = self.options, len(self.gpus)
        dp, tp = o.dp, o.tp
        if n % (dp * tp):
            raise ConfigError(
                "parallelism.dp", dp, f"dp x tp ({dp} x {tp}) dividing num_gpus ({n})"
            )
        pp = o.pp or n // (dp * tp)
        if dp * tp * pp != n:
            raise ConfigError(
                "parallelism.pp", o.pp, f"dp x tp x pp = num_gpus ({n}); dp = {dp}, tp = {tp}"
            )
        self.dp, self.tp, self.pp, self.v = dp, tp, pp, o.virtual_stages
        if self.v > 1 and pp < 2:
            raise ConfigError(
                "parallelism.virtual_stages",
                self.v,
                "1 without pipeline stages (pp >= 2 to interleave)",
            )
        self.grid = self._place()
        self.coord = {g: (d, p, t) for (d, p, t), g in self.grid.items()}
        self.order_of = schedule(o.schedule)
        self.orders = [self.order_of(p, pp, o.microbatches, self.v) for p in range(pp)]
        M = o.microbatches
        self.micro = self.per_gpu_batch(dp * M)
        rep_batch = self.per_gpu_batch(dp)
        C = pp * self.v
        # the pipeline mode cuts the model into C chunks (chunk c on stage c % pp)
        chain = [self.grid[0, c % pp, 0] for c in range(C)]
        self.pipe = GPipe(
            self.trace,
            self.model,
            chain,
            PipelineOptions(microbatches=M),
            batch_size=rep_batch,
            gpu=self.gpu,
            graph=self.graph if pp > 1 and self.v == 1 else None,
        )
        group0 = [self.grid[0, 0, t] for t in range(tp)]
        self.tpx = _TensorParallel(
            self.trace,
            self.model,
            group0,
            TPOptions(o.tp_style, o.sequence_parallel),
            batch_size=self.micro,
            gpu=self.gpu,
        )
        self._held()
        self._buckets = {p: self._make_buckets(p) for p in range(pp)} if o.dp_overlap else {}

    def _place(self) -> dict:
        o, dp, tp, pp = self.options, self.dp, self.tp, self.pp
        pl = o.placement
        grid = {}
        if isinstance(pl, list):
            if sorted(map(str, pl)) != sorted(map(str, self.gpus)) or len(set(pl)) != len(pl):
                raise ConfigError(
                    "parallelism.placement",
                    pl,
                    f"a list of the {len(self.gpus)} GPU ids, each once",
                )
            by_name = {str(g): g for g in self.gpus}
            ids = [by_name[str(x)] for x in pl]
            for d in range(dp):
                for p in range(pp):
                    for t in range(tp):
                        grid[d, p, t] = ids[d * pp * tp + p * tp + t]
        elif pl == "tp-pp-dp":
            for d in range(dp):
                for p in range(pp):
                    for t in range(tp):
                        grid[d, p, t] = self.gpus[d * pp * tp + p * tp + t]
        elif pl == "dp-pp-tp":
            for d in range(dp):
                for p in range(pp):
                    for t in range(tp):
                        grid[d, p, t] = self.gpus[t * pp * dp + p * dp + d]
        else:
            raise ConfigError(
                "parallelism.placement", pl, "tp-pp-dp, dp-pp-tp or a list of GPU ids"
            )
        return grid

    def _ring(self, members) -> tuple:
        """`members` in the topology's ring order (by their positions in it: O(group), not
        a pass over the whole ring per group)."""
        at = self.__dict__.get("_ring_at")
        if at is None:
            at = self._ring_at = {}
            for i, g in enumerate(self.ring):
                at.setdefault(g, i)
        if len(at) != len(self.ring):  # a GPU twice in the ring: the pass takes it twice
            s = set(members)
            return tuple(g for g in self.ring if g in s)
        return tuple(sorted({g for g in members if g in at}, key=at.__getitem__))

    def tp_group(self, d, p) -> tuple:
        """The tuple is built once per group: its members share it (and the runtime
        compares a collective's group by identity first)."""
        groups = self.__dict__.setdefault("_tp_groups", {})
        g = groups.get((d, p))
        if g is None:
            g = groups[d, p] = self._ring(self.grid[d, p, t] for t in range(self.tp))
        return g

    def dp_group(self, p, t) -> tuple:
        groups = self.__dict__.setdefault("_dp_groups", {})
        g = groups.get((p, t))
        if g is None:
            g = groups[p, t] = self._ring(self.grid[d, p, t] for d in range(self.dp))
        return g

    def pp_chain(self, d, t) -> list:
        return [self.grid[d, p, t] for p in range(self.pp)]

    def symmetry(self) -> Symmetry:
        """The GPUs of data-parallel replica 0 represent the others, replica d mapped by grid
        position: its TP groups are `_ring` of the mapped members (as `tp_group`), its
        pipeline sends go between the mapped stages, and each DP group (one GPU per replica)
        is a whole class."""
        replicas = [
            [self.grid[d, p, t] for p in range(self.pp) for t in range(self.tp)]
            for d in range(self.dp)
        ]
        coord, grid = self.coord, self.grid

        def image_group(group, k):
            return self._ring(grid[k, coord[g][1], coord[g][2]] for g in group)

        return Symmetry.of_replicas(replicas, image_group)

    # -- weights -----------------------------------------------------------------------------
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

    def op_batch(self):
        return self.micro

    def activation_ratio(self, op) -> float:
        return self.tpx.activation_ratio(op)

    def buffer_bytes(self, gpu) -> float:
        return sum(size for _, size in self._buckets.get(self.coord[gpu][1], ()))

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

    # -- streams -----------------------------------------------------------------------------
    def streams(self):
        out = {}
        for g, (d, p, t) in self.coord.items():
            out[(g, "compute")] = self._compute(d, p, t)
            out[(g, "send_fwd")] = self._sends(d, p, t, "F", "send_fwd")
            out[(g, "send_bwd")] = self._sends(d, p, t, "B", "send_bwd")
            out[(g, "dp")] = self._reduce(d, p, t)
        return out

    def _op_tasks(self, op, d, p, m, group):
        """One operator at the micro-batch on the TP group: Megatron's collectives around it
        (re-grouped and re-keyed for this group and micro-batch), at its shard's time."""
        tpx, n = self.tpx, self.tp
        comm = n > 1
        if comm:
            for c in tpx.before.get(op.id, ()):
                yield dataclasses.replace(c, group=group, key=f"d{d}p{p}m{m}/{c.key}")
        role = tpx.roles.get(op.id)
        split, whole = self.target(self.micro, tp=n), self.target(self.micro)
        if role in SHARDED:
            yield self.compute(op, split, 1.0 if op.tp_split else 1.0 / n, mb=m)
        elif op.tp_split and (role in SPLIT or op.id in tpx._orphan_ids):
            yield self.compute(op, split, mb=m)
        else:
            yield self.compute(op, whole, mb=m)
        if comm:
            for c in tpx.after.get(op.id, ()):
                yield dataclasses.replace(c, group=group, key=f"d{d}p{p}m{m}/{c.key}")

    def _compute(self, d, p, t):
        if self.compute_runs:
            return self._compute_from_template(d, p, t)
        return self._compute_per_op(d, p, t)

    # the template of a stage's compute stream: ComputeRuns (shared by every GPU of the
    # stage) and, for the tasks that name a GPU, a tag and the key's stage-wide suffix
    _COLL, _RECV, _SIGNAL, _WAIT = range(4)

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
        split, whole = self.target(self.micro, tp=n), self.target(self.micro)

        def op_tasks(op, m):
            if comm:
                for c in tpx.before.get(op.id, ()):
                    other((self._COLL, c, f"p{p}m{m}/{c.key}"))
            role = tpx.roles.get(op.id)
            if role in SHARDED:
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
            else:
                yield Wait(gk + item[1])
        slot[0] -= 1
        if not slot[0]:  # the last running rank: free the shared tasks
            del users[(d, p)]

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
        total = self.trace.weight_bytes()
        return self.stage_bytes[p] / total if total else 1.0 / (self.pp * self.tp)

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
                    yield from self._op_tasks(op, d, p, m, group)
            else:
                if c < C - 1:
                    src = self.grid[d, (c + 1) % S, t]
                    yield Recv(src, f"d{d}t{t}/grad{c + 1}.{m}", phase="backward")
                final = last_b[j] == step
                for op in self.pipe.bwd_ops[c]:
                    yield from self._op_tasks(op, d, p, m, group)
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

    def _op_tasks_opt(self, op, d, p, group, full, scale):
        if self.tp > 1:  # sequence parallelism reduces the partial weight gradients here
            for c in self.tpx.before.get(op.id, ()):
                yield dataclasses.replace(c, group=group, key=f"d{d}p{p}/{c.key}")
        yield self.compute(op, full, scale)

    def _sends(self, d, p, t, kinds, name):
        g, S, C = self.grid[d, p, t], self.pp, self.pp * self.v
        ratio = self.pipe._mb_ratio() / (self.tp if self.options.sequence_parallel else 1)
        for kind, m, j in self.orders[p]:
            if kind != kinds:
                continue
            c = j * S + p
            yield Wait(f"{g}:{kind}{m}.{c}")
            if kind == "F" and c < C - 1:
                dst = self.grid[d, (c + 1) % S, t]
                nbytes = self.pipe.boundary[c] * ratio
                yield Send(dst, nbytes, f"d{d}t{t}/act{c}.{m}", phase="forward")
            elif kind == "B" and c > 0:
                dst = self.grid[d, (c - 1) % S, t]
                nbytes = self.pipe.boundary[c - 1] * ratio
                yield Send(dst, nbytes, f"d{d}t{t}/grad{c}.{m}", phase="backward")
        yield Signal(f"{g}:{name} done")

    def _reduce(self, d, p, t):
        g = self.grid[d, p, t]
        peers = self.dp_group(p, t)
        if self.options.dp_overlap:
            for k, (_, size) in enumerate(self._buckets[p]):
                yield Wait(f"{g}:bucket{k}")
                if len(peers) > 1:
                    yield Collective(
                        "allreduce",
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
                    "allreduce",
                    peers,
                    self.stage_bytes[p],
                    f"dp:p{p}t{t}",
                    layer="gradients",
                    phase="backward",
                    algorithm=self.collective,
                )
        yield Signal(f"{g}:reduced")


@dataclass(frozen=True)
class InterleavedOptions(ThreeDOptions):
    schedule: str = option("interleaved", help="pipeline schedule (default: interleaved)")
    virtual_stages: int = option(2, ge=1, help="model chunks per pipeline stage")


class Interleaved(ThreeD):
    """Megatron's interleaved 1F1B (virtual pipeline): `3d` with schedule 'interleaved' and
    `virtual_stages` chunks per stage (by default all GPUs are pipeline stages)."""

    name = "interleaved"
    Options = InterleavedOptions
