"""`mode: mesh`: parallelism written as a device mesh (dims.py): pipeline stages x data-
parallel replicas x sharded data parallelism x context parallelism x tensor parallelism,
e.g. `parallelism: {mode: mesh, pp: 16, dp_shard: 32, tp: 8, schedule: interleaved}`.

One plan per dimension, each checked here against the trace before any simulation:
  - PP: the model cut into pp x virtual_stages chunks (the pipeline mode's balanced cut,
    pipeline.StageCut), chunk k on stage k % pp, each stage's schedule (schedules.py); with
    one stage the schedule is gradient accumulation over `microbatches`;
  - TP: Megatron's roles and collectives on each chunk's operators at the GPU's tokens
    (tensor_parallel.py), over the GPU's TP group;
  - CP: the attention operators across the CP group (cp_plan.py, cp_attention.py: ring
    attention or Ulysses), every other operator on the GPU's 1/cp of the tokens;
  - DP: the stage's weights (weights.py) reduced over the data-parallel group (the
    dp_replicate x dp_shard x cp GPUs at the GPU's stage and TP rank) in DDP's buckets,
    or by Megatron's distributed optimizer, or ZeRO-1/2 over dp_shard; with dp_shard > 1
    and zero 3, FSDP2 per unit (sharding.py) over dp_shard x cp, HSDP with dp_replicate;
  - recomputation per block (blocks.with_recompute) inside each chunk's backward pass.
template.py lays out a stage's compute stream once, streams.py gives every GPU its
streams; memory (what a GPU holds) and symmetry (representative replicas) are here.

A GPU's batch: the global batch over dp_replicate x dp_shard replicas, over `microbatches`,
and each CP rank 1/cp of its tokens (in sequences' worth). Its optimizer step touches what
it holds: its stage's TP shard, 1/(dp_shard x cp) of it with FSDP or ZeRO, 1/(dp_replicate
x cp) with the distributed optimizer.
"""

from __future__ import annotations

from extrapolators.execution.symmetry import Symmetry
from extrapolators.modes import dist_optimizer
from extrapolators.modes.base import Extrapolator
from extrapolators.modes.blocks import layer_units, with_recompute
from extrapolators.modes.cp_plan import plan_attention
from extrapolators.modes.dist_optimizer import grad_reduction
from extrapolators.modes.mesh.dims import DIMS, REP, SHARD, TP, Layout, parse_order, resolve
from extrapolators.modes.mesh.options import MeshOptions
from extrapolators.modes.mesh.sharding import ShardPlan
from extrapolators.modes.mesh.streams import MeshStreams
from extrapolators.modes.mesh.weights import StageWeights
from extrapolators.modes.pipeline import PipelineOptions, StageCut
from extrapolators.modes.schedules import schedule
from extrapolators.modes.tensor_parallel import TensorParallel, TPOptions
from triosim.common.errors import ConfigError


class _TensorParallel(TensorParallel):
    """The mesh's TP plan: its degree is parallelism.tp."""

    degree_field = "parallelism.tp"


