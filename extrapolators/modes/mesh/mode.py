"""`mode: mesh`: parallelism written as a device mesh (dims.py): pipeline stages x data-
parallel replicas x sharded data parallelism x context parallelism x tensor parallelism,
e.g. `parallelism: {mode: mesh, pp: 16, dp_shard: 32, tp: 8, schedule: interleaved}`.

One plan per dimension, each checked here against the trace before any simulation:
  - PP: the model cut into pp x virtual_stages chunks (the pipeline mode's balanced cut,
    pipeline.StageCut), chunk k on the stage the schedule's placement says (schedules.py:
    k % pp, or DualPipeV's V), each stage's schedule (schedules.py); with
    one stage the schedule is gradient accumulation over `microbatches`;
  - TP: Megatron's roles and collectives on each chunk's operators at the GPU's tokens
    (tensor_parallel.py), over the GPU's TP group;
  - CP: the attention operators across the CP group (cp_plan.py, cp_attention.py: ring
    attention or Ulysses), every other operator on the GPU's 1/cp of the tokens;
  - DP: the stage's weights (weights.py) reduced over the data-parallel group (the
    dp_replicate x dp_shard x cp GPUs at the GPU's stage and TP rank) in DDP's buckets,
    or by Megatron's distributed optimizer, or ZeRO-1/2 over dp_shard; with dp_shard > 1
    and zero 3, FSDP2 per unit (sharding.py) over dp_shard x cp, HSDP with dp_replicate;
  - EP (`ep`, `etp` > 1 with a mixture-of-experts trace; mode ep always): the expert mesh
    folded out of each stage's GPUs (experts.py), the MoE layers' all-to-alls and expert-TP
    collectives around their experts, the experts' gradients over their replicas, the
    dense layers' TP plan without the MoE layers (moe_tp.py: the router whole);
  - recomputation per block (blocks.with_recompute) inside each chunk's backward pass
    (walks.py: each chunk's backward walk, with and without it).
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
from extrapolators.modes.cp_plan import plan_attention
from extrapolators.modes.mesh.dims import DIMS, Layout, parse_order, resolve
from extrapolators.modes.mesh.experts import ExpertPlan, check_load_fields
from extrapolators.modes.mesh.moe_tp import DenseTensorParallel, moe_block_ops
from extrapolators.modes.mesh.options import MeshOptions
from extrapolators.modes.mesh.rules import check_overlap_fields, field_rules
from extrapolators.modes.mesh.sharding import ShardPlan
from extrapolators.modes.mesh.streams import MeshStreams
from extrapolators.modes.mesh.symmetry import mesh_symmetry
from extrapolators.modes.mesh.walks import ChunkWalks
from extrapolators.modes.mesh.weights import StageWeights, param_buckets
from extrapolators.modes.pipeline import PipelineOptions, StageCut
from extrapolators.modes.schedules import overlapped, placement_of, schedule
from extrapolators.modes.tensor_parallel import TensorParallel, TPOptions
from extrapolators.modes.tp_roles import SHARDED
from extrapolators.modes.wgrad import weight_grad_shares
from perfmodel.base import Target, batch_ratio
from triosim.common.errors import ConfigError


class MeshMode(Extrapolator):
    """The mode (module docstring)."""

    name = "mesh"
    Options = MeshOptions
    uses_precision = True
    experts_always = False  # plan the experts even at ep = etp = 1 (mode ep)
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
        r = field_rules(o, mesh)
        self.zero, self.fsdp, self.reduction = r.zero, r.fsdp, r.reduction
        self.params_after_step = r.params_after_step
        self.v = o.virtual_stages
        order_of = schedule(o.schedule)
        self.place = placement_of(o.schedule, mesh.pp, self.v)
        self._wgrad = None
        M = o.microbatches
        self.orders = self._orders(order_of, M, o.accumulation)
        self.pairs = self._pairs(o.schedule, M, o.accumulation)
        if self.batch is not None and M > 1 and M * mesh.dp > self.batch:
            raise ConfigError(
                "parallelism.microbatches",
                M,
                f"at most the batch size ({self.batch})"
                + (f" over the {mesh.dp} data-parallel replicas" if mesh.dp > 1 else ""),
            )
        over = f"the data-parallel replicas ({mesh.dp}) x microbatches ({M})" if M > 1 else None
        self.micro = self.per_gpu_batch(mesh.dp * M, over)
        if self.micro is None and mesh.cp > 1:
            raise ConfigError("batch_size", None, "a batch size (the trace's metadata has none)")
        self.op_micro = self.micro if mesh.cp == 1 else self.micro / mesh.cp
        # the GPUs' coordinates after the checks on degrees and the batch: a config error of
        # a million-GPU run does not wait for a million of them
        self.layout = Layout(mesh, self.gpus, self.ring, placement)
        self._cut(M)
        at0 = self.layout.at
        group0 = [at0[(0, 0, 0, 0, t)] for t in range(mesh.tp)]
        self.experts = None
        if o.ep != 1 or o.etp > 1 or self.experts_always:
            tokens = self.op_micro / mesh.tp if mesh.tp > 1 else self.op_micro
            self.experts = ExpertPlan(self, mesh, o, tokens)
        check_load_fields(o, self.experts is not None)
        check_overlap_fields(o, mesh, self.experts)
        if self.experts is not None:
            if self.fsdp and mesh.dp_replicate > 1:
                raise ConfigError(
                    "parallelism.dp_replicate",
                    mesh.dp_replicate,
                    "1 with expert parallelism and FSDP (HSDP of the experts is not modelled)",
                )
            if mesh.pp > 1:  # a layer's dispatch and combine on one stage
                starts = self.experts.whole_layers(self.ops("forward"), self.pipe.starts)
                if starts != self.pipe.starts:
                    self._cut(M, starts[1:])
        self.tpx = self._tp_plan(group0)
        self.attention = {}  # forward or backward op id -> its forward attention's Heads
        if mesh.cp > 1:
            if o.tp_style != "megatron":
                raise ConfigError("parallelism.tp_style", o.tp_style, "megatron with cp > 1")
            self.attention = plan_attention(
                self.trace, mesh.cp, mesh.tp, o.cp_comm, o.sequence_parallel, mode=self.name
            )
        split = self.tpx.sharded_weights() if mesh.tp > 1 else set()
        pipe, ex = self.pipe, self.experts
        self.weights = StageWeights(
            self.trace,
            pipe.fwd_ops,
            pipe.bwd_ops,
            self.orders,
            self.place,
            split,
            mesh.tp,
            ex.expert_weights if ex is not None else (),
            ex.ep * ex.etp if ex is not None else 1,
            self.precision,
        )
        # the trace's weight casts where the weights are gathered or held in `params`
        self.cast_scale = self.precision.cast_scales(mesh.dp_shard * mesh.cp if self.fsdp else 1)
        self.position = {op.id: i for i, op in enumerate(self.trace.operators)}
        self.param_buckets = [[] for _ in range(mesh.pp)]
        self.gather_before: list[dict] = [{} for _ in range(mesh.pp)]
        if o.overlap_param_gather:
            self._param_buckets()
        self.walks = ChunkWalks(self.trace, o, self.pipe)  # each chunk's backward pass
        self.shard, self.units_done = None, {}
        if self.fsdp:
            self.shard = ShardPlan(
                self.trace, o.wrap_depth, self.weights, o.reshard_after_forward, mesh.pp
            )
            self.units_done = self.walks.units_done(self.shard.unit_of)
        self.buckets = {}  # none without data-parallel peers: nothing to reduce
        if o.dp_overlap and not self.fsdp and mesh.dp * mesh.cp > 1:
            self.buckets = {
                p: self.weights.buckets(p, o.first_bucket_size, o.bucket_size)
                for p in range(mesh.pp)
            }
        self.builder = MeshStreams(self)  # its stage templates, built once

    # -- the plan's parts -----------------------------------------------------------------
    def _orders(self, order_of, M: int, K: int) -> list:
        """Each stage's steps: the schedule over M micro-batches, or with accumulation K
        the schedule over M / K of them K times (micro-batches numbered on: m + k M / K)."""
        pp = self.mesh.pp
        self.flush_size = M // K  # micro-batches a schedule runs
        if K == 1:
            return [order_of(p, pp, M, self.v) for p in range(pp)]
        if pp == 1:
            raise ConfigError(
                "parallelism.accumulation",
                K,
                f"1 with pp 1 (gradient accumulation there is microbatches: {M})",
            )
        if M % K:
            raise ConfigError(
                "parallelism.accumulation",
                K,
                f"a divisor of microbatches ({M}): each of the K pipeline schedules runs "
                f"microbatches / K of them",
            )
        per = M // K
        out = []
        for p in range(pp):
            try:
                one = order_of(p, pp, per, self.v)
            except ConfigError as e:  # the schedule's rule on what one schedule runs
                raise ConfigError(
                    "parallelism.accumulation",
                    K,
                    f"one leaving each schedule microbatches / accumulation = {per} "
                    f"micro-batches, and {e.field} must be {e.allowed}",
                ) from None
            out.append([(kind, m + k * per, j) for k in range(K) for kind, m, j in one])
        return out

    @property
    def wgrad_shares(self) -> dict:
        """Backward op id -> the share of its time a zero-bubble schedule's W step runs
        (extrapolators.modes.wgrad), made once."""
        if self._wgrad is None:
            self._wgrad = weight_grad_shares(self.trace)
        return self._wgrad

    def _pairs(self, name: str, M: int, K: int) -> list:
        """Each stage's overlapped forward-backward pairs (indices into its steps: steps k
        and k + 1) where the schedule names them (DualPipeV), each of the K schedules'
        shifted by the steps before it; None where it names none."""
        pp, per, out = self.mesh.pp, M // K, []
        for p in range(pp):
            one = overlapped(name, p, pp, per, self.v)
            if one is None:
                return None
            n = len(self.orders[p]) // K
            out.append({k + i * n for i in range(K) for k in one})
        return out

    def _tp_plan(self, group0):
        """The TP plan on the first TP group: Megatron's (tensor_parallel.py), with experts
        on the mesh the dense layers' only (moe_tp.py: the router whole, the routed
        experts the expert plan's)."""
        o, ex = self.options, self.experts
        args = (self.trace, self.model, group0, TPOptions(o.tp_style, o.sequence_parallel))
        kw = {"batch_size": self.op_micro, "gpu": self.gpu, "host": self.host}
        if ex is None:
            return TensorParallel(*args, **kw, degree_field="parallelism.tp")
        if self.mesh.tp > 1 and "." not in ex.moe["expert_module"]:
            raise ConfigError(
                "trace",
                "metadata moe.expert_module",
                "a module under its MoE layer's (`feed_forward.experts`) with tp > 1: the "
                "MoE layer's module tells the router (not split) from the attention",
            )
        moe_ops = moe_block_ops(self.trace, ex.moe)
        return DenseTensorParallel(*args, **kw, moe_ops=moe_ops, expert_ops=ex.expert_ops)

    def _param_buckets(self):
        """overlap_param_gather: each stage's parameter all-gathers in the order its forward
        pass reads them, and the operator before which each is waited for."""
        ex, ops = self.experts, self.trace.operators
        experts = ex.expert_weights if ex is not None else set()
        for p in range(self.mesh.pp):
            only = {w for c in self.weights.stage_chunks(p) for w in self.weights.chunk_weights[c]}
            made = self.param_buckets[p] = param_buckets(
                self.trace, experts, self.options.bucket_size, self.weights.gbytes, only
            )
            for k, (pos, _, _) in enumerate(made):
                if pos < len(ops):
                    self.gather_before[p].setdefault(ops[pos].id, []).append(k)

    def _cut(self, M: int, stages=None):
        """The model in pp x v chunks (pipeline.StageCut; chunk k on stage place.stage(k))."""
        mesh, at = self.mesh, self.layout.at
        chunks = mesh.pp * self.v
        chain = [at[(self.place.stage(k), 0, 0, 0, 0)] for k in range(chunks)]
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
            PipelineOptions(
                microbatches=M,
                stages=list(o.stages) if stages is None else stages,
                split=o.split,
                recompute=again,
            ),
            batch_size=self.per_gpu_batch(mesh.dp),
            gpu=self.gpu,
            graph=self.graph if mesh.pp > 1 and self.v == 1 else None,
            host=self.host,
        )

    # -- timing ---------------------------------------------------------------------------
    def op_time(self, op, split, whole, m, phase=None, scale=1.0, j=0):
        """The task for `op` at micro-batch m (`op_seconds`)."""
        return self.timed(op, self.op_seconds(op, split, whole, scale, j), m, phase)

    def op_seconds(self, op, split, whole, scale=1.0, j=0) -> float:
        """`op`'s GPU seconds at the micro-batch on its TP role's shard, times `scale`; a
        routed expert's on EP rank j's experts (experts.py), the router whole on the GPU's
        tokens; a weight cast as the precision has it (triosim.trace.precision)."""
        if self.cast_scale:
            scale *= self.cast_scale.get(op.id, 1.0)
        ex = self.experts
        if ex is not None:
            if op.id in ex.expert_ops:
                t = ex.time(op, j)
                if op.id in self.precision.fp8:  # TE's grouped GEMM in FP8
                    t = self._fp8_time(op, self.target(ex.tokens_batch), t)
                return t * scale
            tpx = self.tpx
            if op.tp_split and op.id in tpx.moe_ops and tpx.roles.get(op.id) in SHARDED:
                return self.seconds(op, self.target(ex.tokens_batch), scale)
        target, s = self.tpx.shard(op, split, whole, scale)
        return self.seconds(op, target, s)

    def token_ratio(self) -> float:
        """The GPU's share of the trace's batch-sized tensors: its tokens of a micro-batch."""
        return self.op_micro / self.trace.batch_size

    def optimizer_scale(self, p: int) -> float:
        """The optimizer's time x the share of the weights stage p's GPUs step."""
        total = self.trace.weight_bytes()
        mesh = self.mesh
        if self.experts is None:  # (the same arithmetic as before experts were planned)
            scale = self.weights.stage_bytes[p] / total if total else 1.0 / (mesh.pp * mesh.tp)
            return scale / self._state_parts()
        return self._stepped(p) / total if total else 1.0 / (mesh.pp * mesh.tp)

    def _stepped(self, p: int) -> float:
        """The weight bytes whose optimizer states a GPU of stage p owns."""
        w = self.weights
        return w.dense_bytes[p] / self._state_parts() + w.expert_bytes[p] / self._expert_parts()

    def grad_bytes(self, p: int, kind: str = "dense") -> float:
        """The gradient bytes of `kind` a GPU of stage p reduces at once without dp_overlap
        (its stage's TP shard): a subclass that compresses gradients says less."""
        return self.weights.held(p, kind, "reduced")

    def _expert_parts(self) -> int:
        """The GPUs an expert's (etp shard's) optimizer states are split over: its replicas
        (expert-DP group) where data parallelism shards them."""
        ex, o = self.experts, self.options
        if ex is None:
            return 1
        return ex.edp if self.zero or o.distributed_optimizer else 1

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

    def dense_group(self, gpu) -> tuple:
        """The GPUs holding the same weights as `gpu` (its data-parallel group), in ring
        order."""
        return self.group(gpu, "dp_replicate", "dp_shard", "cp")

    def expert_group(self, gpu, which: str = "ep") -> tuple:
        """`gpu`'s EP group (which "ep"), expert-TP group ("etp") or its experts' replicas
        ("edp"), in rank order (mesh/experts.py)."""
        return self.builder.experts_group(self.layout.coord[gpu], which)

    def symmetry(self) -> Symmetry:
        """Copies of the mesh that stand for each other (mesh/symmetry.py)."""
        return mesh_symmetry(self)

    # -- what the memory model needs ------------------------------------------------------
    def op_batch(self):
        return self.op_micro

    def activation_ratio(self, op) -> float:
        ex = self.experts
        if ex is not None and op.id in ex.expert_ops:  # at the busiest GPU's tokens
            return batch_ratio(self.trace, Target(batch_size=ex.tokens_batch)) * max(ex.scale)
        return self.tpx.activation_ratio(op)

    def _stage(self, gpu) -> int:
        return self.layout.coord[gpu][0]

    def held_weight_bytes(self, gpu) -> float:
        p = self._stage(gpu)
        return self._stepped(p) if self.fsdp else self.weights.stage_bytes[p]

    def buffer_bytes(self, gpu) -> float:
        p = self._stage(gpu)
        if self.fsdp:
            chunks = self.weights.stage_chunks(p)
            return self.shard.buffer(chunks, 1 / self._state_parts(), 1 / self._expert_parts())
        if self.options.distributed_optimizer:  # Megatron's gradient buffer, all run long
            return self.weights.stage_reduced[p]
        if self.zero:  # ZeRO-1/2 reduce in place
            return 0.0
        return sum(b[1] for b in self.buckets.get(p, ()))

    def held_dtypes(self) -> tuple | None:
        """16-bit `params` held whole (Megatron's --bf16 module weights), gradients in
        `reduce` ("trace": as stored); FSDP keeps its shards as stored (FSDP2 gathers in
        `params`), so None there and without 16-bit `params`."""
        p = self.precision.options
        if self.fsdp or p.params not in ("bfloat16", "float16"):
            return None
        return p.params, p.reduce

    def state_fractions_of(self, gpu) -> dict | None:
        total = self.trace.weight_bytes()
        p = self._stage(gpu)
        held = self.weights.stage_bytes[p] / total if total else 0.0
        o, parts = self.options, self._state_parts()
        owned = held / parts  # its optimizer states' share
        if self.experts is not None and total:
            owned = self._stepped(p) / total
        if self.fsdp:
            return {"weights": owned, "gradients": owned, "optimizer_states": owned}
        if self.zero:  # ZeRO-1 the states, ZeRO-2 the gradients too
            grads = owned if self.zero == 2 else held
            return {"weights": held, "gradients": grads, "optimizer_states": owned}
        if o.distributed_optimizer:
            return dist_optimizer.state_fractions(held, held / owned if owned else 1)
        return None

    def describe(self) -> str:
        """The mesh in words: its degrees, those above 1."""
        parts = [f"{d} {k}" for d, k in zip(DIMS, self.mesh.shape, strict=True) if k > 1]
        ex = self.experts
        if ex is not None:  # the expert mesh folded out of it
            parts += [f"{d} {k}" for d, k in (("ep", ex.ep), ("etp", ex.etp)) if k > 1]
        return " x ".join(parts) or "one GPU"
