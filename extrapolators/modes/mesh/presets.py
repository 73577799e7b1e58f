"""The parallelism modes as presets of the mesh: each keeps its config fields (its own
`Options`) and fills in the mesh's (options.py), so that every YAML that named a mode before
the mesh runs as it did, on the one implementation.

  single       one GPU
  dp           dp_replicate = N, one all-reduce after the backward pass (accumulation:
               micro-batches)
  ddp          dp_replicate = N, DDP's overlapped buckets
  fsdp         dp_shard = N, ZeRO `stage` 1-3 (3: FSDP2, reshard_after_forward true:
               always, false: never)
  tp           tp = N (its degree field is num_gpus)
  gpipe, 1f1b  pp = N stages, the schedule; `recompute` except_last / all: each stage's
               forward again before its backward
  hybrid       dp_replicate = dp replicas of an inner single, tp, gpipe or 1f1b, the
               gradients reduced after the backward pass
  3d           dp_replicate x tp x pp (x cp), `placement` as the rank order
  interleaved  3d with the interleaved schedule
  cp           dp x cp x tp, TP innermost; with `fsdp` the dp GPUs shard (dp_shard)
  ep           pp x dp x tp with the expert mesh ep x etp folded out of each stage
               (mesh/experts.py), Megatron-Core's; with `fsdp` the dp GPUs shard, every
               unit resharded after its forward
Errors name the preset's own fields (a TP degree that does not divide a layer is num_gpus's
for mode tp, parallelism.tp's for 3d).
"""

from __future__ import annotations

import dataclasses

from extrapolators.modes.mesh.dims import Mesh, parse_order
from extrapolators.modes.mesh.mode import MeshMode
from extrapolators.modes.mesh.options import MeshOptions
from extrapolators.modes.mesh.preset_options import (
    CPOptions,
    DDPOptions,
    DPOptions,
    EPOptions,
    HybridOptions,
    InterleavedOptions,
    PipelineOptions,
    ShardedOptions,
    ThreeDOptions,
    TPOptions,
)
from triosim.common import schema
from triosim.common.errors import ConfigError

ORDERS = {"tp-pp-dp": "tp-cp-pp-dp", "dp-pp-tp": "dp-pp-cp-tp"}  # 3D's placements


def _mesh(**fields) -> MeshOptions:
    return MeshOptions(**{"dp_shard": 1, **fields})


def _pipeline(o, n: int, schedule: str) -> MeshOptions:
    """A pipeline of n stages from the pipeline modes' fields: torch Pipe's recomputation
    (`all`, `except_last`) is the mesh's per-stage one for those micro-batches."""
    policy, which = {"none": ("none", "all"), "all": ("stage", "all")}.get(
        o.recompute, ("stage", "except_last")
    )
    return _mesh(
        pp=n,
        microbatches=o.microbatches,
        schedule=schedule,
        stages=list(o.stages),
        split=o.split,
        recompute=policy,
        recompute_microbatches=which,
    )


class Single(MeshMode):
    """Replay the trace on one GPU (at the plan's batch size and GPU)."""

    name = "single"
    Options = schema.NoOptions
    hybrid_inner = True

    def mesh_options(self, n):
        if n != 1:
            raise ConfigError(
                "num_gpus",
                n,
                "1 for mode 'single' (parallelism.mode's default where the config names "
                "none): name a mode for more GPUs (ddp, fsdp, tp, 3d, mesh, ...)",
            )
        return _mesh()


class DataParallel(MeshMode):
    """Every GPU runs the trace on batch/N; gradients all-reduced after the backward pass."""

    name = "dp"
    Options = DPOptions
    overlap = False  # the gradients reduced after the backward pass

    def mesh_options(self, n):
        o = self.options
        buckets = (
            {"bucket_size": o.bucket_size, "first_bucket_size": o.first_bucket_size}
            if self.overlap
            else {}
        )
        return _mesh(
            dp_replicate=n,
            microbatches=o.accumulation_steps,
            dp_overlap=self.overlap,
            recompute=o.recompute,
            recompute_depth=o.recompute_depth,
            **buckets,
        )