class MeshMode(Extrapolator):
    """The mode (module docstring)."""

    name = "mesh"
    Options = MeshOptions
    fields: dict = {}  # a mesh field -> the preset's field that sets it, for messages
    # a stage's activations and gradients leave on two streams, so a large activation send
    # never holds back a gradient send (and the reverse); False: one FIFO "comm" stream
    split_send_streams = True

    def send_streams(self) -> list[tuple[str, str]]:
        """(stream name, the step kinds it sends) of a pipeline stage."""
        if self.split_send_streams:
            return [("send_fwd", "F"), ("send_bwd", "B")]
        return [("comm", "FB")]

    def mesh_options(self, n: int) -> MeshOptions:
        """The mesh's fields for n GPUs: the general form's own; a preset fills them in."""
        return self.options

    def check(self):
        try:
            self._check()
        except ConfigError as e:
            field = self.fields.get(e.field)
            if field is None:
                raise
            raise ConfigError(field, e.value, e.allowed) from None

    def _check(self):
        n = len(self.gpus)
        self.preset = self.options
        o = self.options = self.mesh_options(n)
        mesh = resolve(n, o.pp, o.dp_replicate, o.dp_shard, o.cp, o.tp)
        placement = None
        if isinstance(o.order, list):
            placement = o.order
        else:
            mesh = type(mesh)(*mesh.shape, order=parse_order(o.order))
        self.mesh = mesh
        self.layout = Layout(mesh, self.gpus, self.ring, placement)
        self._check_options()
        self.v = o.virtual_stages
        order_of = schedule(o.schedule)
        M = o.microbatches
        self.orders = [order_of(p, mesh.pp, M, self.v) for p in range(mesh.pp)]
        if self.batch is not None and M > 1 and M * mesh.dp > self.batch:
            raise ConfigError(
                "parallelism.microbatches",
                M,
                f"at most the batch size ({self.batch})"
                + (f" over the {mesh.dp} data-parallel replicas" if mesh.dp > 1 else ""),
            )
        self.micro = self.per_gpu_batch(mesh.dp * M)
        if self.micro is None and mesh.cp > 1:
            raise ConfigError("batch_size", None, "a batch size (the trace's metadata has none)")
        self.op_micro = self.micro if mesh.cp == 1 else self.micro / mesh.cp
        self._cut(M)
        at0 = self.layout.at
        group0 = [at0[(0, 0, 0, 0, t)] for t in range(mesh.tp)]
        self.tpx = _TensorParallel(
            self.trace,
            self.model,
            group0,
            TPOptions(o.tp_style, o.sequence_parallel),
            batch_size=self.op_micro,
            gpu=self.gpu,
            host=self.host,
        )
        self.attention = {}  # forward or backward op id -> its forward attention's Heads
        if mesh.cp > 1:
            if o.tp_style != "megatron":
                raise ConfigError("parallelism.tp_style", o.tp_style, "megatron with cp > 1")
            self.attention = plan_attention(
                self.trace, mesh.cp, mesh.tp, o.cp_comm, o.sequence_parallel, mode=self.name
            )
        split = self.tpx.sharded_weights() if mesh.tp > 1 else set()
        pipe = self.pipe
        self.weights = StageWeights(
            self.trace, pipe.fwd_ops, pipe.bwd_ops, self.orders, mesh.pp, split, mesh.tp
        )
        self.position = {op.id: i for i, op in enumerate(self.trace.operators)}
        self._walks()
        self.shard, self.units_done = None, {}
        if self.fsdp:
            self.shard = ShardPlan(
                self.trace, o.wrap_depth, self.weights, o.reshard_after_forward, mesh.pp
            )
            self._units_done()
        self.buckets = {}  # none without data-parallel peers: nothing to reduce
        if o.dp_overlap and not self.fsdp and mesh.dp * mesh.cp > 1:
            self.buckets = {
                p: self.weights.buckets(p, o.first_bucket_size, o.bucket_size)
                for p in range(mesh.pp)
            }
        self.builder = MeshStreams(self)  # its stage templates, built once

    # -- the plan's parts -----------------------------------------------------------------
    def _check_options(self):
        """What the degrees allow of the other fields (each message names its field)."""
        o, mesh = self.options, self.mesh
        zero = o.zero if o.zero is not None else (3 if mesh.dp_shard > 1 else 0)
        self.zero = zero if mesh.dp_shard * mesh.cp > 1 else 0  # the level that shards
        self.fsdp = self.zero == 3
        if o.sequence_parallel and mesh.tp == 1:
            raise ConfigError(
                "parallelism.sequence_parallel", True, "false without tensor parallelism (tp 1)"
            )
        if o.virtual_stages > 1 and mesh.pp < 2:
            raise ConfigError(
                "parallelism.virtual_stages",
                o.virtual_stages,
                "1 without pipeline stages (pp >= 2 to interleave)",
            )
        if o.distributed_optimizer and self.zero:
            raise ConfigError(
                "parallelism.distributed_optimizer",
                True,
                f"false with zero {self.zero} (FSDP and ZeRO shard the optimizer states already)",
            )
        if self.zero in (1, 2) and mesh.dp_replicate > 1:
            raise ConfigError(
                "parallelism.zero",
                self.zero,
                "3 or 0 with dp_replicate > 1 (HSDP is FSDP's; ZeRO-1/2 shard over all "
                "data-parallel GPUs: dp_shard x cp)",
            )
        self.params_after_step = o.distributed_optimizer or self.zero in (1, 2)
        self.reduction = grad_reduction(o.distributed_optimizer or self.zero == 2)

    def _cut(self, M: int):
        """The model in pp x v chunks (pipeline.StageCut; chunk k on stage k % pp)."""
        mesh, at = self.mesh, self.layout.at
        chunks = mesh.pp * self.v
        chain = [at[(k % mesh.pp, 0, 0, 0, 0)] for k in range(chunks)]
        o = self.options
        # what the balancing charges for recomputation: the chunk's forward again, for
        # the micro-batches that recompute (selective recomputation not counted)
        again = "none"
        if o.recompute in ("full", "stage"):
            again = "all" if o.recompute_microbatches == "all" else "except_last"
        self.pipe = StageCut(
            self.trace,
            self.model,
            chain,
            PipelineOptions(microbatches=M, stages=list(o.stages), recompute=again),
            batch_size=self.per_gpu_batch(mesh.dp),
            gpu=self.gpu,
            graph=self.graph if mesh.pp > 1 and self.v == 1 else None,
            host=self.host,
        )

    def _walks(self):
        """Each chunk's backward pass with the recomputed forward operators in it (and
        without, for a micro-batch that is not recomputed)."""
        o = self.options
        policy, unit_of = o.recompute, {}
        if policy == "stage":  # the chunk is one block
            policy = "full"
            unit_of = {op.id: 0 for op in self.trace.operators}
        elif policy != "none":
            unit_of = layer_units(self.trace, o.recompute_depth)[0]
        self.backward_walk, self._plain_walk = [], []
        for fwd, bwd in zip(self.pipe.fwd_ops, self.pipe.bwd_ops, strict=True):
            walk = with_recompute(fwd + bwd, policy, unit_of)
            self.backward_walk.append(walk[len(fwd) :])
            self._plain_walk.append([(op, False) for op in bwd])

    def walk(self, c: int, m: int) -> list:
        """[(op, recomputed)] of chunk c's backward pass for micro-batch m."""
        o = self.options
        if o.recompute_microbatches == "except_last" and m == o.microbatches - 1:
            return self._plain_walk[c]
        return self.backward_walk[c]

    def _units_done(self):
        """(chunk, op id) -> the (chunk, unit) pairs whose last backward operator in the
        chunk that operator is."""
        last: dict = {}
        for c, walk in enumerate(self.backward_walk):
            for op, again in walk:
                if not again and op.phase == "backward":
                    last[c, self.shard.unit_of.get(op.id, 0)] = op.id
        self.units_done = {}
        for (c, u), i in last.items():
            self.units_done.setdefault((c, i), []).append((c, u))

    # -- timing ---------------------------------------------------------------------------
    def op_time(self, op, split, whole, m, phase=None, scale=1.0):
        """`op` at the micro-batch on its TP role's shard, times `scale`."""
        target, s = self.tpx.shard(op, split, whole, scale)
        return self.compute(op, target, s, m, phase)

    def token_ratio(self) -> float:
        """The GPU's share of the trace's batch-sized tensors: its tokens of a micro-batch."""
        return self.op_micro / self.trace.batch_size

    def optimizer_scale(self, p: int) -> float:
        """The optimizer's time x the share of the weights stage p's GPUs step."""
        total = self.trace.weight_bytes()
        mesh = self.mesh
        scale = self.weights.stage_bytes[p] / total if total else 1.0 / (mesh.pp * mesh.tp)
        return scale / self._state_parts()

    def grad_bytes(self, p: int) -> float:
        """The gradient bytes a GPU of stage p reduces at once without dp_overlap (its
        stage's TP shard): a subclass that compresses gradients says less."""
        return self.weights.stage_bytes[p]

    def _state_parts(self) -> int:
        """The GPUs a stage's TP shard's optimizer states are split over."""
        mesh, o = self.mesh, self.options
        if self.zero:
            return mesh.dp_shard * mesh.cp
        return mesh.dp_replicate * mesh.dp_shard * mesh.cp if o.distributed_optimizer else 1

    # -- streams --------------------------------------------------------------------------
    def streams(self):
        return self.builder.streams()

    def group(self, gpu, *dims) -> tuple:
        """`gpu`'s group along `dims` (mesh dimension names), in ring order."""
        return self.layout.group(self.layout.coord[gpu], dims)

    def symmetry(self) -> Symmetry:
        """Copies along the outer data-parallel dimension (dp_replicate, else dp_shard;
        without either, TP: its ranks run the same streams): index 0's GPUs (every stage,
        CP and TP rank of it) represent the others, mapped by their other coordinates;
        groups inside a copy map to the same group of the others, and a group across the
        copies (data-parallel: one GPU per copy and position) is a union of classes."""
        mesh, at = self.mesh, self.layout.at
        k = next((k for k in (REP, SHARD, TP) if mesh.shape[k] > 1), None)
        if k is None:  # every GPU its own class: the runtime says so and runs them all
            return Symmetry.of_replicas([list(at.values())])
        first = sorted(x for x in at if x[k] == 0)
        copies = mesh.shape[k]

        def moved(x, i):
            y = list(x)
            y[k] = i
            return tuple(y)

        replicas = [[at[moved(x, i)] for x in first] for i in range(copies)]
        coord, layout = self.layout.coord, self.layout

        def image_group(group, i):
            return layout.ring_order(at[moved(coord[g], i)] for g in group)

        sym = Symmetry.of_replicas(replicas, image_group)
        # every copy's streams come from the same stage templates mapped by coordinates:
        # the stream check compares the first, a middle and the last copy
        sym.sample = 2
        return sym

    # -- what the memory model needs ------------------------------------------------------
    def op_batch(self):
        return self.op_micro

    def activation_ratio(self, op) -> float:
        return self.tpx.activation_ratio(op)

    def _stage(self, gpu) -> int:
        return self.layout.coord[gpu][0]

    def held_weight_bytes(self, gpu) -> float:
        held = self.weights.stage_bytes[self._stage(gpu)]
        return held / self._state_parts() if self.fsdp else held

    def buffer_bytes(self, gpu) -> float:
        p = self._stage(gpu)
        if self.fsdp:
            return self.shard.buffer(self.weights.stage_chunks(p), 1 / self._state_parts())
        if self.options.distributed_optimizer:  # Megatron's gradient buffer, all run long
            return self.weights.stage_bytes[p]
        if self.zero:  # ZeRO-1/2 reduce in place
            return 0.0
        return sum(size for _, size in self.buckets.get(p, ()))

    def state_fractions_of(self, gpu) -> dict | None:
        total = self.trace.weight_bytes()
        held = self.weights.stage_bytes[self._stage(gpu)] / total if total else 0.0
        parts, o = self._state_parts(), self.options
        if self.fsdp:
            f = held / parts
            return {"weights": f, "gradients": f, "optimizer_states": f}
        if self.zero:  # ZeRO-1 the states, ZeRO-2 the gradients too
            grads = held / parts if self.zero == 2 else held
            return {"weights": held, "gradients": grads, "optimizer_states": held / parts}
        if o.distributed_optimizer:
            return dist_optimizer.state_fractions(held, parts)
        return None

    def describe(self) -> str:
        """The mesh in words: its degrees, those above 1."""
        parts = [f"{d} {k}" for d, k in zip(DIMS, self.mesh.shape, strict=True) if k > 1]
        return " x ".join(parts) or "one GPU"
