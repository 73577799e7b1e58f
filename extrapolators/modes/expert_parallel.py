"""Expert parallelism (`mode: ep`) with data parallelism, tensor parallelism of the dense
layers, expert tensor parallelism and the distributed optimizer, as Megatron-Core runs an
MoE model (and DeepSpeed-MoE its EP x DP).

The GPUs (ep_grid.py: Megatron-Core's parallel_state groups, order tp-cp-ep-dp-pp): the
dense layers (attention, router, shared experts, embedding, head) are tensor-parallel over
`tp` consecutive GPUs (ep_tp.py: Megatron's column/row split, sequence parallel, which
Megatron-Core requires for MoE with TP) with dp = num_gpus / tp replicas; the routed
experts of each MoE layer are spread over the `ep` GPUs of an EP group, E / ep on each,
each expert's weights split over `etp` GPUs (expert_tensor_parallel_size; default 1, the
"MoE parallel folding" setting Megatron-Core's MoE README recommends: TP for attention,
TP 1 for the experts), with edp = num_gpus / (ep x etp) replicas. EP is carved out of the
dp x tp GPUs: with etp 1 an EP group is ep consecutive GPUs (one node's), spanning TP
ranks. At tp = etp = 1 this is EP x DP: num_gpus = dp x ep.

Per MoE layer and GPU, on the compute stream (the tokens' path blocks it), as Megatron-
Core's all-to-all token dispatcher (token_dispatcher.py: permute -> A2A(EP) -> AG(ETP);
RS(ETP) -> A2A(EP) -> unpermute; its local tokens are S/TP x B):

- forward: the dispatch all-to-all before the layer's routed experts (each token's hidden
  state to the GPU of each expert it was routed to), with etp > 1 an all-gather of what
  the expert-TP group's GPUs received, the experts' operators, with etp > 1 a reduce-
  scatter of their outputs, the combine all-to-all (the outputs back);
- backward: the combine's gradient (the outputs' gradients to the experts' GPUs; with
  etp > 1 then all-gathered) before the experts' backward operators, the dispatch's
  gradient (reduce-scattered first) after them.

Bytes by hand, per GPU and MoE layer, uniform loads, dropless, a replica's micro-batch of
S tokens (sequence x micro-batch), hidden H, top-k, dispatched dtype of d bytes:
  - a GPU holds S / tp tokens (sequence parallel) and routes each to k experts: its
    all-to-all buffer is S / tp x k x H x d, of which (ep - 1) / ep leaves it, 4 times
    (dispatch, combine, and both in backward). Mixtral 8x7B (S 4096, H 4096, k 2, bf16):
    67.1 MB at tp 1, 33.6 MB at tp 2;
  - etp > 1: the expert-TP all-gather's buffer is etp x the tokens the GPU received (etp x
    S / tp x k x H x d), (etp - 1) / etp of it arriving, and the reduce-scatter the same,
    twice each (forward and backward); the experts then run etp x S / tp x k tokens at
    1/etp of their width: the FLOPs of etp 1;
  - the dense layers' TP collectives are mode tp's with sequence parallelism (per
    attention block S x H x 2 bytes: forward all-gather of the column layers' input and
    reduce-scatter of the row layer's output; backward all-gather of the row layer's
    output gradient, of the column layers' input again, reduce-scatter of its gradient),
    and the router's and norms' gradients all-reduced over the TP group at the end;
  - gradients: each GPU's dense share (the TP-split weights / tp, the rest whole) over
    its dp replicas (GPUs with its TP rank), its experts' (E / ep experts / etp) over its
    edp replicas (GPUs with its expert-TP and EP ranks): all-reduced, or with
    `distributed_optimizer` (Megatron's, ZeRO-1) reduce-scattered and, after the step
    on the 1/dp (1/edp) shard, the parameters all-gathered over the same groups: each
    GPU moves (g - 1) / g x bytes twice, one all-reduce's worth.

EP rank i sends rank j 1/ep of the tokens kept by j's experts (moe_loads.dispatch_sizes),
so uneven loads give uneven all-to-alls. An expert operator's time is the performance
model's on a view of the trace holding one GPU's experts (weights, casts, gradients at
1/(ep x etp) of the bytes) at the batch giving the tokens the GPU's experts keep (its
scale: those tokens over the E x capacity slots the trace's grouped GEMMs processed at
this batch; 1 with uniform loads and dropless routing): the GEMMs keep their FLOPs per
token but read 1/(ep x etp) of the weights, so fine-grained experts with few tokens each,
weight-bound on one GPU, come out compute-bound. With etp > 1 an expert GEMM is timed at
the GPU's own token count at full width (the FLOPs and weight bytes of etp x the tokens
at 1/etp of the width), its tensors at the model's hidden width (the gathered input, the
row layer's output before its reduce-scatter, their gradients) etp x the GPU's own. With
the replay model (`perfmodel.kind: trace`) the traced time is scaled by the token share
instead (1/(ep x etp) for an expert operator that touches no token). After the backward
pass (or, with `dp_overlap`, in buckets as the backward pass makes them: ep_buckets,
dense and expert apart), on the comm stream, the gradients are reduced as above; the
optimizer step runs on what the GPU holds (its time x held / all weight bytes; with the
distributed optimizer x its shard).

Memory per GPU: weights and gradients of what it holds (dense / tp where split, experts
/ (ep x etp)); optimizer states of the same, or with the distributed optimizer 1/dp of
the dense and 1/edp of the experts'; activations of the dense layers as mode tp's (1/tp
where split or sequence-parallel), the experts' at the busiest GPU's tokens.

What the trace must say (metadata `moe`, docs/trace-format.md): the experts' module
(`expert_module`: operators whose layer ends with it, weights named under it; its parent
is the MoE layer), the number of experts, top-k, hidden size, the traced tokens and
capacity, the dispatched dtype, the router's capacity factor, `expert_ffn` for etp > 1.
With `accumulation_steps` k, forward and backward (and their all-to-alls) run k times on
a replica's batch / k before the gradients are reduced. With `fsdp` (ZeRO-3, ep_fsdp.py)
each GPU keeps 1/dp of its dense and 1/edp of its experts' weights, gradients and
optimizer states, gathering each unit's parameters before its forward and backward and
reduce-scattering its gradients after. With `pp` > 1 (ep_pipeline.py) the GPUs form pp
pipeline stages (PP outermost, Megatron-Core's order), each laid out as above on num_gpus /
pp GPUs and running its share of the layers under mode 3d's schedules (1f1b by default)
over `accumulation_steps` micro-batches, the activations sent between stages as in 3d.
Not modelled: overlap of the all-to-alls with compute (DeepSeek's
DualPipe, Megatron's --overlap-moe-expert-parallel-comm), of the parameter all-gather
with the next forward pass (--overlap-param-gather), TP communication overlap.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Literal

from extrapolators.execution.symmetry import Symmetry
from extrapolators.execution.tasks import Collective, ComputeRun, Signal, Wait
from extrapolators.modes import ep_buckets, ep_grid, moe_loads
from extrapolators.modes.base import Extrapolator
from extrapolators.modes.ep_fsdp import EPFsdp
from extrapolators.modes.ep_pipeline import EPPipeline
from extrapolators.modes.tp_roles import SHARDED
from perfmodel.base import Target, batch_ratio, scales_with_batch
from perfmodel.replay import TraceTime
from triosim.common.errors import ConfigError
from triosim.common.schema import option
from triosim.trace.model import DTYPE_BYTES, Trace

MOE_FIELDS = ("expert_module", "num_experts", "top_k", "hidden", "tokens", "capacity")


@dataclass(frozen=True)
class EPOptions:
    ep: int = option(
        0,
        ge=0,
        help="expert-parallel degree: the GPUs an MoE layer's experts are spread over "
        "(a divisor of num_gpus and of the experts; 0: all GPUs); num_gpus / ep data-"
        "parallel replicas of each expert",
    )
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
        "before its forward and backward, its gradients reduce-scattered (ep_fsdp.py)",
    )
    wrap_depth: int | None = option(
        None,
        ge=1,
        help="fsdp: layer-name depth of a unit (as mode fsdp; default: the smallest giving "
        ">= 4 units; torchtitan's per-block wrapping of layers.N is 2)",
    )
    pp: int = option(
        1,
        ge=1,
        help="pipeline-parallel degree: stages of num_gpus / pp GPUs each (Megatron-Core's "
        "order tp-cp-ep-dp-pp: PP outermost), each holding its share of the layers with "
        "the tp, ep and etp groups inside it; accumulation_steps micro-batches go through "
        "them (ep_pipeline.py)",
    )
    schedule: str = option(
        "1f1b",
        help="pp > 1: the pipeline schedule, as mode 3d's (1f1b, gpipe, or interleaved "
        "with virtual_stages > 1)",
    )
    virtual_stages: int = option(
        1,
        ge=1,
        help="pp > 1, schedule interleaved: model chunks per stage (Megatron's virtual "
        "pipeline); stage p holds chunks p, p + pp, ...",
    )
    capacity_factor: float | None = option(
        None,
        gt=0,
        help="token dropping: an expert keeps at most this factor x its balanced share "
        "of its EP group's tokens (null: the trace's router: its moe.capacity_factor, "
        "null there: dropless)",
    )


class ExpertParallel(EPFsdp, EPPipeline, Extrapolator):
    """Expert parallelism with data, tensor, expert-tensor and pipeline parallelism, the
    distributed optimizer or FSDP (module docstring)."""

    name = "ep"
    Options = EPOptions

    def check(self):
        moe = self.trace.metadata.get("moe")
        if not isinstance(moe, dict):
            raise ConfigError(
                "parallelism.mode",
                "ep",
                "a trace with mixture-of-experts layers (metadata 'moe': `triosim trace "
                "mixtral-8x7b` or `deepseek-v3` writes it)",
            )
        missing = [k for k in MOE_FIELDS if k not in moe]
        if missing:
            raise ConfigError("trace", "metadata moe", f"the fields {', '.join(missing)}")
        self.moe = moe
        n, o = len(self.gpus), self.options
        experts = int(moe["num_experts"])
        ffn = moe.get("expert_ffn") if o.etp > 1 else None
        self.grid = ep_grid.make_grid(n, o.tp, o.ep, o.etp, experts, ffn, o.pp)
        self.ep, self.tp, self.etp, self.pp = self.grid.ep, o.tp, o.etp, o.pp
        self._check_options()
        if not 1 <= int(moe["top_k"]) <= experts:
            raise ConfigError("trace", "metadata moe.top_k", f"1 to the {experts} experts")
        self.dp = self.grid.edp  # each expert's replicas
        ratio = batch_ratio(self.trace, Target(batch_size=self.op_batch()))
        cf = o.capacity_factor if o.capacity_factor is not None else moe.get("capacity_factor")
        shares = moe_loads.expert_shares(
            experts, int(moe["top_k"]), o.load, o.skew, o.seed, o.expert_loads
        )
        tokens = float(moe["tokens"]) * ratio  # per GPU (tp > 1: its 1/tp of the sequence)
        kept = moe_loads.kept_tokens(shares, tokens, int(moe["top_k"]), self.ep, cf)
        traced = experts * float(moe["capacity"]) * ratio  # the trace's slots at this batch
        self.shares, self.kept = shares, kept
        self.gpu_tokens = moe_loads.per_gpu(kept, self.ep)
        self.expert_scale = [x / traced for x in self.gpu_tokens]
        token_bytes = float(moe["hidden"]) * DTYPE_BYTES[moe.get("dispatch_dtype", "bfloat16")]
        self.sizes = moe_loads.dispatch_sizes(kept, self.ep, token_bytes)
        self.back = moe_loads.transpose(self.sizes)
        # expert TP: what each EP rank's GPUs all-gather after the dispatch (and reduce-
        # scatter before the combine): the tokens all etp ranks received, etp x its own
        self.etp_bytes = [self.etp * sum(col) for col in zip(*self.sizes, strict=True)]
        self._split_trace()
        self.tpx = self._dense_tp() if self.tp > 1 else None
        split = self.tpx.sharded_weights() if self.tpx else set()
        split_bytes = sum(self.trace.tensors[w].nbytes for w in split)
        self.split_weights = split
        self.dense_held = self.dense_bytes - split_bytes + split_bytes / self.tp
        self.expert_held = self.expert_bytes / (self.ep * self.etp)
        self.stage_held = [(self.dense_held, self.expert_held)]  # (dense, expert) per stage
        if self.pp > 1:
            self._plan_pipeline()
        if o.dp_overlap:
            self._make_buckets()
        self.fsdp_first, self.fsdp_last_bwd = {}, {}
        if o.fsdp:
            self._plan_fsdp()
        self.param_gathers, self.gather_before = [], {}
        self.stage_gathers = [[] for _ in range(self.pp)]
        if o.overlap_param_gather:  # per pipeline stage: its own weights' (one at pp 1)
            ops = self.trace.operators
            for p, only in enumerate(self.stage_weights if self.pp > 1 else [None]):
                made = self.stage_gathers[p] = ep_buckets.param_buckets(
                    self.trace, self.expert_weights, o.bucket_size, self._share_of(), only
                )
                for k, (pos, _, _) in enumerate(made):
                    if pos < len(ops):
                        self.gather_before.setdefault(ops[pos].id, []).append(k)
            self.param_gathers = self.stage_gathers[0]

    def _check_options(self):
        """Combinations Megatron-Core (or the mode) refuses, each naming its field."""
        o = self.options
        if o.tp > 1 and not o.sequence_parallel:
            raise ConfigError(
                "parallelism.sequence_parallel",
                False,
                f"true with tp {o.tp} (Megatron-Core: 'When using MoE and tensor "
                f"parallelism, sequence parallelism must be used')",
            )
        if o.overlap_param_gather and not o.distributed_optimizer:
            raise ConfigError(
                "parallelism.overlap_param_gather",
                True,
                "false without distributed_optimizer (only the distributed optimizer "
                "all-gathers parameters)",
            )
        if o.virtual_stages > 1 and o.pp < 2:
            raise ConfigError(
                "parallelism.virtual_stages",
                o.virtual_stages,
                "1 without pipeline stages (pp >= 2 to interleave)",
            )
        for field in ("fsdp",) if o.pp > 1 else ():
            if getattr(o, field):
                raise ConfigError(
                    f"parallelism.{field}",
                    True,
                    f"false with pp {o.pp} (mode ep's FSDP units are planned for one "
                    f"pipeline stage)",
                )
        if o.fsdp and (o.distributed_optimizer or o.dp_overlap):
            raise ConfigError(
                "parallelism.fsdp",
                True,
                "false with distributed_optimizer or dp_overlap (FSDP shards the "
                "parameters and reduce-scatters each unit's gradients itself)",
            )

    def _split_trace(self):
        """Which operators and weights are the routed experts', and where each MoE layer's
        forward and backward expert operators begin and end."""
        mark = "." + self.moe["expert_module"] + "."

        def expert(name):
            return name is not None and mark in "." + name + "."

        self.expert_ops = {o.id for o in self.trace.operators if expert(o.layer)}
        if not self.expert_ops:
            raise ConfigError(
                "trace",
                "metadata moe.expert_module",
                f"a module some operators' layer ends with ({self.moe['expert_module']!r})",
            )
        self.expert_weights = {t.id for t in self.trace.weights() if expert(t.name)}
        ex = sum(self.trace.tensors[w].nbytes for w in self.expert_weights)
        self.expert_bytes, self.dense_bytes = ex, self.trace.weight_bytes() - ex
        self.buckets = []  # (ready position, bytes, kind), with dp_overlap
        self.signals_after: dict = {}  # op id -> buckets its gradient completes
        self.before: dict = {}  # op id -> [(layer, kind, sizes)] of all-to-alls before it
        self.after: dict = {}
        for phase, first, last in (
            ("forward", ("dispatch", self.sizes), ("combine", self.back)),
            ("backward", ("combine-grad", self.sizes), ("dispatch-grad", self.back)),
        ):
            span: dict = {}
            for o in self.ops(phase):
                if o.id in self.expert_ops:
                    span.setdefault(o.layer, [o.id, o.id])[1] = o.id
            for layer, (a, b) in span.items():
                self.before.setdefault(a, []).append((layer, *first))
                self.after.setdefault(b, []).append((layer, *last))

    def _make_buckets(self):
        """dp_overlap: the gradient buckets, each weight at the share a GPU holds (an
        expert's 1/(ep x etp), a TP-split dense weight's 1/tp), and which backward
        operator completes each."""
        o = self.options
        share = self._share_of() if self.tp > 1 or self.etp > 1 else None
        if self.pp > 1:  # each stage's own (ep_pipeline)
            self._make_stage_buckets(share)
            return
        self.buckets = ep_buckets.buckets(
            self.trace, self.expert_weights, self.ep, o.first_bucket_size, o.bucket_size, share
        )
        ops = self.trace.operators
        for k, (pos, _, _) in enumerate(self.buckets):
            if ops[pos].phase != "optimizer":
                self.signals_after.setdefault(ops[pos].id, []).append(k)

    def _share_of(self):
        """w -> the share of weight w a GPU holds: an expert's 1/(ep x etp), a TP-split
        dense weight's 1/tp, any other whole."""
        ex, tp = 1.0 / (self.ep * self.etp), self.tp
        split, experts = self.split_weights, self.expert_weights

        def share(w):
            if w in experts:
                return ex
            return 1.0 / tp if w in split else 1.0

        return share

    def _dense_tp(self):
        """The dense layers' TP plan (ep_tp.DenseTensorParallel) on one TP group's GPUs, at
        a replica's micro-batch; its collectives are re-grouped per GPU (`_tp_task`)."""
        from extrapolators.modes.ep_tp import DenseTensorParallel, moe_block_ops
        from extrapolators.modes.tensor_parallel import TPOptions

        o = self.options
        if "." not in self.moe["expert_module"]:
            raise ConfigError(
                "trace",
                "metadata moe.expert_module",
                "a module under its MoE layer's (`feed_forward.experts`) with tp > 1: the "
                "MoE layer's module tells the router (not split) from the attention",
            )
        self.micro = self.per_gpu_batch(self.grid.dp * o.accumulation_steps)
        return DenseTensorParallel(
            self.trace,
            self.model,
            self.gpus[: self.tp],
            TPOptions("megatron", True),
            batch_size=self.micro,
            gpu=self.gpu,
            host=self.host,
            moe_ops=moe_block_ops(self.trace, self.moe),
            expert_ops=self.expert_ops,
        )

    def op_batch(self):
        """The batch whose tokens a GPU routes: batch / (num_gpus / pp) / steps (tp > 1:
        a replica's micro-batch / tp, its share of the sequence; possibly fractional)."""
        o = self.options
        n = len(self.gpus) // o.pp  # a stage's GPUs: the replicas' micro-batches over them
        if o.tp == 1:
            return self.per_gpu_batch(n * o.accumulation_steps)
        return self.per_gpu_batch(n // o.tp * o.accumulation_steps) / o.tp

    def held(self, gpu) -> tuple[float, float]:
        """(dense, expert) weight bytes `gpu` holds: its stage's (all of them at pp 1)."""
        if self.pp == 1:
            return self.dense_held, self.expert_held
        return self.stage_held[self.grid.stage(self.gpus.index(gpu))]

    def held_weight_bytes(self, gpu) -> float:
        if self.pp == 1:
            return self.dense_held + self.expert_held
        return sum(self.held(gpu))

    def _stage_key(self, gpu) -> str:
        """A prefix making a group's collective keys unique across pipeline stages (their
        groups have the same ranks): none at pp 1."""
        return "" if self.pp == 1 else f"s{self.grid.stage(self.gpus.index(gpu))}"

    def state_fractions(self) -> dict | None:
        """distributed_optimizer: the optimizer states of 1/dp of the dense weights a GPU
        holds and 1/edp of its experts' (Megatron's distributed optimizer shards them over
        each parameter's data-parallel group); weights and gradients whole. With pp > 1
        they differ per stage: `state_fractions_of(gpu)`."""
        return self.state_fractions_of(self.gpus[0])

    def state_fractions_of(self, gpu) -> dict | None:
        if self.options.fsdp:  # ZeRO-3: a shard of everything
            f = self.fsdp_fraction()
            return {"weights": f, "gradients": f, "optimizer_states": f}
        if not self.options.distributed_optimizer:
            return None
        total = self.trace.weight_bytes()
        dense, expert = self.held(gpu)
        held = (dense + expert) / total
        states = (dense / self.grid.dp + expert / self.grid.edp) / total
        return {"weights": held, "gradients": held, "optimizer_states": states}

    def activation_ratio(self, op) -> float:
        if op.id in self.expert_ops:  # sized at the busiest GPU's tokens (one plan for all)
            return super().activation_ratio(op) * max(self.expert_scale)
        if self.tpx is not None:
            return self.tpx.activation_ratio(op)
        return super().activation_ratio(op)

    def groups(self, gpu) -> tuple[int, int, tuple, tuple]:
        """(expert-DP rank, EP rank, EP group, expert data-parallel group) of `gpu`
        (ep_grid: Megatron-Core's expert groups)."""
        i = self.gpus.index(gpu)
        _, j, d = self.grid.expert(i)
        return (
            d,
            j,
            tuple(self.gpus[k] for k in self.grid.ep_group(i)),
            tuple(self.gpus[k] for k in self.grid.edp_group(i)),
        )

    def symmetry(self) -> Symmetry:
        """Copies along the EP rank where every rank's experts keep the same tokens (uniform
        loads) and no TP group spans EP ranks (tp 1), else along the expert-data-parallel
        rank (each stage's EP blocks): copy k's GPUs run copy 0's streams with every GPU
        moved by k ranks of that dimension. An EP group is then one class (its all-to-all
        runs once over the whole group) or lies in a copy (its images run in the others);
        each expert's replicas, the dense data-parallel group and the pipeline chains map
        the same way. Anything else (a TP group across EP blocks) shows in the stream
        check, and the run falls back."""
        g = self.grid
        by_rank = g.ep > 1 and self.tp == 1 and len(set(self.expert_scale)) == 1
        stride, copies = (g.etp, g.ep) if by_rank else (g.ep * g.etp, g.edp)
        n = len(self.gpus)
        if copies < 2:
            return Symmetry.of_replicas([list(self.gpus)])  # every GPU its own class
        first = [i for i in range(n) if (i % g.s) // stride % copies == 0]
        replicas = [[self.gpus[i + k * stride] for i in first] for k in range(copies)]
        at = {gpu: i for i, gpu in enumerate(self.gpus)}

        def image_group(group, k):
            moved = tuple(self.gpus[at[x] + k * stride] for x in group)
            # a group in ring order maps to its image in ring order; one in rank order
            # (EP, expert-TP, expert replicas) member by member
            return self._ring_order(moved) if tuple(group) == self._ring_order(group) else moved

        sym = Symmetry.of_replicas(replicas, image_group)
        sym.sample = 2  # every copy's streams come from the same templates
        return sym

    def _ring_order(self, members) -> tuple:
        """`members` in the topology's ring order."""
        s = set(members)
        return tuple(g for g in self.ring if g in s)

    def dense_group(self, gpu) -> tuple:
        """The GPUs holding the same dense weights as `gpu` (all of them at tp = pp = 1)."""
        if self.tp == 1 and self.pp == 1:
            return self.ring
        i = self.gpus.index(gpu)
        return self._ring_order(self.gpus[k] for k in self.grid.dp_group(i))

    def _expert_time(self, op, j: int) -> float:
        """Seconds expert operator `op` takes on EP rank j: the performance model's time on
        a view of the trace holding one GPU's experts (their weights, casts and gradients
        at 1/ep of their bytes), at the batch that gives the tokens rank j's experts keep,
        so a grouped GEMM of fewer experts with more tokens each is timed as such (its
        weights read once for more tokens); an operator that touches no token at this
        GPU's batch. The replay model (`trace`: the traced setting only) scales the traced
        time instead: by the tokens' share, or 1/ep."""
        key = (j, op.id)
        cache = self.__dict__.setdefault("_expert_times", {})
        if key in cache:
            return cache[key]
        tokens = scales_with_batch(self.trace, op)
        if isinstance(self.model, TraceTime):
            t = self.model.time(op, self.target(self.op_batch()))
            t *= self.expert_scale[j] if tokens else 1.0 / (self.ep * self.etp)
        else:
            batch = self.op_batch() or self.trace.batch_size
            batch = batch * self.expert_scale[j] if tokens else batch
            t = self._sharded_model().time(op, self.target(batch))
        cache[key] = t
        return t

    def _etp_gathered(self, t) -> bool:
        """With etp > 1, whether token tensor `t` of an expert operator holds the tokens of
        the whole expert-TP group: those at the model's hidden width (Megatron all-gathers
        the group's tokens before the experts and reduce-scatters the row layer's
        hidden-wide output after them), etp x the GPU's own; the FFN-wide ones hold the
        group's tokens at 1/etp of the width, the GPU's own bytes. Not told apart where
        the widths are equal."""
        h, f = self.moe.get("hidden"), self.moe.get("expert_ffn")
        return self.etp > 1 and h != f and bool(t.shape) and t.shape[-1] == h

    def _sharded_model(self):
        """The performance model on a view of the trace where each tensor the experts'
        operators touch that does not scale with the batch has 1/(ep x etp) of its bytes,
        and with etp > 1 each hidden-wide token tensor etp x its bytes (`_etp_gathered`)."""
        m = self.__dict__.get("_sharded")
        if m is None:
            tensors = dict(self.trace.tensors)
            for o in self.trace.operators:
                if o.id in self.expert_ops:
                    for tid in o.inputs + o.outputs:
                        t = self.trace.tensors[tid]
                        if not t.scales_with_batch:  # one GPU's shard of the experts
                            n = t.nbytes / (self.ep * self.etp)
                            tensors[tid] = dataclasses.replace(t, nbytes=n)
                        elif self._etp_gathered(t):  # the expert-TP group's tokens
                            tensors[tid] = dataclasses.replace(t, nbytes=t.nbytes * self.etp)
            m = self._sharded = copy.copy(self.model)
            m.trace = Trace(self.trace.operators, tensors, self.trace.metadata)
            if getattr(m, "identity", False):  # the view is not the traced run: its
                m.identity = False  # operators touch 1/ep of the weights, so no replay
        return m

    def _template(self, j: int, mb: int, part=None) -> list:
        """EP rank j's forward and backward of micro-batch mb: ComputeRuns (or Computes)
        and, between them, (layer, kind, sizes) for each all-to-all, ("signal", k) for a
        ready gradient bucket, ("etp", op, bytes, layer, tag, phase) for an expert-TP
        collective and ("tp", Collective, key) for a dense TP collective; built once per
        rank and micro-batch, shared by the rank's GPUs. `part` = (stage, "F" | "B"): only
        that pipeline stage's forward or backward operators (ep_pipeline.py)."""
        cache = self.__dict__.setdefault("_templates", {})
        if (j, mb, part) in cache:
            return cache[j, mb, part]
        target = self.target(self.op_batch())
        items, run = [], []
        tpx = self.tpx
        if tpx is not None:
            split, whole = self.target(self.micro, tp=self.tp), self.target(self.micro)

        def flush():
            if run:
                items.extend([ComputeRun(run)] if self.compute_runs else run)
                run.clear()

        def tp_colls(colls, prefix):
            for c in colls:
                flush()
                items.append(("tp", c, f"{prefix}/{c.key}"))

        def etp(layer, kind, phase):
            if self.etp > 1:  # Megatron's AG after the dispatch, RS before the combine
                op = "all_gather" if kind in ("dispatch", "combine-grad") else "reduce_scatter"
                items.append(("etp", op, self.etp_bytes[j], layer, f"{kind}-{op}", phase))

        # the last micro-batch's backward: where a gradient bucket is complete
        backward = part is None or part[1] == "B"
        last_step = backward and mb == self.options.accumulation_steps - 1
        if part is None:
            walk = self.ops("forward", "backward")
        else:
            p, kind = part
            walk = self.pipe.fwd_ops[p] if kind == "F" else self.pipe.bwd_ops[p]
        for op in walk:
            for phase, u in self.fsdp_first.get(op.id, ()):
                flush()  # fsdp: the unit's parameters are gathered
                items.append(("fsdp", phase, u))
            for k in self.gather_before.get(op.id, ()) if mb == 0 else ():
                flush()  # its weights' updated shards are gathered (overlap_param_gather)
                items.append(("params", k))
            if tpx is not None:
                tp_colls(tpx.before.get(op.id, ()), f"mb{mb}")
            for a2a in self.before.get(op.id, ()) if self.ep > 1 or self.etp > 1 else ():
                flush()
                if self.ep > 1:
                    items.append(a2a)
                etp(a2a[0], a2a[1], op.phase)
            if op.id in self.expert_ops:
                run.append(self.timed(op, self._expert_time(op, j), mb))
            elif tpx is None:
                run.append(self.compute(op, target, mb=mb))
            elif op.tp_split and op.id in tpx.moe_ops and tpx.roles.get(op.id) in SHARDED:
                # the router: its whole weight on the GPU's 1/tp of the tokens
                run.append(self.compute(op, target, mb=mb))
            else:  # the TP plan's role says how the operator is split
                at, scale = tpx.shard(op, split, whole)
                run.append(self.compute(op, at, scale, mb=mb))
            if tpx is not None:
                tp_colls(tpx.after.get(op.id, ()), f"mb{mb}")
            for u in self.fsdp_last_bwd.get(op.id, ()) if last_step else ():
                flush()
                items.append(("fsdp_grads", u))
            for k in self.signals_after.get(op.id, ()) if last_step else ():
                flush()
                items.append(("signal", k))
            for a2a in self.after.get(op.id, ()) if self.ep > 1 or self.etp > 1 else ():
                flush()
                etp(a2a[0], a2a[1], op.phase)
                if self.ep > 1:
                    items.append(a2a)
        if (
            tpx is not None and last_step and part is None
        ):  # sequence-parallel weights' gradients (TP group)
            for op in self.ops("optimizer"):
                tp_colls(tpx.before.get(op.id, ()), "grads")
        flush()
        cache[j, mb, part] = items
        return items

    def streams(self):
        out = {}
        for g in self.gpus:
            if self.pp > 1:
                out[(g, "compute")] = self._pipeline_compute(g)
                out[(g, "send_fwd")] = self._pipeline_sends(g, "F", "send_fwd")
                out[(g, "send_bwd")] = self._pipeline_sends(g, "B", "send_bwd")
            else:
                out[(g, "compute")] = self._compute(g)
            out[(g, "comm")] = self._comm(g)
            if self.options.fsdp:
                out[(g, "gather")] = self._fsdp_gather(g)
        return out

    def _compute(self, gpu):
        _, j, _, _ = self.groups(gpu)
        for mb in range(self.options.accumulation_steps):
            yield from self._tasks(gpu, self._template(j, mb), mb)
        yield from self._step(gpu)

    def _tasks(self, gpu, template, mb):
        """`gpu`'s tasks for a template's items at micro-batch mb: the shared runs as they
        are, the collectives on its groups under its keys."""
        d, j, group, _ = self.groups(gpu)
        i = self.gpus.index(gpu)
        t_e = self.grid.expert(i)[0]
        sk = self._stage_key(gpu)
        ep_key = f"{sk}ep{d}" if self.etp == 1 else f"{sk}ep{d}.{t_e}"
        etp_group = tuple(self.gpus[k] for k in self.grid.etp_group(i))
        etp_key = f"etp{i // self.etp}"
        if self.tpx is not None:
            tp_group = self._ring_order(self.gpus[k] for k in self.grid.tp_group(i))
            tp_key = f"{sk}r{self.grid.dense(i)[1]}"
        for item in template:
            if type(item) is not tuple:
                yield item
            elif len(item) == 3 and type(item[2]) is tuple:
                layer, kind, sizes = item
                phase = "forward" if kind in ("dispatch", "combine") else "backward"
                yield Collective(
                    "all_to_all",
                    group,
                    sum(sizes[j]),
                    f"{ep_key}:mb{mb}:{layer}:{kind}",
                    layer=layer,
                    phase=phase,
                    sizes=sizes,
                )
            elif item[0] == "fsdp":
                at = f"{mb}:{item[1]}:{item[2]}"
                yield Wait(f"{gpu}:fsdp-gathered:{at}")
                yield Signal(f"{gpu}:fsdp-started:{at}")
            elif item[0] == "fsdp_grads":
                yield Signal(f"{gpu}:fsdp-grads:{item[1]}")
            elif item[0] == "signal":  # a gradient bucket is ready
                yield Signal(f"{gpu}:epb{item[1]}")
            elif item[0] == "params":
                yield Wait(f"{gpu}:pg{item[1]}")
            elif item[0] == "tp":
                c = item[1]
                yield Collective(
                    c.op,
                    tp_group,
                    c.nbytes,
                    f"{tp_key}:{item[2]}",
                    c.layer,
                    c.phase,
                    c.algorithm,
                )
            else:  # etp
                _, op, nbytes, layer, tag, phase = item
                yield Collective(
                    op, etp_group, nbytes, f"{etp_key}:mb{mb}:{layer}:{tag}", layer, phase
                )

    def _step(self, gpu):
        """After the last micro-batch: the gradients handed to the comm stream, the
        optimizer step on what the GPU holds once they are reduced, the distributed
        optimizer's parameter gathers waited for."""
        if self.options.fsdp:  # units no backward operator completes
            for u in self.fsdp_reduce_order:
                if not any(u in us for us in self.fsdp_last_bwd.values()):
                    yield Signal(f"{gpu}:fsdp-grads:{u}")
        elif self.options.dp_overlap and self.pp > 1:  # buckets the stage's ops do not fire
            for k in self.stage_unfired[self.grid.stage(self.gpus.index(gpu))]:
                yield Signal(f"{gpu}:epb{k}")
        elif self.options.dp_overlap:  # buckets no backward operator completes
            ops = self.trace.operators
            for k, (pos, _, _) in enumerate(self.buckets):
                if ops[pos].phase == "optimizer":
                    yield Signal(f"{gpu}:epb{k}")
        else:
            yield Signal(f"{gpu}:grads")
        yield Wait(f"{gpu}:reduced")
        target = self.target(self.op_batch())
        share = self._optimizer_share(gpu)
        opt = [self.compute(op, target, share) for op in self.ops("optimizer")]
        if opt and self.compute_runs:
            yield ComputeRun(opt)
        elif opt:
            yield from opt
        if self.options.distributed_optimizer and not self.options.overlap_param_gather:
            yield Signal(f"{gpu}:stepped")
            yield Wait(f"{gpu}:params")

    def _optimizer_share(self, gpu) -> float:
        """The optimizer's time x the weights it steps / all weight bytes: what the GPU
        holds; with the distributed optimizer its 1/dp of the dense and 1/edp of the
        experts' (the optimizer step touches only the shard it owns)."""
        total = self.trace.weight_bytes()
        if not total:
            return 1.0
        dense, expert = self.held(gpu)
        if self.options.distributed_optimizer or self.options.fsdp:
            return (dense / self.grid.dp + expert / self.grid.edp) / total
        return (dense + expert) / total

    def _reduction(self, gpu):
        """(kind, dense group, its key's name, expert replicas, theirs) of `gpu`'s gradient
        reduction: all-reduce, or reduce-scatter with the distributed optimizer."""
        i = self.gpus.index(gpu)
        _, j, _, replicas = self.groups(gpu)
        kind = "reduce_scatter" if self.options.distributed_optimizer else "allreduce"
        sk = self._stage_key(gpu)
        dense = f"{sk}ep:dense" if self.tp == 1 else f"{sk}ep:dense{self.grid.dense(i)[0]}"
        expert = f"ep:experts{j}" if self.etp == 1 else f"ep:experts{j}.{self.grid.expert(i)[0]}"
        expert = sk + expert
        return kind, self.dense_group(gpu), dense, replicas, expert

    def _comm(self, gpu):
        if self.options.fsdp:
            yield from self._fsdp_reduce(gpu)
            return
        kind, dense_group, dense, replicas, expert = self._reduction(gpu)
        dense_held, expert_held = self.held(gpu)
        stage = self.grid.stage(self.gpus.index(gpu))
        for k, (_, nbytes, what) in enumerate(self.stage_gathers[stage]):
            # overlap_param_gather: the last step's updated shards, gathered in the order
            # the forward pass reads them (the steady state of Megatron's overlap)
            group = dense_group if what == "dense" else replicas
            if len(group) > 1:
                name = dense if what == "dense" else expert
                yield Collective(
                    "all_gather", group, nbytes, f"{name}-params{k}", "parameters", "forward"
                )
            yield Signal(f"{gpu}:pg{k}")
        if self.options.dp_overlap:
            yield from self._bucket_comm(gpu)
        else:
            yield Wait(f"{gpu}:grads")
            if len(dense_group) > 1 and dense_held > 0:
                yield Collective(
                    kind,
                    dense_group,
                    dense_held,
                    f"{dense}-{kind}",
                    layer="gradients",
                    phase="backward",
                )
            if len(replicas) > 1 and expert_held > 0:
                yield Collective(
                    kind,
                    replicas,
                    expert_held,
                    f"{expert}-{kind}",
                    layer="expert gradients",
                    phase="backward",
                )
            yield Signal(f"{gpu}:reduced")
        if self.options.distributed_optimizer and not self.options.overlap_param_gather:
            # the updated shards back to every replica, after the step
            yield Wait(f"{gpu}:stepped")
            for group, nbytes, name in (
                (dense_group, dense_held, dense),
                (replicas, expert_held, expert),
            ):
                if len(group) > 1 and nbytes > 0:
                    yield Collective(
                        "all_gather", group, nbytes, f"{name}-params", "parameters", "optimizer"
                    )
            yield Signal(f"{gpu}:params")

    def _bucket_comm(self, gpu):
        """dp_overlap: each bucket's all-reduce (reduce-scatter with the distributed
        optimizer) as soon as it is ready, in ready order: dense ones over the GPU's dense
        data-parallel group, expert ones over its experts' replicas."""
        kind, dense_group, dense, replicas, expert = self._reduction(gpu)
        op = "allreduce" if kind == "allreduce" else kind
        for k, (_, size, what) in enumerate(self._buckets_of(gpu)):
            yield Wait(f"{gpu}:epb{k}")
            group = dense_group if what == "dense" else replicas
            if len(group) > 1:
                name = dense if what == "dense" else expert
                yield Collective(
                    op,
                    group,
                    size,
                    f"{name}-bucket{k}",
                    layer=f"{what} bucket{k}",
                    phase="backward",
                )
        yield Signal(f"{gpu}:reduced")

    def buffer_bytes(self, gpu) -> float:
        # dp_overlap: the gradients copied into flat bucket buffers, as DDP's; Megatron's
        # distributed optimizer reduces in the gradient buffer itself (each parameter's
        # main_grad is a view of its bucket): no copy
        if self.options.fsdp:
            return self.fsdp_buffer()
        if self.options.distributed_optimizer:
            return 0.0
        return sum(size for _, size, _ in self._buckets_of(gpu))

    def _buckets_of(self, gpu) -> list:
        """The gradient buckets `gpu` reduces: its stage's (all of them at pp 1)."""
        if self.pp == 1:
            return self.buckets
        return self.stage_buckets[self.grid.stage(self.gpus.index(gpu))]
