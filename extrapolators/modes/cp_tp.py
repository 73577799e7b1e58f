"""Context parallelism with tensor parallelism and the distributed optimizer: the tp x cp x dp
grid of `mode: cp` (context_parallel.py) and what TP and a sharded optimizer change in it.

The grid, as Megatron-Core lays it out (megatron/core/parallel_state.py,
`initialize_model_parallel`: RankGenerator's default order "tp-cp-ep-dp-pp", TP innermost,
then CP, then DP): GPU i of the plan is (d, c, t) with t = i % tp, c = (i // tp) % cp,
d = i // (tp x cp). Groups, each in the topology's ring order:
  - TP group (d, c): the tp consecutive GPUs that split one CP rank's layers (Megatron's
    tensor-model-parallel group);
  - CP group (d, t): the cp GPUs, tp apart, that share one sequence (its context-parallel
    group): their ring attention passes key/value blocks of the same heads;
  - gradient group t: the dp x cp GPUs holding the same TP shard (Megatron's data-parallel
    group `with_context_parallel=True`): they reduce its gradients (the weights are
    replicated over CP as over DP) and, with the distributed optimizer, shard its state.

Each GPU runs its CP rank's tokens (batch / dp / cp sequences' worth, as mode cp) through
its TP shard of the layers, with Megatron's TP roles and collectives (tensor_parallel.py;
`sequence_parallel` optional) planned on those tokens: every TP collective carries the
CP rank's chunk, not the whole sequence. The attention runs between the column-parallel
QKV and the row-parallel output projection, so each GPU holds heads / tp of every layer's
attention, and TransformerEngine's context parallelism (cp_attention.py) runs on those
heads over the CP group (TE's CP docs: "Context parallelism in Megatron-Core",
https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/context_parallel.html,
and transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py).

Per GPU, for one attention of a sequence of s tokens, b sequences per data-parallel
replica, h query heads, g key/value heads, head size e, element size z (the hand
calculation the tests check):
  - tokens: b x s / cp; attention FLOPs: 1 / (tp x cp) of the sequence's (heads / tp, the
    query tokens / cp against all keys), in cp ring steps of 1 / (tp x cp^2) each;
  - ring key/value block: 2 (k, v) x b x (s / cp) x (g / tp) x e x z bytes, i.e. mode cp's
    block / tp; forward cp - 1 sends, backward cp messages of 2 (cp - 1) blocks' bytes;
  - Ulysses: each all-to-all carries the GPU's q (or k, v at g heads, or the output) at
    b x (s / cp) x (h / tp) x e x z bytes; the heads per TP rank must split over cp
    (h and g divisible by tp x cp);
  - TP collectives (without sequence parallelism): per block 2 all-reduces forward and 2
    backward of b x (s / cp) x hidden x z bytes, over the tp GPUs of the CP rank;
  - weights, gradients: the TP shard (split layers 1 / tp, the rest whole); the gradients
    are reduced over the dp x cp GPUs of the gradient group, in DDP's buckets of the shard.
    A bucket is ready after the TP collectives that follow the operator completing it (a
    layer's input-gradient all-reduce goes first; Megatron may overlap the two).

`distributed_optimizer` (Megatron's `--use-distributed-optimizer`, dist_optimizer.py,
megatron/core/optimizer/distrib_optimizer.py; docs: https://docs.nvidia.com/megatron-core/developer-guide/latest/
api-guide/dist_optimizer.html): the optimizer state is sharded over the data-parallel
group, which with CP is dp x cp GPUs (`get_data_parallel_group(with_context_parallel=True)`).
Each bucket's gradients are reduce-scattered over that group (instead of all-reduced) as
the backward pass fills it; each GPU steps its 1 / (dp x cp) of its TP shard (the optimizer
time scales so); the updated parameters are all-gathered over the group after the step
(Megatron's default, without --overlap-param-gather). Memory per GPU: weights and
gradients as held (Megatron keeps the whole contiguous gradient buffer all run; it is the
`buffer_bytes`), optimizer states / (dp x cp): with float32 weights and AdamW, 4 + 4 +
8 / (dp x cp) bytes per held parameter, the "fp32 param, fp32 grads: 8 + 8/d" row of
Megatron-LM's docs/source/api-guide/dist_optimizer.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from extrapolators.execution.tasks import Collective, Signal, Wait
from extrapolators.modes.dist_optimizer import grad_reduction, param_gather
from extrapolators.modes.tensor_parallel import TensorParallel, TPOptions
from extrapolators.modes.tp_roles import SHARDED, SPLIT
from triosim.common.errors import ConfigError


class _TensorParallel(TensorParallel):
    """A CP rank's tensor-parallel plan: its degree is parallelism.tp."""

    degree_field = "parallelism.tp"


