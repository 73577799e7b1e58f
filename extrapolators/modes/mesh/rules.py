"""What a mesh's degrees allow of its other fields, checked in one place before any
simulation (each message names its field), and what follows from them: the ZeRO level that
shards, whether that is FSDP, whether the parameters come back after the optimizer step,
and the gradients' reduction."""

from __future__ import annotations

from dataclasses import dataclass

from extrapolators.modes.blocks import RECOMPUTE_MODULES
from extrapolators.modes.dist_optimizer import grad_reduction
from triosim.common.errors import ConfigError


@dataclass(frozen=True)
class Rules:
    zero: int  # the ZeRO level that shards (0 with one data-parallel GPU)
    fsdp: bool  # zero 3: FSDP2 per unit
    params_after_step: bool  # the distributed optimizer / ZeRO-1/2 gather them after it
    reduction: str  # the gradients' collective


def field_rules(o, mesh) -> Rules:
    """What the degrees allow of the other fields (each message names its field), and
    what follows from them."""
    zero = o.zero if o.zero is not None else (3 if mesh.dp_shard > 1 else 0)
    zero_at = zero if mesh.dp_shard * mesh.cp > 1 else 0  # the level that shards
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
    if o.distributed_optimizer and zero_at:
        raise ConfigError(
            "parallelism.distributed_optimizer",
            True,
            f"false with zero {zero_at} (FSDP and ZeRO shard the optimizer states already)",
        )
    if zero_at in (1, 2) and mesh.dp_replicate > 1:
        raise ConfigError(
            "parallelism.zero",
            zero_at,
            "3 or 0 with dp_replicate > 1 (HSDP is FSDP's; ZeRO-1/2 shard over all "
            "data-parallel GPUs: dp_shard x cp)",
        )
    if o.reshard_after_forward != "default" and zero != 3:  # (asked for FSDP: kept)
        raise ConfigError(
            "parallelism.reshard_after_forward",
            o.reshard_after_forward,
            f"default with zero {zero}: only FSDP (zero 3) gathers parameters to keep or free",
        )
    if o.tp_comm_overlap and mesh.tp == 1:
        raise ConfigError(
            "parallelism.tp_comm_overlap", True, "false without tensor parallelism (tp 1)"
        )
    if o.recompute == "modules" and not o.recompute_modules:
        raise ConfigError(
            "parallelism.recompute_modules",
            [],
            "some of " + ", ".join(RECOMPUTE_MODULES) + " with recompute modules",
        )
    if o.recompute_modules and o.recompute != "modules":
        raise ConfigError(
            "parallelism.recompute_modules",
            o.recompute_modules,
            f"unset with recompute {o.recompute} (set recompute: modules)",
        )
    unknown = [m for m in o.recompute_modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ConfigError(
            "parallelism.recompute_modules",
            unknown[0],
            "one of " + ", ".join(RECOMPUTE_MODULES) + " (Megatron-Core's names)",
        )
    if o.recompute_every > 1 and o.recompute not in ("full", "op"):
        raise ConfigError(
            "parallelism.recompute_every",
            o.recompute_every,
            f"1 with recompute {o.recompute} (only full and op recompute whole blocks)",
        )
    if o.overlap_param_gather and not o.distributed_optimizer:
        raise ConfigError(
            "parallelism.overlap_param_gather",
            True,
            "false without distributed_optimizer (only the distributed optimizer "
            "all-gathers parameters)",
        )
    return Rules(
        zero=zero_at,
        fsdp=zero_at == 3,
        params_after_step=(o.distributed_optimizer or zero_at in (1, 2))
        and not o.overlap_param_gather,
        reduction=grad_reduction(o.distributed_optimizer or zero_at == 2),
    )


def check_overlap_fields(o, mesh, experts) -> None:
    """`shared_expert_overlap` and `ep_comm_overlap` against the degrees and the expert
    plan (`experts`: mesh.experts.ExpertPlan, or None without one)."""
    if o.shared_expert_overlap:
        field = "parallelism.shared_expert_overlap"
        if experts is None or experts.ep == 1 or not int(experts.moe.get("shared_experts") or 0):
            raise ConfigError(
                field,
                True,
                "false without an all-to-all beside shared experts (ep > 1 with an MoE trace "
                "whose layers have shared experts: metadata moe.shared_experts)",
            )
        if mesh.tp > 1:
            raise ConfigError(field, True, f"false with tp {mesh.tp} (modelled with tp 1 only)")
        if o.ep_comm_overlap:
            raise ConfigError(
                field,
                True,
                "false with ep_comm_overlap (Megatron-Bridge's recipes set one or the other)",
            )
    if o.ep_comm_overlap:
        field = "parallelism.ep_comm_overlap"
        if o.schedule == "gpipe":
            raise ConfigError(
                field,
                True,
                "false with schedule gpipe (it pairs a backward with the forward after it: a "
                "1F1B schedule's steady state; GPipe has none)",
            )
        if experts is None or experts.ep == 1 or mesh.pp == 1:
            raise ConfigError(
                field,
                True,
                "false without EP all-to-alls in a pipeline (it pairs a forward and a backward "
                "step of the 1F1B steady state: ep > 1 with an MoE trace, and pp > 1)",
            )
