"""Sharded data parallelism: ZeRO stages 1-3 and FSDP (FSDP2 semantics).

Every GPU runs the whole model on batch/N, like DDP, but holds only part of the state:
- ZeRO-1: optimizer states sharded. Gradients are all-reduced in buckets during backward (as
  DDP), each GPU updates its 1/N of the parameters, then the updated parameters are
  all-gathered.
- ZeRO-2: gradients sharded too: buckets are reduce-scattered during backward; optimizer on
  the shard; parameters all-gathered after the step.
- ZeRO-3 / FSDP: parameters sharded too, in units (FSDP2's `fully_shard` per block): a
  unit's parameters are all-gathered before its forward (the next unit's gather is issued as
  soon as the current one's is done: prefetch) and, with `reshard_after_forward` (default),
  again before its backward; its gradients are reduce-scattered after its backward; the
  optimizer steps on the shard. Per GPU this moves (N-1)/N x W three times: 1.5x DP's ring
  all-reduce (2 (N-1)/N x W).

Units: consecutive forward operators whose layer names share a prefix of `wrap_depth` dotted
parts (torchtitan wraps each transformer block: `transformer.h.0` is depth 3); `auto`
picks the smallest depth giving at least 4 units that hold weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extrapolators.execution.symmetry import Symmetry
from extrapolators.execution.tasks import Collective, Signal, Wait
from extrapolators.modes.base import Extrapolator
from extrapolators.modes.blocks import layer_units
from triosim.common.schema import option


@dataclass(frozen=True)
class ShardedOptions:
    stage: Literal[1, 2, 3] = option(
        3, help="ZeRO stage: 1 optimizer states, 2 + gradients, 3 + parameters (FSDP)"
    )
    wrap_depth: int | None = option(
        None, ge=1, help="layer-name depth of a unit (default: the smallest giving >= 4 units)"
    )
    reshard_after_forward: bool = option(
        True,
        help="FSDP2: free gathered parameters after forward and gather them again for backward",
    )
    bucket_size: float = option(25 * 2**20, unit="bytes", gt=0, help="ZeRO-1/2 gradient bucket cap")
    recompute: Literal["none", "full", "selective"] = option(
        "none", help="activation recomputation (as for dp): full per unit or selective"
    )


class Sharded(Extrapolator):
    name = "fsdp"
    Options = ShardedOptions

    def check(self):
        self.per_gpu_batch(len(self.gpus))
        self._units()
        self._fb = self.forward_backward(self.options.recompute, self.options.wrap_depth)
        # each unit's last backward operator, and the units in the order the backward pass
        # completes their gradients (then those no backward operator touches)
        self._last_bwd, at = {}, {}
        for i, op in enumerate(self.trace.operators):
            if op.phase == "backward":
                self._last_bwd[self.unit_of[op.id]] = op.id
                at[self.unit_of[op.id]] = i
        done = sorted(at, key=at.__getitem__)
        self._reduce_order = done + [u for u in range(len(self.unit_weights)) if u not in done]

    # -- units --------------------------------------------------------------------------------
    def _units(self):
        self.unit_of, self.unit_names, held = layer_units(self.trace, self.options.wrap_depth)
        self.unit_weights = [sum(self.trace.tensors[t].nbytes for t in s) for s in held]

    # -- what each GPU holds ------------------------------------------------------------------
    def held_weight_bytes(self, gpu) -> float:
        """Parameters this GPU keeps between uses (ZeRO-1/2: all; ZeRO-3: its shard)."""
        return self.trace.weight_bytes() * self.state_fractions()["weights"]

    def state_fractions(self) -> dict:
        """Share of the full weights, gradients and optimizer states each GPU keeps."""
        n, stage = len(self.gpus), self.options.stage
        return {
            "weights": 1 / n if stage >= 3 else 1.0,
            "gradients": 1 / n if stage >= 2 else 1.0,
            "optimizer_states": 1 / n,
        }

    def buffer_bytes(self, gpu) -> float:
        """ZeRO-3: the gathered parameters of the current and the prefetched unit."""
        if self.options.stage < 3 or not self.unit_weights:
            return 0.0
        top = sorted(self.unit_weights, reverse=True)[:2]
        return sum(top) * (1 - 1 / len(self.gpus))

    def symmetry(self) -> Symmetry:
        """Every GPU runs the same streams and every collective spans all GPUs: one class."""
        return Symmetry.one_class(self.gpus)

    # -- streams ------------------------------------------------------------------------------
    def streams(self):
        out = {}
        for g in self.gpus:
            out[(g, "compute")] = self._compute(g)
            out[(g, "gather")] = self._gather(g)
            out[(g, "reduce")] = self._reduce(g)
        return out

    def _coll(self, op, nbytes, key, layer, phase):
        return Collective(
            op, self.ring, nbytes, key, layer=layer, phase=phase, algorithm=self.collective
        )

    def _compute(self, g):
        target = self.target(self.per_gpu_batch(len(self.gpus)))
        stage, n = self.options.stage, len(self.gpus)
        last_bwd = self._last_bwd
        entered: set = set()
        for op, again in self._fb:
            u = self.unit_of[op.id]
            phase = "backward" if again else op.phase  # recomputation needs backward's gather
            if stage == 3 and (phase, u) not in entered:
                entered.add((phase, u))
                yield Wait(f"{g}:gathered:{phase}:{u}")  # its parameters are here
                yield Signal(f"{g}:started:{phase}:{u}")  # the next gather may begin
            yield self.compute(op, target, phase="recompute" if again else None)
            if op.phase == "backward" and last_bwd.get(u) == op.id:
                yield Signal(f"{g}:grads:{u}")
        for u in range(len(self.unit_weights)):  # units no backward op of the trace touches
            if u not in last_bwd:
                yield Signal(f"{g}:grads:{u}")
        yield Wait(f"{g}:reduced")
        for op in self.ops("optimizer"):  # on this GPU's shard of the parameters
            yield self.compute(op, target, 1 / n)
        yield Signal(f"{g}:stepped")
        yield Wait(f"{g}:params")

    def _gather(self, g):
        """ZeRO-3: each unit's parameters, one unit ahead of the compute (prefetch)."""
        w, names = self.unit_weights, self.unit_names
        if self.options.stage == 3:
            for u in range(len(w)):
                if u:
                    yield Wait(f"{g}:started:forward:{u - 1}")
                yield self._coll("all_gather", w[u], f"fsdp:agf{u}", names[u], "forward")
                yield Signal(f"{g}:gathered:forward:{u}")
            for k, u in enumerate(reversed(range(len(w)))):
                yield Wait(
                    f"{g}:started:{'forward' if k == 0 else 'backward'}:{u if k == 0 else u + 1}"
                )
                if self.options.reshard_after_forward:
                    yield self._coll("all_gather", w[u], f"fsdp:agb{u}", names[u], "backward")
                yield Signal(f"{g}:gathered:backward:{u}")
        yield Wait(f"{g}:stepped")
        if self.options.stage < 3:  # the updated shards go back to every GPU
            yield self._coll("all_gather", sum(w), "zero:params", "parameters", "optimizer")
        yield Signal(f"{g}:params")

    def _reduce(self, g):
        """Gradients: per unit (ZeRO-3) or in buckets (ZeRO-1/2), in the order the backward
        pass completes them."""
        w, stage = self.unit_weights, self.options.stage
        op_name = "allreduce" if stage == 1 else "reduce_scatter"
        size, k = 0.0, 0
        for u in self._reduce_order:
            yield Wait(f"{g}:grads:{u}")
            size += w[u]
            if stage == 3 or size >= self.options.bucket_size:
                yield self._coll(op_name, size, f"zero:g{u}", self.unit_names[u], "backward")
                size, k = 0.0, k + 1
        if size:
            yield self._coll(op_name, size, "zero:g-last", "gradients", "backward")
        yield Signal(f"{g}:reduced")