class DistributedDataParallel(DataParallel):
    """DDP: gradient buckets all-reduced as the backward pass fills them."""

    name = "ddp"
    Options = DDPOptions
    overlap = True


class Sharded(MeshMode):
    """ZeRO stages 1-3 and FSDP over all GPUs."""

    name = "fsdp"
    Options = ShardedOptions

    def mesh_options(self, n):
        o = self.options
        if o.stage != 3 and not o.reshard_after_forward:
            raise ConfigError(
                "parallelism.reshard_after_forward",
                False,
                f"true (the default) with stage {o.stage}: only stage 3 (FSDP) gathers the "
                f"parameters it could keep",
            )
        reshard = "default" if o.stage != 3 else "always" if o.reshard_after_forward else "never"
        return MeshOptions(
            dp_shard=n,
            zero=o.stage,
            wrap_depth=o.wrap_depth,
            reshard_after_forward=reshard,
            bucket_size=o.bucket_size,
            first_bucket_size=o.bucket_size,
            recompute=o.recompute,
            recompute_depth=o.wrap_depth,
        )


class TensorParallel(MeshMode):
    """Tensor parallelism over all GPUs (Megatron's or the paper's channel split)."""

    name = "tp"
    Options = TPOptions
    hybrid_inner = True
    fields = {"parallelism.tp": "num_gpus"}

    def mesh_options(self, n):
        o = self.options
        return _mesh(tp=n, tp_style=o.tp_style, sequence_parallel=o.sequence_parallel)


class GPipe(MeshMode):
    """A pipeline over all GPUs, GPipe's schedule."""

    name = "gpipe"
    Options = PipelineOptions
    hybrid_inner = True
    fields = {"parallelism.pp": "num_gpus"}

    def mesh_options(self, n):
        return _pipeline(self.options, n, self.name)


class OneFOneB(GPipe):
    """A pipeline over all GPUs, 1F1B (PipeDream-flush)."""

    name = "1f1b"


class Hybrid(MeshMode):
    """`dp` data-parallel replicas of an inner plan (single, tp, gpipe or 1f1b), the
    gradients all-reduced after the backward pass."""

    name = "hybrid"
    Options = HybridOptions

    @classmethod
    def load_options(cls, data, where, elsewhere, also=()):
        from extrapolators.modes import EXTRAPOLATORS

        own = {k: v for k, v in data.items() if k in ("dp", "inner")}
        o = schema.load(HybridOptions, own, where, owner="parallelism mode 'hybrid'", also=also)
        inner_cls = EXTRAPOLATORS.get(o.inner) if o.inner in EXTRAPOLATORS else None
        if inner_cls is None or not inner_cls.hybrid_inner:
            allowed = [n for n, c in EXTRAPOLATORS.items() if c.hybrid_inner]
            raise ConfigError(
                f"{where}.inner", o.inner, f"a mode that hybrid replicates: {', '.join(allowed)}"
            )
        rest = {k: v for k, v in data.items() if k not in own}
        # (a field of neither is named as hybrid's, not as the inner mode's alone)
        inner = inner_cls.load_options(
            rest,
            where,
            elsewhere,
            also=(*also, "dp", "inner"),
            owner=f"parallelism mode 'hybrid' with inner '{o.inner}'",
        )
        return dataclasses.replace(o, inner_options=inner)

    def check(self):
        try:
            super().check()
        except ConfigError as e:
            if e.field not in ("parallelism.tp", "parallelism.pp"):
                raise
            # the inner mode's degree is a replica's GPUs, num_gpus / dp: say so
            dp = self.preset.dp
            raise ConfigError(
                "parallelism.dp",
                dp,
                f"a split whose replicas of num_gpus / dp = {len(self.gpus) // dp} GPUs the "
                f"inner mode allows: {e.allowed}",
            ) from None

    def mesh_options(self, n):
        from extrapolators.modes import EXTRAPOLATORS

        o = self.options
        dp, inner = o.dp, o.inner
        if n % dp:
            raise ConfigError("parallelism.dp", dp, f"an integer >= 1 dividing num_gpus ({n})")
        inner_cls = EXTRAPOLATORS.get(inner) if inner in EXTRAPOLATORS else None
        if inner_cls is None or not inner_cls.hybrid_inner:
            raise ConfigError("parallelism.inner", inner, "a mode that hybrid replicates")
        k = n // dp
        io = o.inner_options
        if inner == "single":
            if k != 1:
                raise ConfigError(
                    "parallelism.dp",
                    dp,
                    f"a split whose replicas of num_gpus / dp = {k} GPUs the inner mode "
                    f"allows: 1 for mode 'single'",
                )
            got = _mesh()
        elif inner == "tp":
            got = _mesh(tp=k, tp_style=io.tp_style, sequence_parallel=io.sequence_parallel)
        else:
            got = _pipeline(io, k, inner)
        # replicas are contiguous GPUs: the inner plan's dimension inside dp
        return dataclasses.replace(got, dp_replicate=dp, dp_overlap=False, order="tp-cp-pp-dp")


