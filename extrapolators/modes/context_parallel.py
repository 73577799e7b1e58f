"""Context parallelism (`mode: cp`): groups of `cp` GPUs share each sequence, every GPU
holding 1/cp of its tokens, and `num_gpus / cp` such groups are data-parallel replicas.

As Megatron-LM does it (`--context-parallel-size`, `--cp-comm-type`): every operator but
the attention works on the GPU's own tokens, so it runs at the GPU's token share, batch /
dp / cp sequences' worth (operators are token-wise; the performance model scales them by
that batch, and the memory model the activations); the attention attends over the whole
sequence through the group, as cp_attention.py says (`cp_comm: p2p`, ring attention, or
`a2a`, DeepSpeed-Ulysses). The weights are replicated over all GPUs, so the gradients are
all-reduced over all of them (Megatron's data-parallel group with context parallelism), in
DDP's buckets during the backward pass: the mode is DDP (its bucket and accumulation
fields) with the attention done across the group.

Groups are consecutive GPU ids (Megatron puts CP just outside TP, inside DP), each in the
topology's ring order; a ring attention's neighbours are the ones next to each other in it.
The attention operators are the trace's fused ones (scaled_dot_product_attention, read by
attention.attention_heads) and the backward operators paired with them.

With `tp` > 1 each CP rank's layers are split over tp GPUs as mode tp splits them (Megatron's
roles and collectives, on the rank's tokens), the grid is tp x cp x dp in Megatron's order
(TP innermost), the attention holds heads / tp and its ring blocks are 1/tp as large, and the
gradients of each GPU's TP shard are reduced over the dp x cp GPUs holding that shard; with
`distributed_optimizer` the optimizer states are sharded over those GPUs (Megatron's
distributed optimizer). cp_tp.py says how, with the bytes and compute per GPU by hand;
with tp 1 and no distributed optimizer the mode runs exactly as described above.

With `fsdp` the weights are fully sharded (FSDP2, ZeRO-3) over the same dp x cp GPUs, as
torchtitan shards them over its flattened "dp_shard_cp" mesh dimension: units gathered
before their forward and backward, gradients reduce-scattered per unit instead of DDP's
buckets; cp_fsdp.py says how.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extrapolators.execution.tasks import ComputeRun, Signal
from extrapolators.modes import dist_optimizer
from extrapolators.modes.cp_attention import ring_compute, ring_sends, ulysses
from extrapolators.modes.cp_fsdp import CPFsdp, FsdpMark
from extrapolators.modes.cp_plan import kv_block_bytes, plan_attention, ulysses_bytes
from extrapolators.modes.cp_tp import CPTensorParallel, TPItem
from extrapolators.modes.data_parallel import DDPOptions, DistributedDataParallel
from triosim.common.errors import ConfigError
from triosim.common.schema import option


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
        "layers.N; default: the smallest giving >= 4 units that hold weights)",
    )


class ContextParallel(CPFsdp, CPTensorParallel, DistributedDataParallel):
    """The mode (module docstring)."""

    name = "cp"
    Options = CPOptions

    def check(self):
        self._make_grid()  # tp x cp x dp (cp_tp.CPGrid)
        self._plan_tp()  # the CP rank's TP plan (cp_tp), before the buckets of its shard
        super().check()  # the batch split, recomputation, DDP's buckets
        if self.options.fsdp:
            self._check_fsdp()
        self._attention = {}  # forward or backward op id -> its forward op's Heads
        if self.cp > 1:
            self._plan_attention()

    def _check_fsdp(self):
        if self.options.distributed_optimizer:
            raise ConfigError(
                "parallelism.distributed_optimizer",
                True,
                "false with fsdp (FSDP shards the optimizer states already, with the "
                "parameters and gradients)",
            )
        self._buckets, self._buckets_after = [], {}  # per-unit reduce-scatters instead
        self._plan_fsdp()

    def _plan_attention(self):
        o = self.options
        self._attention = plan_attention(
            self.trace, self.cp, self.tp, o.cp_comm, o.sequence_parallel
        )

    # -- sizes ---------------------------------------------------------------------------------
    def op_batch(self):
        b = self.per_gpu_batch(self.dp * self.options.accumulation_steps)
        if b is None and self.cp > 1:
            raise ConfigError(
                "batch_size", None, "a batch size (the trace's metadata has none) to split it"
            )
        return b if b is None else b / self.cp  # the GPU's tokens, in sequences' worth

    def held_weight_bytes(self, gpu) -> float:
        if self.options.fsdp:
            return self._held_fraction() * self.fsdp_share() * self.trace.weight_bytes()
        if self.tp == 1:
            return super().held_weight_bytes(gpu)
        return self._held_fraction() * self.trace.weight_bytes()  # the TP shard (mode tp)

    def activation_ratio(self, op) -> float:
        return super().activation_ratio(op) if self.tp == 1 else self.tpx.activation_ratio(op)

    def state_fractions(self) -> dict | None:
        """The distributed optimizer: optimizer states 1 / (dp x cp) of the held shard. Its
        gradients live in Megatron's contiguous gradient buffer, allocated once for the
        whole run (each parameter's main_grad is a view of it): `buffer_bytes`, the
        buckets' bytes, holds them all iteration, so no gradient tensor comes and goes."""
        if self.options.fsdp:  # ZeRO-3: a shard of everything the GPU's TP rank holds
            f = self._held_fraction() * self.fsdp_share()
            return {"weights": f, "gradients": f, "optimizer_states": f}
        if not self.options.distributed_optimizer:
            return None
        return dist_optimizer.state_fractions(self._held_fraction(), self.dp * self.cp)

    def _state_parts(self) -> int:
        return self.dp * self.cp if self.options.fsdp else super()._state_parts()

    def _after_backward(self, gpu):
        if not self.options.fsdp:
            yield from super()._after_backward(gpu)
            return
        for u in self.fsdp_unreduced:  # units no backward operator completes
            yield Signal(f"{gpu}:fsdp-grads:{u}")

    def buffer_bytes(self, gpu) -> float:
        return self.fsdp_buffer() if self.options.fsdp else super().buffer_bytes(gpu)

    def symmetry(self):
        return None  # (ring neighbours differ per GPU: every GPU is simulated)

    def _ratio(self) -> float:
        """The GPU's share of the trace's batch-sized tensors (its tokens)."""
        return self.op_batch() / self.trace.batch_size

    def kv_bytes(self, a) -> float:
        """One GPU's key and value block of attention `a` (cp_plan.kv_block_bytes)."""
        return kv_block_bytes(self.trace, a, self._ratio(), self.tp)

    def _a2a_sizes(self, a) -> tuple[list, list]:
        """Per-GPU bytes of q, k, v and of the output (Ulysses' all-to-alls)."""
        return ulysses_bytes(self.trace, a, self._ratio(), self.tp)

    # -- streams -------------------------------------------------------------------------------
    def _plain(self) -> bool:
        """mode cp as without TP, the distributed optimizer and FSDP (DDP's streams)."""
        o = self.options
        return self.tp == 1 and not o.distributed_optimizer and not o.fsdp

    def _compute(self, gpu):
        return super()._compute(gpu) if self._plain() else self._tp_compute(gpu)

    def _comm(self, gpu):
        if self.options.fsdp:
            return self._fsdp_reduce(gpu)
        return super()._comm(gpu) if self._plain() else self._tp_comm(gpu)

    def _gpu_streams(self, gpu):
        s = super()._gpu_streams(gpu)
        if self.options.fsdp:
            s[(gpu, "gather")] = self._fsdp_gather(gpu)
        if self.cp > 1 and self.options.cp_comm == "p2p":
            s[(gpu, "cp")] = self._sends(gpu)
        return s

    def _micro_steps(self, gpu=None):
        target = self.target(self.op_batch())
        steps = self.options.accumulation_steps
        for s in range(steps):
            last = s == steps - 1
            if self.cp == 1 and self.tp == 1 and not self.options.fsdp:  # DDP exactly
                yield from self._step(target, s, gpu if last else None)
                continue
            for item in self._template(target, s, last):
                if type(item) is int:
                    yield Signal(f"{gpu}:bucket{item}")
                elif type(item) is tuple:
                    yield from self._attend(gpu, *item)
                elif type(item) is TPItem:
                    yield self._tp_task(gpu, item, s)
                elif type(item) is FsdpMark:
                    yield from self.fsdp_mark_tasks(gpu, item, s)
                else:
                    yield item

    def _template(self, target, mb, signals: bool) -> list:
        """One step's tasks shared by every GPU: ComputeRuns, bucket numbers (signals) and
        (op, step Compute, micro-batch) for each attention operator."""
        cache = self.__dict__.setdefault("_cp_templates", {})
        key = (target, mb, signals)
        if key in cache:
            return cache[key]
        items, run = [], []
        split = self.target(self.op_batch(), tp=self.tp) if self.tp > 1 else target

        def other(more):
            nonlocal run
            if more and run:
                items.append(ComputeRun(run))
                run = []
            items.extend(more)

        fsdp = self.options.fsdp
        for i, (op, again) in enumerate(self._fb):
            phase = "recompute" if again else None
            enter, grads = self.fsdp_marks(i, signals) if fsdp else ((), ())
            other(list(enter))
            other(self._tp_around(op, "before", again))
            if op.id in self._attention:
                scale = 1 / self.cp if self.options.cp_comm == "p2p" else 1.0
                other([(op, self._op_compute(op, target, split, scale, mb, phase), mb)])
            else:
                run.append(self._op_compute(op, target, split, mb=mb, phase=phase))
            other(self._tp_around(op, "after", again))
            ks = self._buckets_after.get(op.id, ()) if signals and not again else ()
            other(list(ks) + list(grads))
        if run:
            items.append(ComputeRun(run))
        cache[key] = items
        return items

    def _tag(self, gpu, op, step, mb) -> str:
        return f"cp{self.group_of[gpu][0]}:{mb}:{op.id}:{step.phase}"

    def _attend(self, gpu, op, step, mb):
        """One attention operator's tasks on `gpu`'s compute stream."""
        a, (_, group) = self._attention[op.id], self.group_of[gpu]
        tag, forward = self._tag(gpu, op, step, mb), op.phase == "forward"
        if self.options.cp_comm == "p2p":
            yield from ring_compute(gpu, group, step, tag, forward)
            return
        qkv, out = self._a2a_sizes(a)
        before, after = (qkv, out) if forward else (out, qkv)
        yield from ulysses(group, step, before, after, tag, self.collective)

    def _sends(self, gpu):
        """The ring attention's sends of `gpu`, in the order its compute stream reaches them."""
        _, group = self.group_of[gpu]
        target = self.target(self.op_batch())
        for mb in range(self.options.accumulation_steps):
            for item in self._template(target, mb, mb == self.options.accumulation_steps - 1):
                if type(item) is tuple:
                    op, step, _ = item
                    a = self._attention[op.id]
                    yield from ring_sends(
                        gpu,
                        group,
                        self.kv_bytes(a),
                        self._tag(gpu, op, step, mb),
                        op.phase == "forward",
                        step.layer,
                        step.phase,
                    )
