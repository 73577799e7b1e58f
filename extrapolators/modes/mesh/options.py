"""The config fields of the general form (`parallelism: {mode: mesh, ...}`): the mesh's
degrees and order, and what each dimension's plan takes. Every preset mode (ddp, fsdp, 3d,
cp, ...) is these fields filled in (presets.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from triosim.common.schema import option


@dataclass(frozen=True)
class LoadOptions:
    """How a mixture-of-experts model's routed tokens spread over its experts (one set of
    fields for the mesh and mode ep)."""

    load: Literal["uniform", "skew", "given"] = option(
        "uniform",
        help="how the routed tokens spread over the experts: uniform, skew (Zipf over a "
        "random order drawn from seed) or given (expert_loads)",
    )
    skew: float = option(
        1.0, ge=0, help="load: skew: the r-th busiest expert's share is proportional to r^-skew"
    )
    seed: int = option(0, ge=0, help="load: skew: the seed of the experts' random order")
    expert_loads: list[float] | None = option(
        None, help="load: given: each expert's relative share of the routed tokens"
    )
    capacity_factor: float | None = option(
        None,
        gt=0,
        help="token dropping: an expert keeps at most this factor x its balanced share "
        "of its EP group's tokens (null: the trace's router's, null there: dropless)",
    )
    dispatcher: Literal["alltoall", "deepep"] = option(
        "alltoall",
        help="how tokens reach the experts: alltoall (Megatron's all-to-all dispatcher: one "
        "copy per routed expert, NCCL's all-to-all) or deepep (DeepEP's and HybridEP's "
        "normal kernels: one copy per node over the NICs, forwarded over NVLink, one per GPU)",
    )
    dispatch_dtype: Literal["bfloat16", "float8"] | None = option(
        None,
        help="what the forward dispatch sends per token: bfloat16, or float8 (DeepSeek-V3's "
        "and DeepEP's FP8 dispatch: 1 byte a value and a float32 scale per 128); null: the "
        "trace's (metadata moe.dispatch_dtype); the combine and the gradients: bfloat16",
    )
    router_groups: int | None = option(
        None,
        ge=1,
        help="group-limited routing (DeepSeek-V3: 8): the experts in this many groups of "
        "consecutive experts, each token routed within router_group_topk of them (Megatron's "
        "moe_router_num_groups); null: the trace's (metadata moe.router_groups), else none",
    )
    router_group_topk: int | None = option(
        None,
        ge=1,
        help="group-limited routing (DeepSeek-V3: 4): the groups each token's experts are "
        "chosen in (Megatron's moe_router_group_topk); null: the trace's, else all",
    )


@dataclass(frozen=True)
class MeshOptions(LoadOptions):
    pp: int = option(1, ge=1, help="pipeline-parallel degree (stages)")
    dp_replicate: int = option(
        1, ge=1, help="data-parallel replicas (DDP; with dp_shard > 1, HSDP's replicas)"
    )
    dp_shard: int = option(
        0,
        ge=0,
        help="data-parallel ranks sharding the weights (FSDP / ZeRO, `zero`); 0: what the "
        "other degrees leave of num_gpus (torchtitan's data_parallel_shard_degree -1)",
    )
    cp: int = option(1, ge=1, help="context-parallel degree: GPUs sharing each sequence")
    tp: int = option(1, ge=1, help="tensor-parallel degree: GPUs splitting each layer")
    ep: int = option(
        1,
        ge=0,
        help="expert-parallel degree of the MoE layers: the GPUs each layer's routed experts "
        "are spread over, folded out of a stage's data- and context-parallel GPUs "
        "(Megatron-Core's expert mesh); 0: a stage's GPUs / etp",
    )
    etp: int = option(
        1,
        ge=1,
        help="expert-tensor-parallel degree: each expert's weights split over etp GPUs "
        "(Megatron-Core's expert_tensor_parallel_size)",
    )
    order: list[int | str] | str = option(
        "tp-cp-dp-pp",
        help="rank order, innermost first (torchtitan's and Megatron-Core's default "
        "tp-cp-dp-pp; dp is dp_shard inside dp_replicate), or the GPU ids by mesh rank",
    )
    microbatches: int = option(
        1,
        ge=1,
        help="micro-batches each data-parallel replica's batch is split into: the pipeline's "
        "(pp > 1) or gradient accumulation steps (pp 1)",
    )
    accumulation: int = option(
        1,
        ge=1,
        help="pp > 1: the pipeline schedules an iteration runs, each over microbatches / "
        "accumulation of them (torchtitan's and NeMo Automodel's gradient accumulation "
        "around the pipeline: each schedule fills and drains, the parameters are gathered "
        "again, the gradients reduced after the last); 1: one schedule (Megatron's)",
    )
    schedule: str = option(
        "1f1b",
        help="pipeline schedule: gpipe, 1f1b, interleaved, zb1p, dualpipev (or one registered)",
    )
    virtual_stages: int = option(
        1, ge=1, help="model chunks per pipeline stage (interleaved, zb1p; dualpipev: 2)"
    )
    stages: list[int | str] = option(
        factory=list,
        help="where chunks 2.. begin: layer names or forward-op positions (default: balanced "
        "by time and boundary bytes)",
    )
    split: Literal["balanced", "uniform"] = option(
        "balanced",
        help="where cuts fall without `stages`: balanced (by time and boundary bytes, between "
        "layers); uniform (the trace's numbered layers in equal numbers a chunk, what comes "
        "before them with the first, after them with the last: Megatron's default split)",
    )
    tp_style: Literal["megatron", "channel"] = option("megatron", help="as mode tp")
    sequence_parallel: bool = option(False, help="as mode tp (Megatron's)")
    tp_comm_overlap: bool = option(
        False,
        help="Megatron's --tp-comm-overlap (TransformerEngine's userbuffers): each TP "
        "all-gather or reduce-scatter beside a linear layer runs while that layer's product "
        "runs (the product pipelined in chunks with it); false: each before or after it",
    )
    ep_comm_overlap: bool = option(
        False,
        help="Megatron's overlap_moe_expert_parallel_comm (combined 1F1B; DualPipe's overlap "
        "in effect): in the pipeline's steady state each forward step runs together with "
        "the backward step after it, layer by layer, each one's EP all-to-alls on an 'ep' "
        "stream beside the other's compute (pp > 1, experts on the mesh)",
    )
    shared_expert_overlap: bool = option(
        False,
        help="the shared experts beside the routed path (Megatron's moe_shared_expert_overlap; "
        "NeMo Automodel always): an MoE layer's dispatch all-to-all (backward: its combine's "
        "gradient) on an 'ep' stream while the compute stream runs the shared experts (tp 1)",
    )
    cp_comm: Literal["p2p", "a2a"] = option(
        "p2p", help="p2p: ring attention; a2a: all-to-all of the heads (Ulysses)"
    )
    zero: Literal[0, 1, 2, 3] | None = option(
        None,
        help="what data parallelism shards over dp_shard x cp (torchtitan's dp_shard_cp): 3 "
        "parameters, gradients and optimizer states (FSDP2: per-unit all-gathers and "
        "reduce-scatters; HSDP with dp_replicate); 2 gradients and states (buckets "
        "reduce-scattered, parameters all-gathered after the step); 1 the states (buckets "
        "all-reduced, parameters all-gathered after the step); 0 nothing (DDP over every "
        "data-parallel GPU, cp ranks included, as Megatron-LM); default: 3 with dp_shard > "
        "1, else 0",
    )
    reshard_after_forward: Literal["default", "always", "never"] = option(
        "default",
        help="zero 3: torchtitan's fsdp_reshard_after_forward: default reshards every unit "
        "but the last holding weights (with pp > 1: none), always all, never none",
    )
    wrap_depth: int | None = option(
        None,
        ge=1,
        help="zero 3: layer-name depth of a unit (torchtitan's Llama blocks: 2, layers.N; "
        "default: the model's numbered blocks, else the smallest giving >= 4 units that "
        "hold weights)",
    )
    dp_overlap: bool = option(
        True,
        help="gradient buckets reduced as the backward pass fills them (DDP, Megatron's "
        "--overlap-grad-reduce); false: all after the backward pass",
    )
    bucket_size: float = option(25 * 2**20, unit="bytes", gt=0, help="gradient bucket cap")
    first_bucket_size: float = option(2**20, unit="bytes", gt=0, help="the first bucket's cap")
    distributed_optimizer: bool = option(
        False,
        help="Megatron's distributed optimizer over the dp_replicate x cp GPUs of a stage's "
        "TP shard: buckets reduce-scattered, the step on 1/(dp_replicate x cp), parameters "
        "all-gathered after it",
    )
    overlap_param_gather: bool = option(
        False,
        help="distributed_optimizer: the updated parameters all-gathered in buckets as the "
        "next forward pass reads them (Megatron's --overlap-param-gather); false: all after "
        "the optimizer step",
    )
    recompute: Literal["none", "full", "selective", "op", "modules", "stage"] = option(
        "none",
        help="activation recomputation: full (each block's forward again before its "
        "backward), selective (the attention core, Megatron-LM's), op (torchtitan's "
        "selective op policy: all but the attention and every other matrix product), "
        "modules (Megatron-Core's recompute_modules) or stage (each pipeline chunk's "
        "whole forward before its backward, torch Pipe's)",
    )
    recompute_modules: list[str] = option(
        factory=list,
        help="recompute modules: the parts of each block recomputed, Megatron-Core's "
        "--recompute-modules: core_attn, layernorm, mla_up_proj, mlp, moe, moe_act, "
        "shared_experts",
    )
    recompute_every: int = option(
        1,
        ge=1,
        help="full / op: only every N-th block recomputed (torchtitan's selective_ac_option "
        "N with full blocks); blocks are the numbered layers (layers.N) where there are any",
    )
    recompute_microbatches: Literal["all", "except_last"] = option(
        "all",
        help="the micro-batches recomputed: all, or all but the last (torch Pipe's "
        "checkpoint='except_last')",
    )
    recompute_depth: int | None = option(
        None,
        ge=1,
        help="layer-name depth of a recomputed block (torchtitan's Llama: 2, layers.N); "
        "default: the model's numbered blocks, else the smallest giving >= 4 blocks that "
        "hold weights",
    )
