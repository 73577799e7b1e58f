"""Fully sharded data parallelism inside context parallelism: mode `cp` with `fsdp: true`, as
torchtitan runs FSDP2 with CP.

torchtitan's device mesh is (pp, dp_replicate, dp_shard, cp, tp), TP innermost
(torchtitan/distributed/parallel_dims.py); FSDP2's `fully_shard` is applied over
"dp_shard_cp", the dp_shard and cp dimensions flattened into one
(torchtitan/models/llama3/infra/parallelize.py, `apply_fsdp`): the weights are replicated
over CP as over DP, so they are sharded over both. In mode cp's grid (cp_tp.CPGrid, the
same order) that group is a GPU's gradient group: the dp x cp GPUs holding its TP shard.

Per GPU (module `sharded.py` says the same of mode fsdp, with the whole plan as the group):
  - the model is cut into units (blocks.layer_units: consecutive forward operators sharing a
    layer-name prefix of `wrap_depth` parts; torchtitan wraps the embedding, each
    transformer block, and the final norm with the output projection);
  - each unit's parameters (its TP shard: `_weight_grad_bytes`) are all-gathered over the
    gradient group before its forward, one unit ahead of the compute (FSDP2's prefetch:
    a gather is issued when the compute starts the unit before), and again before its
    backward where the unit reshards after forward; a recomputed forward runs on the
    backward's gather;
  - after the last micro-batch's backward of a unit its gradients are reduce-scattered
    over the group (earlier micro-batches accumulate unsharded, as mode ep's fsdp does:
    FSDP2's `set_requires_gradient_sync(False)`); the optimizer steps on the shard, and no
    gather follows it (the next forward's gathers bring the parameters);
  - memory: weights, gradients and optimizer states 1 / (dp x cp) of the TP shard; buffers:
    the gathered parameters of the current and the prefetched unit, less the GPU's shards.
  Per unit of W bytes on a group of n = dp x cp GPUs this moves (n - 1) / n x W in each
  all-gather (twice with resharding) and in the reduce-scatter: 1.5x DDP's all-reduce.

`reshard_after_forward` follows torchtitan's `parallelism.fsdp_reshard_after_forward`:
"default" reshards every unit but the last one holding weights (torchtitan leaves the final
norm and output unsharded after forward, since FSDP would gather them right back; without
PP it reshards the others), "always" every unit, "never" none. The ring (or all-to-all)
attention is mode cp's, unchanged.

`CPFsdp` is a part of `ContextParallel` (a mixin): `_plan_fsdp()` cuts the units and finds
where the compute enters each and completes its gradients (positions in `_fb`); the step
template carries `FsdpMark`s there; `_fsdp_gather(gpu)` and `_fsdp_reduce(gpu)` are the
streams. It needs of the mode: `trace`, `options` (wrap_depth, reshard_after_forward,
accumulation_steps), `_fb`, `_weight_grad_bytes(w)`, `grad_group(gpu)`, `coord`,
`collective`, `dp`, `cp`.
"""

from __future__ import annotations

from dataclasses import dataclass

from extrapolators.execution.tasks import Collective, Signal, Wait
from extrapolators.modes.blocks import layer_units


@dataclass(frozen=True)
class FsdpMark:
    """In a step's template: the compute enters `unit` in `phase` ("enter": it waits for
    the unit's gather and lets the next one start) or completes its gradients ("grads")."""

    kind: str
    phase: str
    unit: int


