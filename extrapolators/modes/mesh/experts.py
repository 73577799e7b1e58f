"""Expert parallelism on the mesh (`ep`, `etp` > 1 with a mixture-of-experts trace): the
expert mesh folded out of each stage's GPUs, the experts' loads and bytes, and their
operators' times, as Megatron-Core's all-to-all token dispatcher runs them.

The fold (Megatron-Core, parallel_state.py: two rank generators over the same GPUs, the
dense "tp-cp-ep-dp-pp" and the expert one, etp fastest): a stage's s GPUs numbered in the
dense order (dims.Mesh.local: tp, cp, dp_shard, dp_replicate), local index i has expert-TP
rank i % etp, EP rank (i // etp) % ep, expert-DP rank i // (etp x ep); an EP group is the
ep GPUs sharing the other two, an expert-TP group etp consecutive indices, an expert's
replicas (expert-DP group) the s / (ep x etp) GPUs sharing the expert-TP and EP ranks. So
EP is carved out of the data-parallel (and, with etp < tp, tensor- and context-parallel)
GPUs: no new axis, no new GPUs. ep x etp divides s; ep divides the experts; etp each
expert's FFN width; with tp > 1 sequence parallelism is required (Megatron-Core: "When
using MoE and tensor parallelism, sequence parallelism must be used").

Per MoE layer and GPU (dispatcher: permute -> A2A(EP) -> AG(ETP); RS(ETP) -> A2A(EP) ->
unpermute), on the compute stream: forward, the dispatch all-to-all before the layer's
routed experts and with etp > 1 an all-gather of what the expert-TP group received; after
them, with etp > 1 a reduce-scatter, then the combine all-to-all; backward, the combine's
gradient (all-gathered with etp > 1) before the experts' backward operators and the
dispatch's gradient (reduce-scattered first) after them.

Bytes, per GPU and MoE layer, uniform loads, dropless: a GPU holds S / (cp x tp) of a
micro-batch's S tokens (CP ranks their share, TP ranks theirs under sequence parallelism)
and routes each to k experts: its all-to-all buffer is that x k x hidden x the dispatched
dtype, (ep - 1) / ep of it leaving. EP rank i sends rank j 1/ep of the tokens j's experts
keep (moe_loads.dispatch_sizes), so uneven loads (`load: skew` or given) give uneven all-
to-alls. The expert-TP all-gather's buffer is etp x the tokens the GPU received.

An expert operator's time is the performance model's on a view of the trace holding one
GPU's experts (their weights, casts and gradients at 1/(ep x etp) of the bytes) at the
batch giving the tokens EP rank j's experts keep (their scale: those tokens over the E x
capacity slots the traced grouped GEMMs processed at this batch; 1 with uniform loads and
dropless routing); with etp > 1 its hidden-wide token tensors hold the expert-TP group's
tokens (etp x the GPU's own). With the replay model (`perfmodel.kind: trace`) the traced
time is scaled by the tokens' share instead (1/(ep x etp) for an operator that touches no
token).

What the trace must say (metadata `moe`, docs/trace-format.md): the experts' module
(`expert_module`: operators whose layer ends with it, weights named under it), the number
of experts, top-k, hidden size, the traced tokens and capacity, the dispatched dtype, the
router's capacity factor, `expert_ffn` for etp > 1.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from extrapolators.communication.nccl.system import node_partition
from extrapolators.modes import moe_loads
from extrapolators.modes.mesh.dims import Mesh
from perfmodel.base import Target, batch_ratio, scales_with_batch
from perfmodel.replay import TraceTime
from triosim.common.errors import ConfigError
from triosim.trace.model import DTYPE_BYTES, Trace

MOE_FIELDS = ("expert_module", "num_experts", "top_k", "hidden", "tokens", "capacity")
A2A_BEFORE = {"forward": "dispatch", "backward": "combine-grad"}
A2A_AFTER = {"forward": "combine", "backward": "dispatch-grad"}


def moe_metadata(trace, field: str, value) -> dict:
    """The trace's `moe` metadata, checked; where it has none, a ConfigError naming `field`
    (what asked for experts) = `value`."""
    moe = trace.metadata.get("moe")
    if not isinstance(moe, dict):
        raise ConfigError(
            field,
            value,
            "a trace with mixture-of-experts layers (metadata 'moe': `triosim trace "
            "mixtral-8x7b` or `deepseek-v3` writes it)",
        )
    missing = [k for k in MOE_FIELDS if k not in moe]
    if missing:
        raise ConfigError("trace", "metadata moe", f"the fields {', '.join(missing)}")
    experts = int(moe["num_experts"])
    if not 1 <= int(moe["top_k"]) <= experts:
        raise ConfigError("trace", "metadata moe.top_k", f"1 to the {experts} experts")
    return moe


def check_load_fields(o, experts: bool) -> None:
    """The expert-load fields are used or refused: skew only with `load: skew`, expert_loads
    only with `load: given`, and any of them only with experts on the mesh."""
    if o.load != "skew" and o.skew != 1.0:
        raise ConfigError(
            "parallelism.skew", o.skew, f"1.0 (unused) with load {o.load}: set load: skew"
        )
    if o.load != "given" and o.expert_loads is not None:
        raise ConfigError(
            "parallelism.expert_loads", o.expert_loads, f"null with load {o.load}: set load: given"
        )
    if o.dispatcher != "deepep":
        for field in ("router_groups", "router_group_topk"):
            if getattr(o, field) is not None:
                raise ConfigError(
                    f"parallelism.{field}",
                    getattr(o, field),
                    "null with dispatcher alltoall (the routing groups change only what "
                    "DeepEP's dispatch sends): set dispatcher: deepep",
                )
    if not experts:
        unset_fields = (
            ("load", "uniform"),
            ("capacity_factor", None),
            ("dispatcher", "alltoall"),
            ("dispatch_dtype", None),
        )
        for field, unset in unset_fields:
            if getattr(o, field) != unset:
                raise ConfigError(
                    f"parallelism.{field}",
                    getattr(o, field),
                    f"{unset} without experts on the mesh (ep or etp > 1 with an MoE trace)",
                )


@dataclass(frozen=True)
class ExpertMesh:
    """The expert mesh folded out of `mesh` (module docstring): groups as mesh coordinate
    tuples, in rank order."""

    mesh: Mesh
    ep: int
    etp: int = 1

    @property
    def edp(self) -> int:
        """Each expert's replicas per stage."""
        return self.mesh.stage_size // (self.ep * self.etp)

    def ranks(self, x) -> tuple[int, int, int]:
        """(expert-TP rank, EP rank, expert-DP rank) of mesh coordinates x."""
        i = self.mesh.local(x)
        return i % self.etp, (i // self.etp) % self.ep, i // (self.etp * self.ep)

    def _members(self, x, which: int) -> tuple:
        ranks = list(self.ranks(x))
        out = []
        for v in range((self.etp, self.ep, self.edp)[which]):
            ranks[which] = v
            i = ranks[0] + self.etp * (ranks[1] + self.ep * ranks[2])
            out.append(self.mesh.from_local(x[0], i))
        return tuple(out)

    def ep_group(self, x) -> tuple:
        """x's EP group: the ep GPUs sharing its expert-TP and expert-DP ranks."""
        return self._members(x, 1)

    def etp_group(self, x) -> tuple:
        """x's expert-TP group: etp consecutive local indices."""
        return self._members(x, 0)

    def edp_group(self, x) -> tuple:
        """x's experts' replicas: the GPUs sharing its expert-TP and EP ranks."""
        return self._members(x, 2)


class ExpertPlan:
    """The experts of a mesh mode after its degrees are resolved (module docstring).

    `ep`, `etp`, `edp`; `expert_ops`, `expert_weights`; `before[op id]` / `after[op id]`:
    the all-to-all kinds around an MoE layer's first and last expert operator of a phase;
    `sizes` (GPU i of an EP group sends j `sizes[i][j]` bytes in the dispatch) and `back`
    (the combine's); `etp_bytes[j]` (`etp_dispatch[j]` after the forward dispatch, at its
    dtype); `uniform` (every EP rank alike); `time(op, j)`."""

    def __init__(self, mode, mesh, options, tokens_batch: float | None):
        trace = mode.trace
        self.mode, self.mesh, self.trace = mode, mesh, trace
        o = options
        if mode.experts_always:
            asked = ("parallelism.mode", mode.name)
        else:
            asked = ("parallelism.ep", o.ep) if o.ep != 1 else ("parallelism.etp", o.etp)
        moe = self.moe = moe_metadata(trace, *asked)
        experts = int(moe["num_experts"])
        s = mesh.stage_size
        n = mesh.size
        where = f"num_gpus ({s})" if mesh.pp == 1 else f"num_gpus / pp ({n} / {mesh.pp} = {s})"
        if s % o.etp:
            raise ConfigError(
                "parallelism.etp", o.etp, f"an expert-tensor-parallel degree dividing {where}"
            )
        ep = o.ep or s // o.etp
        if s % (ep * o.etp):
            raise ConfigError(
                "parallelism.ep",
                ep,
                f"ep x etp ({ep} x {o.etp}) dividing {where} (Megatron-Core: the world size "
                f"divisible by expert-TP x EP{' x PP' if mesh.pp > 1 else ''})",
            )
        if experts % ep:
            raise ConfigError(
                "parallelism.ep", ep, f"a divisor of {where} and of the {experts} experts"
            )
        ffn = moe.get("expert_ffn")
        if o.etp > 1 and ffn is not None and int(ffn) % o.etp:
            raise ConfigError(
                "parallelism.etp",
                o.etp,
                f"an expert-tensor-parallel degree dividing each expert's FFN width "
                f"({int(ffn)}): each GPU takes an equal shard of every expert",
            )
        if mesh.tp > 1 and not o.sequence_parallel:
            raise ConfigError(
                "parallelism.sequence_parallel",
                False,
                f"true with tp {mesh.tp} and expert parallelism (Megatron-Core: 'When using "
                f"MoE and tensor parallelism, sequence parallelism must be used')",
            )
        self.fold = ExpertMesh(mesh, ep, o.etp)
        self.ep, self.etp, self.edp = ep, o.etp, self.fold.edp
        self.ranks = self.fold.ranks
        self.ep_group, self.etp_group = self.fold.ep_group, self.fold.etp_group
        self.edp_group = self.fold.edp_group
        self.tokens_batch = tokens_batch
        self._split()
        self._loads(o)

    # -- the trace ------------------------------------------------------------------------
    def _split(self):
        """Which operators and weights are the routed experts', and where each MoE layer's
        forward and backward expert operators begin and end."""
        mark = "." + self.moe["expert_module"] + "."

        def expert(name):
            return name is not None and mark in "." + name + "."

        trace = self.trace
        self.expert_ops = {o.id for o in trace.operators if expert(o.layer)}
        if not self.expert_ops:
            raise ConfigError(
                "trace",
                "metadata moe.expert_module",
                f"a module some operators' layer ends with ({self.moe['expert_module']!r})",
            )
        self.expert_weights = {t.id for t in trace.weights() if expert(t.name)}
        self.before: dict = {}  # op id -> [(layer, all-to-all kind)]
        self.after: dict = {}
        for phase in ("forward", "backward"):
            span: dict = {}
            for o in trace.operators:
                if o.phase == phase and o.id in self.expert_ops:
                    span.setdefault(o.layer, [o.id, o.id])[1] = o.id
            for layer, (a, b) in span.items():
                self.before.setdefault(a, []).append((layer, A2A_BEFORE[phase]))
                self.after.setdefault(b, []).append((layer, A2A_AFTER[phase]))

    def _loads(self, o):
        moe, trace = self.moe, self.trace
        experts, top_k = int(moe["num_experts"]), int(moe["top_k"])
        ratio = batch_ratio(trace, Target(batch_size=self.tokens_batch))
        cf = o.capacity_factor if o.capacity_factor is not None else moe.get("capacity_factor")
        self.shares = moe_loads.expert_shares(
            experts, top_k, o.load, o.skew, o.seed, o.expert_loads
        )
        tokens = float(moe["tokens"]) * ratio  # a GPU's (its share of the sequence)
        kept = moe_loads.kept_tokens(self.shares, tokens, top_k, self.ep, cf)
        traced = experts * float(moe["capacity"]) * ratio  # the trace's slots at this batch
        self.kept = kept
        self.gpu_tokens = moe_loads.per_gpu(kept, self.ep)
        self.scale = [x / traced for x in self.gpu_tokens]
        self.uniform = len(set(self.scale)) == 1
        hidden = float(moe["hidden"])
        rest = hidden * DTYPE_BYTES[moe.get("dispatch_dtype", "bfloat16")]
        sent = o.dispatch_dtype or moe.get("dispatch_dtype", "bfloat16")
        # FP8 dispatch (DeepSeek-V3, DeepEP): a byte per value, a float32 scale per 128
        fwd = (
            hidden + 4 * math.ceil(hidden / 128) if sent == "float8" else hidden * DTYPE_BYTES[sent]
        )
        copies = moe_loads.dispatch_sizes(kept, self.ep, 1.0)  # tokens, one per routed expert
        # expert TP: what each EP rank's GPUs all-gather after the dispatch (and reduce-
        # scatter before the combine): the tokens all etp ranks received, etp x its own
        received = [self.etp * sum(col) for col in zip(*copies, strict=True)]
        self.etp_bytes = [x * rest for x in received]  # the combine's and the gradients'
        self.etp_dispatch = [x * fwd for x in received]  # after the dispatch: its dtype
        # the all-to-all's algorithm: DeepEP's kernels (no per-pair cap), else NCCL's
        self.a2a_algorithm = "deepep" if o.dispatcher == "deepep" else None
        if o.dispatcher == "deepep":
            copies = self._deepep(copies, o)
        self.sizes = _scaled(copies, fwd)
        self.grad_sizes = self.sizes if fwd == rest else _scaled(copies, rest)
        self.back = moe_loads.transpose(self.grad_sizes)
        self._times: dict = {}

    def _deepep(self, copies, o):
        """The dispatch's tokens as DeepEP moves them (moe_loads.deepep_sizes), over the EP
        group's nodes in the topology; before there is one (the plan's early check) the
        all-to-all's."""
        moe, experts = self.moe, int(self.moe["num_experts"])
        groups = o.router_groups or moe.get("router_groups") or 1
        if experts % groups:
            raise ConfigError(
                "parallelism.router_groups", groups, f"a divisor of the {experts} experts"
            )
        top = o.router_group_topk or moe.get("router_group_topk") or groups
        k = int(moe["top_k"])
        if not 1 <= top <= groups or k > top * (experts // groups):
            raise ConfigError(
                "parallelism.router_group_topk",
                top,
                f"1 to the {groups} groups, holding at least top_k ({k}) experts",
            )
        nodes = self._nodes()
        if nodes is None:
            return copies
        return moe_loads.deepep_sizes(copies, nodes, experts, k, groups, top)

    def _nodes(self) -> list | None:
        """EP rank j's node, numbered by first appearance, the same in every EP group
        (else a ConfigError); None without a topology."""
        mode = self.mode
        if mode.graph is None:
            return None
        part, at = node_partition(mode.graph), mode.layout.at
        patterns = set()
        for x in at:
            if self.ranks(x)[1] == 0:
                first: dict = {}
                patterns.add(
                    tuple(first.setdefault(part[at[y]], len(first)) for y in self.ep_group(x))
                )
        for pattern in patterns:
            try:
                moe_loads.node_members(pattern)
            except ValueError as e:
                raise ConfigError(
                    "parallelism.dispatcher",
                    "deepep",
                    f"an EP group whose GPUs fill its nodes alike (DeepEP forwards by "
                    f"position): {e}",
                ) from None
        if len(patterns) > 1:
            raise ConfigError(
                "parallelism.dispatcher",
                "deepep",
                "EP groups placed alike on the nodes (DeepEP's forwarding is by position); "
                f"here {len(patterns)} placements",
            )
        return list(patterns.pop())

    def a2a_sizes(self, kind: str):
        """The all-to-all's bytes matrix: the dispatch's (at the dispatched dtype) and the
        combine's gradient go the dispatch's way, the others back."""
        if kind == "dispatch":
            return self.sizes
        return self.grad_sizes if kind == "combine-grad" else self.back

    # -- timing ---------------------------------------------------------------------------
    def time(self, op, j: int) -> float:
        """Seconds expert operator `op` takes on EP rank j (module docstring)."""
        key = (j, op.id)
        t = self._times.get(key)
        if t is not None:
            return t
        mode = self.mode
        tokens = scales_with_batch(self.trace, op)
        if isinstance(mode.model, TraceTime):
            t = mode.model.time(op, mode.target(self.tokens_batch))
            t *= self.scale[j] if tokens else 1.0 / (self.ep * self.etp)
        else:
            batch = self.tokens_batch or self.trace.batch_size
            batch = batch * self.scale[j] if tokens else batch
            t = self._sharded_model().time(op, mode.target(batch))
        self._times[key] = t
        return t

    def _etp_gathered(self, t) -> bool:
        """With etp > 1, whether token tensor `t` of an expert operator holds the tokens of
        the whole expert-TP group: those at the model's hidden width (gathered before the
        experts, the row layer's output before its reduce-scatter), etp x the GPU's own;
        the FFN-wide ones hold the group's tokens at 1/etp of the width. Not told apart
        where the widths are equal."""
        h, f = self.moe.get("hidden"), self.moe.get("expert_ffn")
        return self.etp > 1 and h != f and bool(t.shape) and t.shape[-1] == h

    def _sharded_model(self):
        """The performance model on a view of the trace where each tensor the experts'
        operators touch that does not scale with the batch has 1/(ep x etp) of its bytes,
        and with etp > 1 each hidden-wide token tensor etp x its bytes."""
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
                        elif self._etp_gathered(t):
                            tensors[tid] = dataclasses.replace(t, nbytes=t.nbytes * self.etp)
            view = Trace(self.trace.operators, tensors, self.trace.metadata)
            m = self._sharded = self.mode.model.view(view)
        return m

    def whole_layers(self, fwd, starts: list) -> list:
        """Pipeline stage starts (forward positions) with a cut inside an MoE layer's routed
        experts moved to just after them: a layer's dispatch and combine run on one stage
        (Megatron-Core cuts between transformer layers)."""
        span: dict = {}
        for k, op in enumerate(fwd):
            if op.id in self.expert_ops:
                span.setdefault(op.layer, [k, k])[1] = k
        moved = [next((b + 1 for a, b in span.values() if a < s <= b), s) for s in starts]
        if any(b <= a for a, b in zip(moved, moved[1:], strict=False)) or moved[-1] >= len(fwd):
            raise ConfigError(
                "parallelism.pp",
                self.mesh.pp,
                f"at most as many stages as the model has cuts outside its MoE layers' "
                f"experts (stage starts {starts} would become {moved} of {len(fwd)} "
                f"forward operators)",
            )
        return moved


def _scaled(matrix, factor: float) -> tuple:
    return tuple(tuple(x * factor for x in row) for row in matrix)
