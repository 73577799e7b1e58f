"""Expert parallelism with data parallelism (`mode: ep`), as Megatron-LM's EP and
DeepSpeed-MoE run it.

`num_gpus` = dp x ep. Every GPU runs the dense part of the model (attention, router,
shared experts, embedding, head) on batch / num_gpus, as data parallelism; the routed
experts of each MoE layer are spread over the `ep` GPUs of an EP group (consecutive GPU
ids: one node's, as Megatron-LM places them), E / ep on each, so each expert has dp
replicas. Per MoE layer and GPU, on the compute stream (the tokens' path blocks it):

- forward: the dispatch all-to-all before the layer's routed experts (each token's hidden
  state to the GPU of each expert it was routed to), the experts' operators, the combine
  all-to-all after them (the outputs back);
- backward: the combine's gradient (the outputs' gradients to the experts' GPUs) before
  the experts' backward operators, the dispatch's gradient (the inputs' gradients back)
  after them.

Bytes: EP rank i sends rank j 1/ep of the tokens kept by j's experts, hidden x the
dispatched dtype's size each (moe_loads.dispatch_sizes); with uniform loads and no
dropping, tokens x hidden x dtype x (ep - 1) / ep leave each GPU per all-to-all. An expert
operator's time is the performance model's on a view of the trace holding E/ep experts
(their weights, casts and gradients at 1/ep of the bytes) at the batch that gives the
tokens the GPU's experts keep (its scale: those tokens over the E x capacity slots the
trace's grouped GEMMs processed at this batch; 1 with uniform loads and dropless routing):
the GEMMs keep their FLOPs per token but read 1/ep of the weights, so fine-grained experts
with few tokens each, weight-bound on one GPU, come out compute-bound. With the replay
model (`perfmodel.kind: trace`) the traced time is scaled by the token share instead (1/ep
for an expert operator that touches no token). After the backward
pass, on the comm stream, the dense gradients are all-reduced over all GPUs and each
GPU's expert gradients over its experts' dp replicas (GPUs with the same EP rank); the
optimizer step runs on what the GPU holds (its time x held / all weight bytes).

What the trace must say (metadata `moe`, docs/trace-format.md): the experts' module
(`expert_module`: operators whose layer ends with it, weights named under it), the number
of experts, top-k, hidden size, the traced tokens and capacity, the dispatched dtype,
the router's capacity factor. With `accumulation_steps` k, forward and backward (and their
all-to-alls) run k times on batch / num_gpus / k before the gradients are reduced. Not
modelled: expert tensor parallelism, pipeline or FSDP
with EP, overlap of the all-to-alls with compute. With `dp_overlap` the gradients are
reduced in buckets as the backward pass makes them (ep_buckets: dense and expert apart),
on the comm stream, overlapping the rest of the backward pass.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Literal

from extrapolators.execution.tasks import Collective, ComputeRun, Signal, Wait
from extrapolators.modes import ep_buckets, moe_loads
from extrapolators.modes.base import Extrapolator
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
        "many times on batch / num_gpus / steps before the gradients are reduced",
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
    capacity_factor: float | None = option(
        None,
        gt=0,
        help="token dropping: an expert keeps at most this factor x its balanced share "
        "of its EP group's tokens (null: the trace's router: its moe.capacity_factor, "
        "null there: dropless)",
    )


class ExpertParallel(Extrapolator):
    """Expert parallelism x data parallelism (module docstring)."""

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
        self.ep = ep = o.ep or n
        experts = int(moe["num_experts"])
        if n % ep or experts % ep:
            raise ConfigError(
                "parallelism.ep", ep, f"a divisor of num_gpus ({n}) and of the {experts} experts"
            )
        if not 1 <= int(moe["top_k"]) <= experts:
            raise ConfigError("trace", "metadata moe.top_k", f"1 to the {experts} experts")
        self.dp = n // ep
        ratio = batch_ratio(self.trace, Target(batch_size=self.op_batch()))
        cf = o.capacity_factor if o.capacity_factor is not None else moe.get("capacity_factor")
        shares = moe_loads.expert_shares(
            experts, int(moe["top_k"]), o.load, o.skew, o.seed, o.expert_loads
        )
        tokens = float(moe["tokens"]) * ratio  # per GPU
        kept = moe_loads.kept_tokens(shares, tokens, int(moe["top_k"]), ep, cf)
        traced = experts * float(moe["capacity"]) * ratio  # the trace's slots at this batch
        self.shares, self.kept = shares, kept
        self.gpu_tokens = moe_loads.per_gpu(kept, ep)
        self.expert_scale = [x / traced for x in self.gpu_tokens]
        token_bytes = float(moe["hidden"]) * DTYPE_BYTES[moe.get("dispatch_dtype", "bfloat16")]
        self.sizes = moe_loads.dispatch_sizes(kept, ep, token_bytes)
        self.back = moe_loads.transpose(self.sizes)
        self._split_trace()

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
        o = self.options
        self.buckets = []  # (ready position, bytes, kind), with dp_overlap
        self.signals_after: dict = {}  # op id -> buckets its gradient completes
        if o.dp_overlap:
            self.buckets = ep_buckets.buckets(
                self.trace, self.expert_weights, self.ep, o.first_bucket_size, o.bucket_size
            )
            ops = self.trace.operators
            for k, (pos, _, _) in enumerate(self.buckets):
                if ops[pos].phase != "optimizer":
                    self.signals_after.setdefault(ops[pos].id, []).append(k)
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

    def op_batch(self):
        return self.per_gpu_batch(len(self.gpus) * self.options.accumulation_steps)

    def held_weight_bytes(self, gpu) -> float:
        return self.dense_bytes + self.expert_bytes / self.ep

    def activation_ratio(self, op) -> float:
        r = super().activation_ratio(op)
        if op.id in self.expert_ops:  # sized at the busiest GPU's tokens (one plan for all)
            return r * max(self.expert_scale)
        return r

    def groups(self, gpu) -> tuple[int, int, tuple, tuple]:
        """(dp index, EP rank, EP group, expert data-parallel group) of `gpu`."""
        i = self.gpus.index(gpu)
        d, j = divmod(i, self.ep)
        return (
            d,
            j,
            tuple(self.gpus[d * self.ep : (d + 1) * self.ep]),
            tuple(self.gpus[j :: self.ep]),
        )

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
            t *= self.expert_scale[j] if tokens else 1.0 / self.ep
        else:
            batch = self.op_batch() or self.trace.batch_size
            batch = batch * self.expert_scale[j] if tokens else batch
            t = self._sharded_model().time(op, self.target(batch))
        cache[key] = t
        return t

    def _sharded_model(self):
        """The performance model on a view of the trace where each tensor the experts'
        operators touch that does not scale with the batch has 1/ep of its bytes."""
        m = self.__dict__.get("_sharded")
        if m is None:
            tensors = dict(self.trace.tensors)
            for o in self.trace.operators:
                if o.id in self.expert_ops:
                    for tid in o.inputs + o.outputs:
                        t = self.trace.tensors[tid]
                        if not t.scales_with_batch:
                            tensors[tid] = dataclasses.replace(t, nbytes=t.nbytes / self.ep)
            m = self._sharded = copy.copy(self.model)
            m.trace = Trace(self.trace.operators, tensors, self.trace.metadata)
            if getattr(m, "identity", False):  # the view is not the traced run: its
                m.identity = False  # operators touch 1/ep of the weights, so no replay
        return m

    def _template(self, j: int, mb: int) -> list:
        """EP rank j's forward and backward of micro-batch mb: ComputeRuns (or Computes)
        and, between them, (layer, kind, sizes) for each all-to-all; built once per rank
        and micro-batch, shared by the rank's GPUs."""
        cache = self.__dict__.setdefault("_templates", {})
        if (j, mb) in cache:
            return cache[j, mb]
        target = self.target(self.op_batch())
        items, run = [], []

        def flush():
            if run:
                items.extend([ComputeRun(run)] if self.compute_runs else run)
                run.clear()

        for op in self.ops("forward", "backward"):
            for a2a in self.before.get(op.id, ()) if self.ep > 1 else ():
                flush()
                items.append(a2a)
            if op.id in self.expert_ops:
                run.append(self.timed(op, self._expert_time(op, j), mb))
            else:
                run.append(self.compute(op, target, mb=mb))
            last_step = mb == self.options.accumulation_steps - 1
            for k in self.signals_after.get(op.id, ()) if last_step else ():
                flush()
                items.append(("signal", k))
            for a2a in self.after.get(op.id, ()) if self.ep > 1 else ():
                flush()
                items.append(a2a)
        flush()
        cache[j, mb] = items
        return items

    def streams(self):
        out = {}
        for g in self.gpus:
            out[(g, "compute")] = self._compute(g)
            out[(g, "comm")] = self._comm(g)
        return out

    def _compute(self, gpu):
        d, j, group, _ = self.groups(gpu)
        for mb in range(self.options.accumulation_steps):
            for item in self._template(j, mb):
                if type(item) is tuple and len(item) == 2:  # a gradient bucket is ready
                    yield Signal(f"{gpu}:epb{item[1]}")
                elif type(item) is tuple:
                    layer, kind, sizes = item
                    phase = "forward" if kind in ("dispatch", "combine") else "backward"
                    yield Collective(
                        "all_to_all",
                        group,
                        sum(sizes[j]),
                        f"ep{d}:mb{mb}:{layer}:{kind}",
                        layer=layer,
                        phase=phase,
                        sizes=sizes,
                    )
                else:
                    yield item
        if self.options.dp_overlap:  # buckets no backward operator completes
            ops = self.trace.operators
            for k, (pos, _, _) in enumerate(self.buckets):
                if ops[pos].phase == "optimizer":
                    yield Signal(f"{gpu}:epb{k}")
        else:
            yield Signal(f"{gpu}:grads")
        yield Wait(f"{gpu}:reduced")
        target = self.target(self.op_batch())
        total = self.trace.weight_bytes()
        share = self.held_weight_bytes(gpu) / total if total else 1.0
        opt = [self.compute(op, target, share) for op in self.ops("optimizer")]
        if opt and self.compute_runs:
            yield ComputeRun(opt)
        elif opt:
            yield from opt

    def _comm(self, gpu):
        _, j, _, replicas = self.groups(gpu)
        if self.options.dp_overlap:
            yield from self._bucket_comm(gpu, j, replicas)
            return
        yield Wait(f"{gpu}:grads")
        if len(self.gpus) > 1 and self.dense_bytes > 0:
            yield Collective(
                "allreduce",
                self.ring,
                self.dense_bytes,
                "ep:dense-allreduce",
                layer="gradients",
                phase="backward",
            )
        if len(replicas) > 1 and self.expert_bytes > 0:
            yield Collective(
                "allreduce",
                replicas,
                self.expert_bytes / self.ep,
                f"ep:experts{j}-allreduce",
                layer="expert gradients",
                phase="backward",
            )
        yield Signal(f"{gpu}:reduced")

    def _bucket_comm(self, gpu, j, replicas):
        """dp_overlap: each bucket's all-reduce as soon as it is ready, in ready order:
        dense ones over all GPUs, expert ones over this GPU's experts' replicas."""
        for k, (_, size, kind) in enumerate(self.buckets):
            yield Wait(f"{gpu}:epb{k}")
            group = self.ring if kind == "dense" else replicas
            if len(group) > 1:
                name = "ep:dense" if kind == "dense" else f"ep:experts{j}"
                yield Collective(
                    "allreduce",
                    group,
                    size,
                    f"{name}-bucket{k}",
                    layer=f"{kind} bucket{k}",
                    phase="backward",
                )
        yield Signal(f"{gpu}:reduced")

    def buffer_bytes(self, gpu) -> float:
        # dp_overlap: the gradients copied into flat bucket buffers, as DDP's
        return sum(size for _, size, _ in self.buckets)
