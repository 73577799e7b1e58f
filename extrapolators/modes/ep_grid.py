"""Expert parallelism's process grid: which GPUs form each group, as Megatron-Core lays
them out, and the degree checks.

Megatron-Core (megatron/core/parallel_state.py, initialize_model_parallel) builds two rank
generators over the same world, both in the order "tp-cp-ep-dp-pp" (the first name
varies fastest); here cp = 1. PP varies slowest: pipeline stage p is the s = n / pp
consecutive GPUs p x s .. (p + 1) x s - 1, and every group below lies inside one stage,
laid out on the stage's GPUs (local index l = i % s) as on a world of s GPUs; a pipeline
group is the pp GPUs with the same local index (stride s). So dp = n / (tp x pp) and
edp = n / (etp x ep x pp) (Megatron-Core: expert_data_parallel_size = world //
(etp x ep x pp)):

- the dense layers' (attention, router, shared experts, embedding, head): tensor-parallel
  rank t = i % tp, data-parallel rank d = i // tp; a TP group is tp consecutive GPUs, a
  dense data-parallel group the dp = n / tp GPUs with the same t;
- the routed experts': expert-TP rank i % etp, EP rank (i // etp) % ep, expert-DP rank
  i // (etp x ep), with expert_data_parallel_size = world / (etp x ep) ("EP is carved out
  of the DP x TP ranks": the same GPUs regrouped, not a new axis). An EP group is the ep
  GPUs sharing the expert-TP and expert-DP ranks (stride etp), an expert-TP group etp
  consecutive GPUs, an expert-DP group (an expert's replicas) the edp GPUs sharing the
  expert-TP and EP ranks.

Megatron's checks, each a ConfigError naming the field, its degree and the counts: pp
divides the GPUs; then, on a stage's s GPUs (the counts say num_gpus / pp with pp > 1): tp
divides them (world % (tp x pp x cp)); etp x ep divides the GPUs (world % (etp x ep x
pp), "not divisible by expert_tensor_model_pipeline_parallel size"); ep divides the experts
(num_moe_experts % expert_model_parallel_size); etp divides each expert's FFN width (the
expert linear layers' output and input features). With tp = etp = 1 the groups are mode
`ep`'s: EP groups of ep consecutive GPUs, an expert's replicas every ep-th GPU, the dense
data-parallel group all GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from triosim.common.errors import ConfigError


@dataclass(frozen=True)
class EPGrid:
    """n GPUs (by index 0..n-1) as pp stages of s = n / pp, each tp x dp for the dense
    layers and etp x ep x edp for the experts (module docstring); groups are tuples of GPU
    indices in rank order, each inside one stage; ranks are within the stage."""

    n: int
    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1

    @property
    def s(self) -> int:
        """GPUs per pipeline stage."""
        return self.n // self.pp

    @property
    def dp(self) -> int:
        """Dense data-parallel degree: the replicas of a TP-split dense weight."""
        return self.s // self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: the replicas of an expert's (etp-split) weights."""
        return self.s // (self.ep * self.etp)

    def stage(self, i: int) -> int:
        """Pipeline stage of GPU i."""
        return i // self.s

    def pp_peer(self, i: int, p: int) -> int:
        """The GPU of stage p with GPU i's local index (its pipeline group's member)."""
        return p * self.s + i % self.s

    def dense(self, i: int) -> tuple[int, int]:
        """(TP rank, dense DP rank) of GPU i."""
        i %= self.s
        return i % self.tp, i // self.tp

    def expert(self, i: int) -> tuple[int, int, int]:
        """(expert-TP rank, EP rank, expert-DP rank) of GPU i."""
        i %= self.s
        return i % self.etp, (i // self.etp) % self.ep, i // (self.etp * self.ep)

    def tp_group(self, i: int) -> tuple:
        start = i - i % self.tp
        return tuple(range(start, start + self.tp))

    def dp_group(self, i: int) -> tuple:
        base = i - i % self.s
        return tuple(range(base + i % self.tp, base + self.s, self.tp))

    def ep_group(self, i: int) -> tuple:
        t, _, d = self.expert(i)
        base = i - i % self.s + d * self.etp * self.ep + t
        return tuple(base + e * self.etp for e in range(self.ep))

    def etp_group(self, i: int) -> tuple:
        start = i - i % self.etp
        return tuple(range(start, start + self.etp))

    def edp_group(self, i: int) -> tuple:
        t, e, _ = self.expert(i)
        base, step = i - i % self.s, self.etp * self.ep
        return tuple(range(base + e * self.etp + t, base + self.s, step))


def make_grid(
    n: int, tp: int, ep: int, etp: int, experts: int, expert_ffn=None, pp: int = 1
) -> EPGrid:
    """The grid, after Megatron-Core's checks (module docstring); ep 0: a stage's GPUs /
    etp."""
    if n % pp:
        raise ConfigError(
            "parallelism.pp",
            pp,
            f"a pipeline-parallel degree dividing num_gpus ({n}): each stage takes num_gpus "
            f"/ pp GPUs",
        )
    world = n
    n //= pp  # the checks below are per stage (Megatron-Core: world % (x x pp))
    where = f"num_gpus ({n})" if pp == 1 else f"num_gpus / pp ({world} / {pp} = {n})"
    if n % tp:
        raise ConfigError(
            "parallelism.tp",
            tp,
            f"a tensor-parallel degree dividing {where}: the dense layers' TP groups "
            f"take tp GPUs each",
        )
    if n % etp:
        raise ConfigError(
            "parallelism.etp", etp, f"an expert-tensor-parallel degree dividing {where}"
        )
    ep = ep or n // etp
    if n % (ep * etp):
        raise ConfigError(
            "parallelism.ep",
            ep,
            f"ep x etp ({ep} x {etp}) dividing {where} (Megatron-Core: the world size "
            f"divisible by expert-TP x EP{' x PP' if pp > 1 else ''})",
        )
    if experts % ep:
        raise ConfigError(
            "parallelism.ep", ep, f"a divisor of {where} and of the {experts} experts"
        )
    if expert_ffn is not None and int(expert_ffn) % etp:
        raise ConfigError(
            "parallelism.etp",
            etp,
            f"an expert-tensor-parallel degree dividing each expert's FFN width "
            f"({int(expert_ffn)}): each GPU takes an equal shard of every expert",
        )
    return EPGrid(world, tp, ep, etp, pp)