class CPFsdp:
    """FSDP2 over the dp x cp gradient group of mode cp (module docstring)."""

    def _plan_fsdp(self) -> None:
        self.unit_of, self.unit_names, held = layer_units(self.trace, self.options.wrap_depth)
        self.unit_bytes = [sum(self._weight_grad_bytes(w) for w in s) for s in held]
        self.fsdp_enter: dict = {}  # position in _fb -> [(phase, unit)] entered there
        self.fsdp_order: list = []  # (phase, unit) in the order the compute enters them
        last: dict = {}  # unit -> position in _fb of its last backward operator
        for i, (op, again) in enumerate(self._fb):
            u = self.unit_of.get(op.id, 0)
            key = ("backward" if again else op.phase, u)  # recomputation: backward's gather
            if key not in self.fsdp_order:
                self.fsdp_order.append(key)
                self.fsdp_enter.setdefault(i, []).append(key)
            if op.phase == "backward":
                last[u] = i
        self.fsdp_grads: dict = {}  # position in _fb -> units whose gradients it completes
        for u, i in last.items():
            self.fsdp_grads.setdefault(i, []).append(u)
        self.fsdp_reduce_order = sorted(last, key=last.get)
        self.fsdp_unreduced = [u for u in range(len(held)) if u not in last]  # no backward op
        self.fsdp_reduce_order += self.fsdp_unreduced
        policy = self.options.reshard_after_forward
        weighted = [u for u, b in enumerate(self.unit_bytes) if b > 0]
        keep = set() if policy == "always" or not weighted else {weighted[-1]}
        self.fsdp_reshard = {
            u for u in range(len(held)) if policy != "never" and u not in keep
        }  # the units gathered again for their backward

    def fsdp_marks(self, i: int, grads: bool) -> tuple[list, list]:
        """The marks before and (with `grads`: the last micro-batch) after position `i`."""
        before = [FsdpMark("enter", p, u) for p, u in self.fsdp_enter.get(i, ())]
        after = [FsdpMark("grads", "backward", u) for u in self.fsdp_grads.get(i, ())]
        return before, after if grads else []

    def fsdp_share(self) -> float:
        return 1 / (self.dp * self.cp)

    def fsdp_buffer(self) -> float:
        """The gathered parameters of the current and the prefetched unit, less the GPU's
        own shards (as mode fsdp)."""
        top = sorted(self.unit_bytes, reverse=True)[:2]
        return sum(top) * (1 - self.fsdp_share())

    def fsdp_mark_tasks(self, gpu, mark: FsdpMark, mb):
        """The compute stream's side of a mark."""
        if mark.kind == "enter":
            at = f"{mb}:{mark.phase}:{mark.unit}"
            yield Wait(f"{gpu}:fsdp-gathered:{at}")  # its parameters are here
            yield Signal(f"{gpu}:fsdp-started:{at}")  # the next gather may begin
        else:
            yield Signal(f"{gpu}:fsdp-grads:{mark.unit}")

    def _fsdp_coll(self, gpu, op, u, key, phase) -> Collective | None:
        group = self.grad_group(gpu)
        if len(group) == 1 or not self.unit_bytes[u]:
            return None
        return Collective(
            op,
            group,
            self.unit_bytes[u],
            f"fsdp:t{self.coord[gpu][2]}:{key}",
            layer=self.unit_names[u],
            phase=phase,
            algorithm=self.collective,
        )

    def _fsdp_gather(self, gpu):
        """Each unit's parameters, one unit ahead of the compute, per micro-batch."""
        prev = None
        for mb in range(self.options.accumulation_steps):
            for phase, u in self.fsdp_order:
                if prev is not None:
                    yield Wait(f"{gpu}:fsdp-started:{prev}")
                if phase == "forward" or u in self.fsdp_reshard:
                    c = self._fsdp_coll(gpu, "all_gather", u, f"mb{mb}:{phase}:u{u}", phase)
                    if c is not None:
                        yield c
                prev = f"{mb}:{phase}:{u}"
                yield Signal(f"{gpu}:fsdp-gathered:{prev}")

    def _fsdp_reduce(self, gpu):
        """Each unit's gradients reduce-scattered as the last backward pass completes them."""
        for u in self.fsdp_reduce_order:
            yield Wait(f"{gpu}:fsdp-grads:{u}")
            c = self._fsdp_coll(gpu, "reduce_scatter", u, f"grads:u{u}", "backward")
            if c is not None:
                yield c
        yield Signal(f"{gpu}:reduced")