class ThreeD(MeshMode):
    """Megatron-LM's 3D grid: dp x tp x pp (x cp), `placement` its rank order."""

    name = "3d"
    Options = ThreeDOptions
    fields = {
        "parallelism.dp_shard": "parallelism.pp",
        "parallelism.order": "parallelism.placement",
    }

    def mesh_options(self, n):
        o = self.options
        dp, tp, cp = o.dp, o.tp, o.cp
        if n % (dp * tp * cp):
            what = f"dp x tp ({dp} x {tp})" if cp == 1 else f"dp x tp x cp ({dp} x {tp} x {cp})"
            raise ConfigError("parallelism.dp", dp, f"{what} dividing num_gpus ({n})")
        pp = o.pp or n // (dp * tp * cp)
        if dp * tp * pp * cp != n:
            with_cp = f", cp = {cp}" if cp > 1 else ""
            raise ConfigError(
                "parallelism.pp",
                o.pp,
                f"dp x tp x pp{' x cp' if cp > 1 else ''} = num_gpus ({n}); dp = {dp}, "
                f"tp = {tp}{with_cp}",
            )
        pl = o.placement
        if isinstance(pl, str) and pl not in ORDERS:
            raise ConfigError(
                "parallelism.placement", pl, "tp-pp-dp, dp-pp-tp or a list of GPU ids"
            )
        if isinstance(pl, str):
            order = ORDERS[pl]
        else:  # GPU ids in 3D's grid order (tp-pp-dp) -> by the mesh's default rank
            grid, mesh = (
                Mesh(pp, dp, 1, cp, tp, parse_order(ORDERS["tp-pp-dp"])),
                Mesh(pp, dp, 1, cp, tp),
            )
            order = list(pl)
            if len(pl) == n:
                order = [None] * n
                for q, g in enumerate(pl):
                    order[mesh.rank(grid.coords(q))] = g
        return _mesh(
            pp=pp,
            dp_replicate=dp,
            cp=cp,
            tp=tp,
            order=order,
            microbatches=o.microbatches,
            schedule=o.schedule,
            virtual_stages=o.virtual_stages,
            tp_style=o.tp_style,
            sequence_parallel=o.sequence_parallel,
            cp_comm=o.cp_comm,
            dp_overlap=o.dp_overlap,
            bucket_size=o.bucket_size,
            first_bucket_size=o.first_bucket_size,
            distributed_optimizer=o.distributed_optimizer,
        )


class Interleaved(ThreeD):
    """Megatron's interleaved 1F1B (virtual pipeline): 3d with schedule interleaved."""

    name = "interleaved"
    Options = InterleavedOptions


