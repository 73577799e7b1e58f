"""Fully sharded data parallelism (ZeRO-3) inside expert parallelism: mode `ep` with
`fsdp: true`, as Megatron-Core's FSDP with EP (MCore v0.15, "Support FSDP with EP for MoE
models") and FSDP2 run it.

Each GPU keeps 1/dp of the dense weights it holds (its TP shard) and 1/edp of its
experts' (ep_grid: dp = num_gpus / tp dense replicas, edp = num_gpus / (ep x etp) expert
replicas), with their gradients and optimizer states. The model is cut into units
(blocks.layer_units: consecutive forward operators sharing a layer-name prefix of
`wrap_depth` parts, FSDP2's `fully_shard` per block); per micro-batch, on a "gather" stream, a unit's parameters are
all-gathered before its forward (dense bytes over the GPU's dense data-parallel group,
expert bytes over its experts' replicas), one unit ahead of the compute (prefetch: the next
gather is issued when the compute starts the unit before), and again before its backward
(reshard after forward); after the last micro-batch's backward of a unit, its gradients
are reduce-scattered over the same groups (on the comm stream, overlapping the rest of the
backward pass; the earlier micro-batches accumulate unsharded, FSDP2's no-sync). The
optimizer steps on the shard. Per GPU and unit with d dense and x expert bytes held:
all-gathers of (dp - 1)/dp x d and (edp - 1)/edp x x arrive twice per micro-batch, one
reduce-scatter of each leaves: 1.5x an all-reduce's bytes at one micro-batch, as FSDP.

`EPFsdp` is a part of `ExpertParallel` (its mixin): `_plan_fsdp()` cuts the units;
`_fsdp_gather(gpu)` and `_fsdp_reduce(gpu)` are the streams; the template marks where
the compute waits (("fsdp", phase, unit)) and signals a unit's gradients ("fsdp_grads").
It needs of the mode: `trace`, `ops`, `options.accumulation_steps`, `_share_of()`,
`expert_weights`, `grid`, `dense_group(gpu)`, `groups(gpu)`.
"""

from __future__ import annotations

from extrapolators.execution.tasks import Collective, Signal, Wait
from extrapolators.modes.blocks import layer_units


class EPFsdp:
    """ZeRO-3 of mode `ep` (module docstring)."""

    def _plan_fsdp(self) -> None:
        self.unit_of, self.unit_names, held = layer_units(self.trace, self.options.wrap_depth)
        share, T, ex = self._share_of(), self.trace.tensors, self.expert_weights
        self.unit_bytes = [
            (
                sum(T[w].nbytes * share(w) for w in s if w not in ex),
                sum(T[w].nbytes * share(w) for w in s if w in ex),
            )
            for s in held
        ]
        self.fsdp_first: dict = {}  # op id -> [(phase, unit)] whose first operator it is
        self.fsdp_order: list = []  # (phase, unit) in the order the compute enters them
        seen: set = set()
        last: dict = {}
        for op in self.ops("forward", "backward"):
            key = (op.phase, self.unit_of.get(op.id, 0))
            if key not in seen:
                seen.add(key)
                self.fsdp_order.append(key)
                self.fsdp_first.setdefault(op.id, []).append(key)
            if op.phase == "backward":
                last[key[1]] = op.id
        self.fsdp_last_bwd: dict = {}  # op id -> units whose gradients it completes
        for u, i in last.items():
            self.fsdp_last_bwd.setdefault(i, []).append(u)
        self.fsdp_reduce_order = [u for p, u in self.fsdp_order if p == "backward"]
        self.fsdp_reduce_order += [u for u in range(len(held)) if u not in last]

    def fsdp_fraction(self) -> float:
        """The share of all weight bytes a GPU keeps: 1/dp of its dense, 1/edp of its
        experts'."""
        total = self.trace.weight_bytes()
        if not total:
            return 1.0
        return (self.dense_held / self.grid.dp + self.expert_held / self.grid.edp) / total

    def fsdp_buffer(self) -> float:
        """The gathered parameters of the current and the prefetched unit, less the GPU's
        own shards."""
        dp, edp = self.grid.dp, self.grid.edp
        gathered = sorted(
            (d * (1 - 1 / dp) + x * (1 - 1 / edp) for d, x in self.unit_bytes), reverse=True
        )
        return sum(gathered[:2])

    def _fsdp_groups(self, gpu):
        _, j, _, replicas = self.groups(gpu)
        i = self.gpus.index(gpu)
        dense = "ep:dense" if self.tp == 1 else f"ep:dense{self.grid.dense(i)[0]}"
        expert = f"ep:experts{j}" if self.etp == 1 else f"ep:experts{j}.{self.grid.expert(i)[0]}"
        return ((self.dense_group(gpu), dense, 0), (replicas, expert, 1))

    def _fsdp_gather(self, gpu):
        """Each unit's parameters, one unit ahead of the compute, per micro-batch."""
        prev = None
        for mb in range(self.options.accumulation_steps):
            for phase, u in self.fsdp_order:
                if prev is not None:
                    yield Wait(f"{gpu}:fsdp-started:{prev}")
                for group, name, k in self._fsdp_groups(gpu):
                    nbytes = self.unit_bytes[u][k]
                    if len(group) > 1 and nbytes > 0:
                        yield Collective(
                            "all_gather",
                            group,
                            nbytes,
                            f"{name}-fsdp:mb{mb}:{phase}:u{u}",
                            self.unit_names[u],
                            phase,
                        )
                prev = f"{mb}:{phase}:{u}"
                yield Signal(f"{gpu}:fsdp-gathered:{prev}")

    def _fsdp_reduce(self, gpu):
        """Each unit's gradients reduce-scattered once the last micro-batch's backward of
        the unit is done, in the order the backward pass finishes them."""
        for u in self.fsdp_reduce_order:
            yield Wait(f"{gpu}:fsdp-grads:{u}")
            for group, name, k in self._fsdp_groups(gpu):
                nbytes = self.unit_bytes[u][k]
                if len(group) > 1 and nbytes > 0:
                    yield Collective(
                        "reduce_scatter",
                        group,
                        nbytes,
                        f"{name}-fsdp-grads:u{u}",
                        self.unit_names[u],
                        "backward",
                    )
        yield Signal(f"{gpu}:reduced")
