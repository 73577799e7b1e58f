"""Hybrid parallelism: `dp` data-parallel replicas of an inner plan (tensor parallel,
pipeline, or one GPU each).

The N GPUs form dp contiguous groups of N/dp; each group runs the inner mode on
batch/dp. Every task key of a replica is prefixed with its replica so replicas never
meet by accident. After a GPU's backward pass (just before its first optimizer
operator), the GPUs at the same position in every replica all-reduce the gradients that
position holds (a pipeline stage's weights, a TP shard), on a separate stream; the
optimizer waits for it. The gradient reduction is not overlapped with backward here
(as in standard data parallelism).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from extrapolators.execution.symmetry import Symmetry
from extrapolators.execution.tasks import Collective, Signal, Wait, prefixed
from extrapolators.modes.base import Extrapolator
from triosim.common import schema
from triosim.common.errors import ConfigError
from triosim.common.schema import option


@dataclass(frozen=True)
class HybridOptions:
    dp: int = option(1, ge=1, help="data-parallel replicas (num_gpus / dp GPUs each)")
    inner: str = option("single", help="the mode inside each replica (tp, gpipe, 1f1b, single)")
    inner_options: object = option(None, flatten=True)  # the inner mode's own fields


class Hybrid(Extrapolator):
    name = "hybrid"
    Options = HybridOptions

    @classmethod
    def load_options(cls, data, where, elsewhere, also=()):
        from extrapolators.modes import EXTRAPOLATORS

        own = {k: v for k, v in data.items() if k in ("dp", "inner")}
        o = schema.load(HybridOptions, own, where, owner="parallelism mode 'hybrid'", also=also)
        inner_cls = EXTRAPOLATORS.get(o.inner) if o.inner in EXTRAPOLATORS else None
        if inner_cls is None or not inner_cls.hybrid_inner:
            allowed = [n for n, c in EXTRAPOLATORS.items() if c.hybrid_inner]
            raise ConfigError(
                f"{where}.inner", o.inner, f"a mode that hybrid replicates: {', '.join(allowed)}"
            )
        rest = {k: v for k, v in data.items() if k not in own}
        inner = inner_cls.load_options(rest, where, elsewhere, also=(*also, "dp", "inner"))
        return dataclasses.replace(o, inner_options=inner)

    def check(self):
        from extrapolators.modes import EXTRAPOLATORS

        dp, n, inner = self.options.dp, len(self.gpus), self.options.inner
        if n % dp:
            raise ConfigError("parallelism.dp", dp, f"an integer >= 1 dividing num_gpus ({n})")
        inner_cls = EXTRAPOLATORS.get(inner) if inner in EXTRAPOLATORS else None
        if inner_cls is None or not inner_cls.hybrid_inner:
            raise ConfigError("parallelism.inner", inner, "a mode that hybrid replicates")
        k = n // dp
        batch = self.per_gpu_batch(dp)
        # position of every GPU, and each replica's and each position's GPUs in ring order
        # (the topology's), in one pass over the ring: O(N), not O(N x dp)
        self._pos = {g: i for i, g in enumerate(self.gpus)}
        rings = [[] for _ in range(dp)]
        self._peer_rings = [[] for _ in range(k)]
        for g in self.ring:
            i = self._pos.get(g)
            if i is None:
                continue
            rings[i // k].append(g)
            self._peer_rings[i % k].append(g)
        self.replicas = []
        for r in range(dp):
            group = self.gpus[r * k : (r + 1) * k]
            ring = rings[r]  # keep the topology's ring order
            try:
                self.replicas.append(
                    inner_cls(
                        self.trace,
                        self.model,
                        group,
                        self.options.inner_options,
                        batch_size=batch,
                        gpu=self.gpu,
                        ring=ring,
                        graph=self.graph,
                        host=self.host,
                    )
                )
            except ConfigError as e:
                if e.field != "num_gpus":
                    raise
                # the inner mode's degree is a replica's GPUs, num_gpus / dp: say so
                raise ConfigError(
                    "parallelism.dp",
                    dp,
                    f"a split whose replicas of num_gpus "
                    f"/ dp = {k} GPUs the inner mode allows: {e.allowed}",
                ) from None

    def op_batch(self):
        return self.replicas[0].op_batch()

    def activation_ratio(self, op) -> float:
        return self.replicas[0].activation_ratio(op)

    def buffer_bytes(self, gpu) -> float:
        return self.replicas[0].buffer_bytes(self._peers(gpu)[0])

    def held_weight_bytes(self, gpu) -> float:
        return self.replicas[0].held_weight_bytes(self._peers(gpu)[0])

    def _peers(self, gpu) -> list:
        """The GPU at the same position in every replica (its data-parallel group)."""
        k = len(self.gpus) // self.options.dp
        j = self._pos[gpu] % k
        return [rep.gpus[j] for rep in self.replicas]

    def symmetry(self) -> Symmetry:
        """Replica 0's GPUs represent the others, replica r mapped by position: the inner
        mode's group of replica r is its ring (`rings[r]`, the topology's order), and each
        position's all-reduce (one GPU per replica) is a whole class."""
        reps = self.replicas

        def image_group(group, k):
            if tuple(group) == tuple(reps[0].ring):
                return reps[k].ring
            pos = {g: i for i, g in enumerate(reps[0].gpus)}
            return tuple(reps[k].gpus[pos[g]] for g in group)

        return Symmetry.of_replicas([rep.gpus for rep in reps], image_group)

    def streams(self):
        out = {}
        for r, rep in enumerate(self.replicas):
            for (gpu, stream), tasks in rep.streams().items():
                tasks = prefixed(tasks, f"r{r}/")
                out[(gpu, stream)] = self._hooked(gpu, tasks) if stream == "compute" else tasks
            for gpu in rep.gpus:
                out[(gpu, "dp")] = self._reduce(gpu)
        return out

    def _hooked(self, gpu, tasks):
        """The replica's compute stream, with the gradient all-reduce before the optimizer."""
        waited = False
        for task in tasks:
            if not waited and getattr(task, "phase", None) == "optimizer":
                yield Signal(f"{gpu}:dp-grads")
                yield Wait(f"{gpu}:dp-reduced")
                waited = True
            yield task
        if not waited:
            yield Signal(f"{gpu}:dp-grads")
            yield Wait(f"{gpu}:dp-reduced")

    def _reduce(self, gpu):
        yield Wait(f"{gpu}:dp-grads")
        peers = tuple(self._peers(gpu))
        if len(peers) > 1:
            j = self._pos[peers[0]]
            ring = tuple(self._peer_rings[j])
            yield Collective(
                "allreduce",
                ring,
                self.held_weight_bytes(gpu),
                f"dp:{j}",
                layer="gradients",
                phase="backward",
                algorithm=self.collective,
            )
        yield Signal(f"{gpu}:dp-reduced")
