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

from extrapolators.base import Extrapolator
from extrapolators.tasks import Collective, Recv, Send, Signal, Wait
from triosim.errors import ConfigError


class Hybrid(Extrapolator):
    name = "hybrid"

    def check(self):
        from extrapolators import extrapolator_class

        dp, n = self.plan.dp, len(self.gpus)
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1 or n % dp:
            raise ConfigError("parallelism.dp", dp, f"an integer >= 1 dividing num_gpus ({n})")
        if self.plan.inner == "hybrid":
            raise ConfigError("parallelism.inner", "hybrid", "tp, gpipe, 1f1b or single")
        inner_cls = extrapolator_class(self.plan.inner)
        k = n // dp
        batch = self.per_gpu_batch(dp)
        plan = dataclasses.replace(self.plan, mode=self.plan.inner, num_gpus=k,
                                   batch_size=batch if self.plan.batch_size is not None or dp > 1
                                   else None)  # fmt: skip
        self.replicas = []
        for r in range(dp):
            group = self.gpus[r * k : (r + 1) * k]
            ring = [g for g in self.ring if g in set(group)]  # keep the topology's ring order
            self.replicas.append(inner_cls(self.trace, self.model, plan, group, ring))

    def held_weight_bytes(self, gpu) -> float:
        return self.replicas[0].held_weight_bytes(self._peers(gpu)[0])

    def _peers(self, gpu) -> list:
        """The GPU at the same position in every replica (its data-parallel group)."""
        k = len(self.gpus) // self.plan.dp
        j = self.gpus.index(gpu) % k
        return [rep.gpus[j] for rep in self.replicas]

    def streams(self):
        out = {}
        for r, rep in enumerate(self.replicas):
            for (gpu, stream), tasks in rep.streams().items():
                tasks = _prefixed(tasks, f"r{r}/")
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
            ring = tuple(g for g in self.ring if g in set(peers))
            yield Collective("allreduce", ring, self.held_weight_bytes(gpu),
                             f"dp:{self.gpus.index(peers[0])}", layer="gradients",
                             phase="backward", algorithm=self.plan.collective)  # fmt: skip
        yield Signal(f"{gpu}:dp-reduced")


def _prefixed(tasks, prefix: str):
    """Rename every meeting key of a replica's tasks so replicas stay apart."""
    for t in tasks:
        if isinstance(t, (Collective, Send, Recv, Signal, Wait)):
            t = dataclasses.replace(t, key=prefix + t.key)
        yield t
