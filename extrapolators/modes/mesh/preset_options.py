"""The config fields of the preset modes (presets.py), as they were before the mesh: each
preset keeps its own so that every config that named a mode runs unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extrapolators.modes.mesh.options import LoadOptions
from extrapolators.modes.pipeline import PipelineOptions
from extrapolators.modes.tensor_parallel import TPOptions
from triosim.common.schema import option

__all__ = [
    "CPOptions",
    "DDPOptions",
    "DPOptions",
    "EPOptions",
    "HybridOptions",
    "InterleavedOptions",
    "PipelineOptions",
    "ShardedOptions",
    "TPOptions",
    "ThreeDOptions",
]


@dataclass(frozen=True)
class DPOptions:
    accumulation_steps: int = option(
        1,
        ge=1,
        help="gradient accumulation: forward and "
        "backward this many times on batch/N/steps before "
        "the gradients are reduced",
    )
    recompute: Literal["none", "full", "selective", "op"] = option(
        "none",
        help="activation recomputation: full (every block's forward again before its "
        "backward), selective (the attention core, as Megatron-LM) or op (torchtitan's "
        "selective op policy)",
    )
    recompute_depth: int | None = option(
        None,
        ge=1,
        help="layer-name depth of a recomputed block (torchtitan's Llama: 2, layers.N); "
        "default: the numbered blocks (layers.N), else the smallest giving >= 4 with weights",
    )


@dataclass(frozen=True)
class DDPOptions(DPOptions):
    bucket_size: float = option(
        25 * 2**20,
        unit="bytes",
        gt=0,
        help="gradient bucket cap (PyTorch's bucket_cap_mb=25: 25 MiB)",
    )
    first_bucket_size: float = option(
        2**20, unit="bytes", gt=0, help="the first bucket's cap (PyTorch: 1 MiB)"
    )


@dataclass(frozen=True)
class ShardedOptions:
    stage: Literal[1, 2, 3] = option(
        3, help="ZeRO stage: 1 optimizer states, 2 + gradients, 3 + parameters (FSDP)"
    )
    wrap_depth: int | None = option(
        None,
        ge=1,
        help="layer-name depth of a unit (default: the numbered blocks, else the smallest giving >= 4)",
    )
    reshard_after_forward: bool = option(
        True,
        help="FSDP2: free gathered parameters after forward and gather them again for backward",
    )
    bucket_size: float = option(25 * 2**20, unit="bytes", gt=0, help="ZeRO-1/2 gradient bucket cap")
    recompute: Literal["none", "full", "selective", "op"] = option(
        "none", help="activation recomputation (as for dp): full per block, selective or op"
    )


@dataclass(frozen=True)
class HybridOptions:
    dp: int = option(1, ge=1, help="data-parallel replicas (num_gpus / dp GPUs each)")
    inner: str = option("single", help="the mode inside each replica (tp, gpipe, 1f1b, single)")
    inner_options: object = option(None, flatten=True)  # the inner mode's own fields


@dataclass(frozen=True)
class ThreeDOptions:
    dp: int = option(1, ge=1, help="data-parallel degree (replicas)")
    tp: int = option(1, ge=1, help="tensor-parallel degree (GPUs per stage)")
    pp: int = option(0, ge=0, help="pipeline-parallel degree (stages); 0: num_gpus / (dp x tp)")
    microbatches: int = option(1, ge=1, help="micro-batches each replica's batch is split into")
    schedule: str = option(
        "1f1b",
        help="pipeline schedule: gpipe, 1f1b, interleaved, zb1p, dualpipev (or one "
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
    cp: int = option(
        1,
        ge=1,
        help="context-parallel degree: GPUs sharing each sequence of a replica (its pipeline "
        "on 1/cp of the tokens each), just outside TP in the grid; as mode cp",
    )
    cp_comm: Literal["p2p", "a2a"] = option("p2p", help="as mode cp (ring attention or Ulysses)")
    distributed_optimizer: bool = option(
        False,
        help="Megatron's distributed optimizer per stage: gradients reduce-scattered over the "
        "stage's dp x cp GPUs, the step on 1/(dp x cp) of its weights, parameters all-gathered",
    )


@dataclass(frozen=True)
class InterleavedOptions(ThreeDOptions):
    schedule: str = option("interleaved", help="pipeline schedule (default: interleaved)")
    virtual_stages: int = option(2, ge=1, help="model chunks per pipeline stage")


@dataclass(frozen=True)
class CPOptions(DDPOptions):
    cp: int = option(
        0,
        ge=0,
        help="context-parallel degree: GPUs sharing one sequence, 1/cp of its tokens each "
        "(0: num_gpus); num_gpus / cp groups are data-parallel replicas",
    )
    cp_comm: Literal["p2p", "a2a"] = option(
        "p2p",
        help="p2p: ring attention, key/value blocks passed around the group overlapped "
        "with blockwise attention (Megatron-LM's default); a2a: all-to-all of the heads "
        "(DeepSpeed-Ulysses)",
    )
    tp: int = option(
        1,
        ge=1,
        help="tensor-parallel degree inside each CP rank (Megatron's order: TP innermost, "
        "then CP, then DP); num_gpus / (tp x cp) data-parallel replicas",
    )
    sequence_parallel: bool = option(
        False, help="with tp > 1: Megatron's sequence parallelism on the CP rank's tokens"
    )
    distributed_optimizer: bool = option(
        False,
        help="Megatron's distributed optimizer: optimizer states sharded over the dp x cp "
        "GPUs holding a TP shard, gradients reduce-scattered, parameters all-gathered",
    )
    fsdp: bool = option(
        False,
        help="FSDP2 over the dp x cp GPUs holding a TP shard (torchtitan's dp_shard_cp): "
        "each unit's parameters all-gathered before its forward and backward, its "
        "gradients reduce-scattered; weights, gradients and optimizer states 1/(dp x cp)",
    )
    reshard_after_forward: Literal["default", "always", "never"] = option(
        "default",
        help="fsdp: torchtitan's fsdp_reshard_after_forward: default reshards every unit "
        "but the last holding weights (the final norm and output), always all, never none",
    )
    wrap_depth: int | None = option(
        None,
        ge=1,
        help="fsdp: layer-name depth of a unit (as mode fsdp; torchtitan's Llama blocks: 2, "
        "layers.N; default: the numbered blocks, else the smallest giving >= 4 with weights)",
    )


@dataclass(frozen=True)
class EPOptions(LoadOptions):
    ep: int = option(
        0,
        ge=0,
        help="expert-parallel degree: the GPUs an MoE layer's experts are spread over "
        "(a divisor of num_gpus and of the experts; 0: all GPUs); num_gpus / ep data-"
        "parallel replicas of each expert",
    )
    accumulation_steps: int = option(
        1,
        ge=1,
        help="gradient accumulation: forward and backward (with their all-to-alls) this "
        "many times on batch / num_gpus / steps before the gradients are reduced; with pp "
        "> 1 the micro-batches each pipeline runs (of batch / (num_gpus / pp / tp) / steps "
        "sequences per replica)",
    )
    dp_overlap: bool = option(
        False,
        help="reduce the gradients in buckets as the backward pass makes them (DDP's, "
        "Megatron-LM's --overlap-grad-reduce), dense and expert ones apart; false: all "
        "after the backward pass",
    )
    bucket_size: float = option(
        25 * 2**20, unit="bytes", gt=0, help="dp_overlap: gradient bucket cap (25 MiB)"
    )
    first_bucket_size: float = option(
        2**20, unit="bytes", gt=0, help="dp_overlap: the first bucket's cap of each kind"
    )
    tp: int = option(
        1,
        ge=1,
        help="tensor-parallel degree of the dense layers (attention, shared experts, "
        "embedding, head: Megatron's column/row split, sequence parallel); num_gpus / tp "
        "data-parallel replicas of them",
    )
    etp: int = option(
        1,
        ge=1,
        help="expert-tensor-parallel degree: each expert's weights split over etp GPUs "
        "(Megatron-Core's expert_tensor_parallel_size; 1, its recommended MoE setting); ep "
        "x etp divides num_gpus",
    )
    sequence_parallel: bool = option(
        True,
        help="tp > 1: Megatron's sequence parallelism (Megatron-Core requires it for MoE "
        "with TP; false is refused there)",
    )
    distributed_optimizer: bool = option(
        False,
        help="Megatron's distributed optimizer (ZeRO-1): gradients reduce-scattered over "
        "each weight's data-parallel group, the optimizer on that shard, the updated "
        "parameters all-gathered after the step",
    )
    overlap_param_gather: bool = option(
        False,
        help="distributed_optimizer: the parameter all-gathers overlap the forward pass "
        "(Megatron's --overlap-param-gather: each bucket gathered before the first "
        "operator that reads it); false: all after the optimizer step",
    )
    fsdp: bool = option(
        False,
        help="ZeRO-3 / FSDP: each GPU keeps 1/dp of its dense and 1/edp of its experts' "
        "weights, gradients and optimizer states; each unit's parameters all-gathered "
        "before its forward and backward, its gradients reduce-scattered",
    )
    wrap_depth: int | None = option(
        None,
        ge=1,
        help="fsdp: layer-name depth of a unit (as mode fsdp; default: the numbered blocks, "
        "layers.N, as torchtitan wraps them; else the smallest giving >= 4 units)",
    )
    pp: int = option(
        1,
        ge=1,
        help="pipeline-parallel degree: stages of num_gpus / pp GPUs each (Megatron-Core's "
        "order tp-cp-ep-dp-pp: PP outermost), each holding its share of the layers with "
        "the tp, ep and etp groups inside it; accumulation_steps micro-batches go through "
        "them (with fsdp too: the units per stage)",
    )
    schedule: str = option(
        "1f1b",
        help="pp > 1: the pipeline schedule, as mode 3d's (1f1b, gpipe, interleaved with "
        "virtual_stages > 1, zb1p, dualpipev with virtual_stages 2)",
    )
    virtual_stages: int = option(
        1,
        ge=1,
        help="pp > 1, schedule interleaved: model chunks per stage (Megatron's virtual "
        "pipeline); stage p holds chunks p, p + pp, ...",
    )
