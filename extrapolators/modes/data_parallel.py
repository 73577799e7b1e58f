"""Single-GPU replay, standard data parallelism (dp) and distributed data parallelism (ddp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extrapolators.execution.symmetry import Symmetry
from extrapolators.execution.tasks import Collective, ComputeRun, Signal, Wait
from extrapolators.modes.base import Extrapolator, gradient_ready
from triosim.common.errors import ConfigError
from triosim.common.schema import option


class Single(Extrapolator):
    """Replay the trace on one GPU (at the plan's batch size and GPU)."""

    name = "single"
    hybrid_inner = True

    def check(self):
        if len(self.gpus) != 1:
            raise ConfigError("num_gpus", len(self.gpus), "1 for mode 'single'")

    def op_batch(self):
        return self.per_gpu_batch(1)

    def streams(self):
        target = self.target(self.per_gpu_batch(1))
        return {
            (self.gpus[0], "compute"): (self.compute(op, target) for op in self.trace.operators)
        }


@dataclass(frozen=True)
class DPOptions:
    accumulation_steps: int = option(
        1,
        ge=1,
        help="gradient accumulation: forward and "
        "backward this many times on batch/N/steps before "
        "the gradients are reduced",
    )
    recompute: Literal["none", "full", "selective"] = option(
        "none",
        help="activation recomputation: full (every block's forward again before its "
        "backward) or selective (the attention core, as Megatron-LM)",
    )
    recompute_depth: int | None = option(
        None,
        ge=1,
        help="layer-name depth of a recomputed block (torchtitan's Llama: 2, layers.N); "
        "default: the smallest giving >= 4 blocks that hold weights",
    )


class DataParallel(Extrapolator):
    """Every GPU runs the trace on batch/N; gradients are all-reduced after the backward pass.
    With accumulation, each GPU runs forward + backward `accumulation_steps` times on a
    micro-batch of batch/N/steps, and reduces once, after the last."""

    name = "dp"
    Options = DPOptions

    def check(self):
        self.op_batch()
        self._fb = self.forward_backward(self.options.recompute, self.options.recompute_depth)

    def op_batch(self):
        return self.per_gpu_batch(len(self.gpus) * self.options.accumulation_steps)

    def _step(self, target, mb, gpu=None):
        """One forward + backward (with any recomputation); with `gpu`, the signals of that
        GPU's buckets (DDP) follow the op that fills them."""
        if self.compute_runs:
            # the computes between two signals as one ComputeRun, built once for all GPUs
            for item in self._step_template(target, mb, gpu is not None):
                yield Signal(f"{gpu}:bucket{item}") if type(item) is int else item
            return
        for op, again in self._fb:
            yield self.compute(op, target, mb=mb, phase="recompute" if again else None)
            if gpu is not None and not again:
                for k in self._buckets_after.get(op.id, ()):
                    yield Signal(f"{gpu}:bucket{k}")

    _buckets_after: dict = {}  # op id -> buckets its gradient completes (DDP)

    def _step_template(self, target, mb, signals: bool) -> list:
        """`_step`'s tasks with ComputeRuns for the computes and bucket numbers for the
        signals; the same Compute tasks as the per-op path, in the same order."""
        cache = self.__dict__.setdefault("_templates", {})
        key = (target, mb, signals)
        if key not in cache:
            items, run = [], []
            for op, again in self._fb:
                run.append(self.compute(op, target, mb=mb, phase="recompute" if again else None))
                ks = self._buckets_after.get(op.id, ()) if signals and not again else ()
                if ks:
                    items.append(ComputeRun(run))
                    items += ks
                    run = []
            if run:
                items.append(ComputeRun(run))
            cache[key] = items
        return cache[key]

    def _optimizer(self):
        """The optimizer's computes (one ComputeRun shared by all GPUs with compute_runs)."""
        target = self.target(self.op_batch())
        if not self.compute_runs:
            for op in self.ops("optimizer"):
                yield self.compute(op, target)
            return
        if "_optimizer_run" not in self.__dict__:
            self._optimizer_run = ComputeRun(
                self.compute(op, target) for op in self.ops("optimizer")
            )
        if len(self._optimizer_run):
            yield self._optimizer_run

    def _micro_steps(self, gpu=None):
        """Forward + backward of every accumulation step; the last signals `gpu`'s buckets."""
        target = self.target(self.op_batch())
        steps = self.options.accumulation_steps
        for s in range(steps - 1):
            yield from self._step(target, s)
        yield from self._step(target, steps - 1, gpu)

    def grad_bytes(self) -> float:
        return self.trace.weight_bytes()  # one gradient per weight, of the weight's size

    def symmetry(self) -> Symmetry:
        """Every GPU runs the same stream and every all-reduce spans all GPUs: one class
        (`symmetry: auto`, see extrapolators.execution.symmetry)."""
        return Symmetry.one_class(self.gpus)

    def streams(self):
        return {key: gen for g in self.gpus for key, gen in self._gpu_streams(g).items()}

    def _gpu_streams(self, gpu):
        return {(gpu, "compute"): self._compute(gpu), (gpu, "comm"): self._comm(gpu)}

    def _compute(self, gpu):
        yield from self._micro_steps()
        yield Signal(f"{gpu}:grads")
        yield Wait(f"{gpu}:reduced")
        yield from self._optimizer()

    def _comm(self, gpu):
        yield Wait(f"{gpu}:grads")
        yield Collective(
            "allreduce",
            self.ring,
            self.grad_bytes(),
            "dp:allreduce",
            layer="gradients",
            phase="backward",
            algorithm=self.collective,
        )
        yield Signal(f"{gpu}:reduced")


@dataclass(frozen=True)
class DDPOptions(DPOptions):
    bucket_size: float = option(
        25 * 2**20,
        unit="bytes",
        gt=0,
        help="gradient bucket cap (PyTorch's bucket_cap_mb=25: 25 MiB)",
    )
    first_bucket_size: float = option(
        2**20, unit="bytes", gt=0, help="the first bucket's cap (PyTorch: 1 MiB)"
    )


class DistributedDataParallel(DataParallel):
    """Gradients grouped into buckets in the order backward produces them (as PyTorch: the
    first bucket capped at 1 MiB so communication starts early, the others at 25 MiB by
    default); each bucket's all-reduce starts on the comm stream as soon as its last gradient
    is ready, overlapping the rest of the backward pass. Every gradient is reduced."""

    name = "ddp"

    Options = DDPOptions

    def check(self):
        super().check()
        self._buckets = self._make_buckets()
        pos = {op.id: i for i, op in enumerate(self.trace.operators)}
        by_pos: dict[int, list[int]] = {}
        for k, (p, _, _) in enumerate(self._buckets):
            by_pos.setdefault(p, []).append(k)
        self._buckets_after = {i: by_pos[p] for i, p in pos.items() if p in by_pos}

    def buffer_bytes(self, gpu) -> float:
        # PyTorch DDP copies gradients into flat bucket buffers (gradient_as_bucket_view=False)
        return sum(size for _, size, _ in self._buckets)

    def buckets(self) -> list[tuple[int, float, int]]:
        """[(ready position, bytes, number of tensors)] in the order they are reduced."""
        return self._buckets

    def _weight_grad_bytes(self, w) -> float:
        """The bytes of weight `w`'s gradient a GPU reduces (a sharding mode: its shard)."""
        return self.trace.tensors[w].nbytes

    def _make_buckets(self):
        ready = gradient_ready(self.trace)
        weights = sorted(ready, key=lambda w: (ready[w], -w))
        out, size, count, last = [], 0.0, 0, -1
        for w in weights:
            size += self._weight_grad_bytes(w)
            count += 1
            last = max(last, ready[w])
            o = self.options
            if size >= (o.first_bucket_size if not out else o.bucket_size):
                out.append((last, size, count))
                size, count, last = 0.0, 0, -1
        if count:
            out.append((last, size, count))  # the leftover bucket is reduced too
        return out

    def _compute(self, gpu):
        # the step outside no_sync() signals the buckets as they fill
        yield from self._micro_steps(gpu)
        # buckets whose ready point was an optimizer op (no backward in the trace)
        for k, (p, _, _) in enumerate(self.buckets()):
            if self.trace.operators[p].phase == "optimizer":
                yield Signal(f"{gpu}:bucket{k}")
        yield Wait(f"{gpu}:reduced")
        yield from self._optimizer()

    def _comm(self, gpu):
        for k, (_, size, _) in enumerate(self.buckets()):
            yield Wait(f"{gpu}:bucket{k}")
            yield Collective(
                "allreduce",
                self.ring,
                size,
                f"ddp:bucket{k}",
                layer=f"bucket{k}",
                phase="backward",
                algorithm=self.collective,
            )
        yield Signal(f"{gpu}:reduced")