@dataclass(frozen=True)
class TPItem:
    """A TP collective in a step's template: completed per GPU with its TP group and a key
    naming the group, the micro-batch and (`again`) a recomputed forward."""

    task: Collective
    again: bool = False


class CPGrid:
    """The tp x cp x dp grid and its groups (module docstring). Needs `options` (tp, cp),
    `gpus` and `ring`; gives `tp`, `cp`, `dp`, `coord`, `groups` and `group_of` (the CP
    groups: group k = d x tp + t, as mode cp's groups when tp is 1), `tp_group(gpu)` and
    `grad_group(gpu)`."""

    def _make_grid(self) -> None:
        n, o = len(self.gpus), self.options
        self.tp = o.tp
        if n % self.tp:
            raise ConfigError("parallelism.tp", o.tp, f"a degree dividing num_gpus ({n})")
        self.cp = o.cp or n // self.tp
        if n % (self.tp * self.cp) or not self.cp:
            raise ConfigError(
                "parallelism.cp",
                o.cp,
                f"a degree with tp x cp ({self.tp} x {o.cp or n // self.tp}) dividing "
                f"num_gpus ({n})",
            )
        self.dp = n // (self.tp * self.cp)
        tp, cp = self.tp, self.cp
        pos = {g: i for i, g in enumerate(self.gpus)}
        self.coord = {g: (i // (tp * cp), (i // tp) % cp, i % tp) for g, i in pos.items()}
        groups = [[] for _ in range(self.dp * tp)]
        tps, grads = {}, {}
        for g in self.ring:  # each group in the topology's ring order
            if g in pos:
                d, c, t = self.coord[g]
                groups[d * tp + t].append(g)
                tps.setdefault((d, c), []).append(g)
                grads.setdefault(t, []).append(g)
        self.groups = [tuple(g) for g in groups]
        self.group_of = {g: (k, grp) for k, grp in enumerate(self.groups) for g in grp}
        self._tp_groups = {k: tuple(v) for k, v in tps.items()}
        self._grad_groups = {k: tuple(v) for k, v in grads.items()}

    def tp_group(self, gpu) -> tuple:
        d, c, _ = self.coord[gpu]
        return self._tp_groups[d, c]

    def grad_group(self, gpu) -> tuple:
        return self._grad_groups[self.coord[gpu][2]]


class CPTensorParallel(CPGrid):
    """TP and the distributed optimizer in a CP plan (module docstring). Needs of the mode:
    `trace`, `model`, `options` (tp, sequence_parallel, distributed_optimizer), `gpu`,
    `host`, `op_batch()`, `compute`, `target`, `ops`, `collective`, `buckets()`,
    `_micro_steps(gpu)`; `_plan_tp()` must run before the mode's DDP buckets are made."""

    def _plan_tp(self) -> None:
        o = self.options
        self.tpx = None
        if o.sequence_parallel and self.tp == 1:
            raise ConfigError(
                "parallelism.sequence_parallel", True, "false without tensor parallelism (tp 1)"
            )
        if self.tp == 1:
            return
        group0 = self.tp_group(self.gpus[0])
        self.tpx = _TensorParallel(
            self.trace,
            self.model,
            group0,
            TPOptions("megatron", o.sequence_parallel),
            batch_size=self.op_batch(),  # the CP rank's tokens: TP's bytes are its chunk's
            gpu=self.gpu,
            host=self.host,
        )
        self._split = self.tpx.sharded_weights()

    # -- compute -----------------------------------------------------------------------------
    def _op_compute(self, op, whole, split, scale=1.0, mb=0, phase=None):
        """`op` on this GPU: at its TP role's shard (as mode tp), times `scale`."""
        if self.tp == 1:
            return self.compute(op, whole, scale, mb, phase)
        role = self.tpx.roles.get(op.id)
        if role in SHARDED:
            s = scale if op.tp_split else scale / self.tp
            return self.compute(op, split, s, mb, phase)
        if op.tp_split and (role in SPLIT or op.id in self.tpx._orphan_ids):
            return self.compute(op, split, scale, mb, phase)
        return self.compute(op, whole, scale, mb, phase)

    def _tp_around(self, op, where: str, again: bool) -> list:
        """The TP collectives before or after `op` (forward ones again where recomputed)."""
        if self.tp == 1:
            return []
        table = self.tpx.before if where == "before" else self.tpx.after
        return [TPItem(c, again) for c in table.get(op.id, ())]

    def _tp_task(self, gpu, item: TPItem, mb) -> Collective:
        d, c, _ = self.coord[gpu]
        task, group = item.task, self.tp_group(gpu)
        if item.again:  # a recomputed forward's collective: its own key and phase
            key = f"d{d}c{c}m{mb}/{task.key}:re"
            return dataclasses.replace(task, group=group, key=key, phase="recompute")
        return dataclasses.replace(task, group=group, key=f"d{d}c{c}m{mb}/{task.key}")

    # -- what each GPU holds -------------------------------------------------------------------
    def _weight_grad_bytes(self, w) -> float:
        """One GPU's gradient of weight `w` (its TP shard): what its bucket holds."""
        nbytes = self.trace.tensors[w].nbytes
        return nbytes / self.tp if self.tp > 1 and w in self._split else nbytes

    def _held_fraction(self) -> float:
        return self.tpx.optimizer_fraction() if self.tp > 1 else 1.0

    def _sharded_state(self) -> bool:
        """The distributed optimizer: gradients reduce-scattered, parameters gathered after
        the step."""
        return self.options.distributed_optimizer

    def _state_parts(self) -> int:
        """The GPUs one TP shard's optimizer state is split over (its step runs on 1/that)."""
        return self.dp * self.cp if self._sharded_state() else 1

    def _after_backward(self, gpu):
        """The signals of the gradients no backward operator completes (as DDP: buckets
        whose ready point is an optimizer operator)."""
        for k, (p, _, _) in enumerate(self.buckets()):
            if self.trace.operators[p].phase == "optimizer":
                yield Signal(f"{gpu}:bucket{k}")

    # -- streams of the TP / distributed-optimizer path ---------------------------------------
    def _tp_compute(self, gpu):
        """The compute stream: the micro-steps, the optimizer on this GPU's share (its TP
        shard, 1 / (dp x cp) of it with the distributed optimizer or FSDP), the parameters'
        all-gather after it (distributed optimizer)."""
        yield from self._micro_steps(gpu)
        yield from self._after_backward(gpu)
        yield Wait(f"{gpu}:reduced")
        target = self.target(self.op_batch(), tp=self.tp)
        scale = self._held_fraction() / self._state_parts()
        for op in self.ops("optimizer"):
            if self.tp > 1:  # sequence parallelism's partial weight gradients (mode tp)
                for c in self.tpx.before.get(op.id, ()):
                    yield self._tp_task(gpu, TPItem(c), "opt")
            yield self.compute(op, target, scale)
        if self._sharded_state():
            held = self._held_fraction() * self.trace.weight_bytes()
            key = f"distopt:t{self.coord[gpu][2]}:params"
            c = param_gather(self.grad_group(gpu), held, key, self.collective)
            if c is not None:
                yield c

    def _tp_comm(self, gpu):
        """The gradient buckets of this GPU's shard, reduced over its gradient group as the
        backward pass fills them: all-reduced, or reduce-scattered (distributed optimizer)."""
        group, t = self.grad_group(gpu), self.coord[gpu][2]
        kind = grad_reduction(self._sharded_state())
        for k, (_, size, _) in enumerate(self.buckets()):
            yield Wait(f"{gpu}:bucket{k}")
            if len(group) > 1:
                yield Collective(
                    kind,
                    group,
                    size,
                    f"ddp:t{t}:bucket{k}",
                    layer=f"bucket{k}",
                    phase="backward",
                    algorithm=self.collective,
                )
        yield Signal(f"{gpu}:reduced")
