"""3D parallelism: data x tensor x pipeline (x context) parallelism on a process grid
(Megatron-LM's).

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
  - context parallelism (`cp` > 1, Megatron-LM's CP inside 3D): each replica's pipeline
    runs on cp GPUs per (stage, TP rank), each with 1/cp of the micro-batch's tokens (its
    operators, its TP collectives and its pipeline sends at that share); the attention runs
    across those cp GPUs as mode cp does it (cp_attention.py: ring attention with a "cp"
    send stream following the stage's schedule, or Ulysses' all-to-alls; cp_plan.py: the
    degree checks and bytes); CP ranks reduce gradients with the replicas (the "dp"
    stream's group is all dp x cp GPUs at a (p, t)). The grid puts CP just outside TP
    (placement tp-pp-dp: GPU ((d x pp + p) x cp + c) x tp + t). With one stage it is mode
    cp with tp exactly (tested).
  - `distributed_optimizer` (Megatron's --use-distributed-optimizer with PP: each stage's
    optimizer is built over its data-parallel group, dist_optimizer.py): on the "dp" stream
    the GPU's buckets (or, without dp_overlap, its stage's gradients at once) are
    reduce-scattered over the dp x cp GPUs at its (p, t) instead of all-reduced, the
    optimizer steps on 1/(dp x cp) of the stage's TP shard, and the updated shard is
    all-gathered over the same GPUs before the iteration ends. Memory per GPU: the stage's
    weights and gradient buffer whole, its optimizer states / (dp x cp).
Every collective and send goes through the one network, so groups contend where they
share links. Each GPU's optimizer step touches the weights it holds: its chunks' weights,
the TP-split ones 1/tp.

The mode is four modules: threed_grid.py lays out the grid and its groups, threed_buckets.py
the weights each stage holds and its gradient buckets, threed_streams.py the GPUs' streams,
and this one the options and `check`, which puts the parts together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extrapolators.modes.base import Extrapolator
from extrapolators.modes.cp_plan import plan_attention
from extrapolators.modes.pipeline import GPipe, PipelineOptions
from extrapolators.modes.schedules import schedule
from extrapolators.modes.tensor_parallel import TensorParallel, TPOptions
from extrapolators.modes.threed_buckets import StageBuckets
from extrapolators.modes.threed_grid import ThreeDGrid
from extrapolators.modes.threed_streams import ThreeDStreams
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


class ThreeD(ThreeDGrid, StageBuckets, ThreeDStreams, Extrapolator):
    """The mode: `check` lays out the grid (threed_grid.ThreeDGrid), cuts the model with the
    pipeline mode, plans tensor parallelism on one stage's group and sizes the gradient
    buckets (threed_buckets.StageBuckets); the streams are threed_streams.ThreeDStreams'."""

    name = "3d"
    Options = ThreeDOptions

    def check(self):
        o = self.options
        self._make_grid()
        pp = self.pp
        self.order_of = schedule(o.schedule)
        self.orders = [self.order_of(p, pp, o.microbatches, self.v) for p in range(pp)]
        M = o.microbatches
        self.micro = self.per_gpu_batch(self.dp * M)
        # what each GPU's operators process: its CP rank's tokens of the micro-batch
        self.op_micro = self.micro if self.cp == 1 else self.micro / self.cp
        rep_batch = self.per_gpu_batch(self.dp)
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
            host=self.host,
        )
        group0 = [self.grid[0, 0, t] for t in range(self.tp)]
        self.tpx = _TensorParallel(
            self.trace,
            self.model,
            group0,
            TPOptions(o.tp_style, o.sequence_parallel),
            batch_size=self.op_micro,
            gpu=self.gpu,
            host=self.host,
        )
        self._attention = {}  # forward or backward op id -> its forward attention's Heads
        if self.cp > 1:
            if o.tp_style != "megatron":
                raise ConfigError("parallelism.tp_style", o.tp_style, "megatron with cp > 1")
            self._attention = plan_attention(
                self.trace, self.cp, self.tp, o.cp_comm, o.sequence_parallel, mode="3d"
            )
        self._held()
        self._buckets = {p: self._make_buckets(p) for p in range(pp)} if o.dp_overlap else {}

    def op_batch(self):
        return self.op_micro

    def activation_ratio(self, op) -> float:
        return self.tpx.activation_ratio(op)


@dataclass(frozen=True)
class InterleavedOptions(ThreeDOptions):
    schedule: str = option("interleaved", help="pipeline schedule (default: interleaved)")
    virtual_stages: int = option(2, ge=1, help="model chunks per pipeline stage")


class Interleaved(ThreeD):
    """Megatron's interleaved 1F1B (virtual pipeline): `3d` with schedule 'interleaved' and
    `virtual_stages` chunks per stage (by default all GPUs are pipeline stages)."""

    name = "interleaved"
    Options = InterleavedOptions