class ContextParallel(MeshMode):
    """Context parallelism (ring attention or Ulysses) x tensor parallelism x data
    parallelism, Megatron's order; `fsdp`: torchtitan's FSDP2 over dp x cp."""

    name = "cp"
    Options = CPOptions
    fields = {"parallelism.dp_shard": "parallelism.cp"}

    def mesh_options(self, n):
        o = self.options
        if n % o.tp:
            raise ConfigError("parallelism.tp", o.tp, f"a degree dividing num_gpus ({n})")
        cp = o.cp or n // o.tp
        if n % (o.tp * cp) or not cp:
            raise ConfigError(
                "parallelism.cp",
                o.cp,
                f"a degree with tp x cp ({o.tp} x {cp}) dividing num_gpus ({n})",
            )
        if o.fsdp and o.distributed_optimizer:
            raise ConfigError(
                "parallelism.distributed_optimizer",
                True,
                "false with fsdp (FSDP shards the optimizer states already, with the "
                "parameters and gradients)",
            )
        dp = n // (o.tp * cp)
        data = {"dp_shard": dp, "zero": 3} if o.fsdp else {"dp_replicate": dp, "dp_shard": 1}
        return MeshOptions(
            **data,
            cp=cp,
            tp=o.tp,
            cp_comm=o.cp_comm,
            sequence_parallel=o.sequence_parallel,
            distributed_optimizer=o.distributed_optimizer,
            reshard_after_forward=o.reshard_after_forward,
            wrap_depth=o.wrap_depth,
            microbatches=o.accumulation_steps,
            recompute=o.recompute,
            recompute_depth=o.recompute_depth,
            bucket_size=o.bucket_size,
            first_bucket_size=o.first_bucket_size,
        )


class ExpertParallel(MeshMode):
    """Expert parallelism as Megatron-Core runs an MoE model: the dense layers tp x dp per
    pipeline stage (sequence parallel), the routed experts ep x etp x edp folded out of
    the same GPUs, the distributed optimizer or FSDP over the data-parallel GPUs."""

    name = "ep"
    Options = EPOptions
    experts_always = True  # the MoE plan (dense TP, the router whole) even at ep 1
    fields = {"parallelism.microbatches": "parallelism.accumulation_steps"}

    def mesh_options(self, n):
        o = self.options
        if n % o.pp:
            raise ConfigError(
                "parallelism.pp",
                o.pp,
                f"a pipeline-parallel degree dividing num_gpus ({n}): each stage takes num_gpus "
                f"/ pp GPUs",
            )
        s = n // o.pp
        where = f"num_gpus ({s})" if o.pp == 1 else f"num_gpus / pp ({n} / {o.pp} = {s})"
        if s % o.tp:
            raise ConfigError(
                "parallelism.tp",
                o.tp,
                f"a tensor-parallel degree dividing {where}: the dense layers' TP groups "
                f"take tp GPUs each",
            )
        if o.fsdp and (o.distributed_optimizer or o.dp_overlap):
            raise ConfigError(
                "parallelism.fsdp",
                True,
                "false with distributed_optimizer or dp_overlap (FSDP shards the "
                "parameters and reduce-scatters each unit's gradients itself)",
            )
        dp = s // o.tp
        data = (
            {"dp_shard": dp, "zero": 3, "reshard_after_forward": "always"}
            if o.fsdp
            else {"dp_replicate": dp, "dp_shard": 1}
        )
        return MeshOptions(
            **data,
            pp=o.pp,
            tp=o.tp,
            ep=o.ep,
            etp=o.etp,
            sequence_parallel=o.sequence_parallel if o.tp > 1 else False,
            microbatches=o.accumulation_steps,
            schedule=o.schedule if o.pp > 1 else "1f1b",  # pp 1: accumulation, F B F B
            virtual_stages=o.virtual_stages,
            dp_overlap=o.dp_overlap,
            bucket_size=o.bucket_size,
            first_bucket_size=o.first_bucket_size,
            distributed_optimizer=o.distributed_optimizer,
            overlap_param_gather=o.overlap_param_gather,
            wrap_depth=o.wrap_depth,
            load=o.load,
            skew=o.skew,
            seed=o.seed,
            expert_loads=o.expert_loads,
            capacity_factor=o.capacity_factor,
            dispatcher=o.dispatcher,
            dispatch_dtype=o.dispatch_dtype,
            router_groups=o.router_groups,
            router_group_topk=o.router_group_topk,
        )


PRESETS = (
    Single,
    DataParallel,
    DistributedDataParallel,
    TensorParallel,
    GPipe,
    OneFOneB,
    Hybrid,
    Sharded,
    ThreeD,
    Interleaved,
    ContextParallel,
    ExpertParallel,
)
