"""Every GPU's streams on a mesh, from its stage's template (template.py): one builder for
every layout.

Per GPU at mesh coordinates (p, r, s, c, t) (dims.py):
  - "compute": the template, its items completed with this GPU's names: a TP collective
    over its TP group (the same task for every rank of the group, built by the first to
    reach it: its group and key do not name the rank), receives from the GPUs of the
    neighbouring stages with its (r, s, c, t), the attention over its CP group
    (cp_attention.py: ring attention's steps and receives, or Ulysses' all-to-alls), the
    waits for FSDP's gathers;
  - "send_fwd" and "send_bwd" with pipeline stages (pipeline_sends.chunk_sends): each
    step's activation or gradient to the neighbouring stage once the compute stream has
    made it, at the micro-batch's share of the cut's bytes, 1/tp of it with sequence
    parallelism, 1/cp with context parallelism;
  - "gather" with FSDP: each entry's all-gather over the GPU's shard group (dp_shard x
    cp), one entry ahead of the compute (it waits for the compute to start the entry
    before: FSDP2's prefetch), where the unit is not resident;
  - "dp": the gradients. FSDP: each unit's reduce-scatter over the shard group as the
    backward pass completes it, then (HSDP) the reduced shard's all-reduce over the
    replicas. Otherwise the stage's buckets (or, without dp_overlap, all its gradients
    after the backward pass) over the data-parallel group (dp_replicate x dp_shard x cp):
    all-reduced, or reduce-scattered (distributed optimizer, ZeRO-2); where the parameters
    come back after the step, their all-gather over the same group;
  - "cp" with ring attention: the key/value blocks, in the order the template reaches the
    attention operators.
With experts (mesh/experts.py) the compute stream's all-to-alls run over the GPU's EP
group and its expert-TP collectives over its expert-TP group, and on "dp" the experts'
gradients (buckets, FSDP units, parameter gathers) go over their replicas, the dense ones
as above; with overlap_param_gather "dp" first gathers the last step's updated shards in
the order the forward pass reads them.
"""

from __future__ import annotations

from extrapolators.execution.tasks import Collective, ComputeRun, Recv, Signal, Wait
from extrapolators.modes.cp_attention import ring_compute, ring_sends, ulysses
from extrapolators.modes.cp_plan import kv_block_bytes, ulysses_bytes
from extrapolators.modes.dist_optimizer import param_gather
from extrapolators.modes.mesh.dims import CP, PP, REP, SHARD, TP, RankOrdered
from extrapolators.modes.mesh.template import (
    A2A,
    ATTN,
    COLL,
    ENTER,
    EPSTART,
    EPWAIT,
    ETP,
    GRADS,
    RECV,
    SIGNAL,
    TPSTART,
    TPWAIT,
    stage_template,
)
from extrapolators.modes.pipeline_sends import chunk_sends

DP_DIMS = ("dp_replicate", "dp_shard", "cp")
SHARD_DIMS = ("dp_shard", "cp")


class MeshStreams:
    """The streams of a mesh mode after its `check` (module docstring)."""

    def __init__(self, mode):
        self.mode = mode
        self.layout = mode.layout
        self._templates: dict = {}
        self._groups: dict = {}

    def template(self, p: int, j: int = 0):
        """Stage p's template for EP rank j (one for every rank where their loads agree)."""
        t = self._templates.get((p, j))
        if t is None:
            t = self._templates[p, j] = stage_template(self.mode, p, j)
        return t

    def template_of(self, x):
        ex = self.mode.experts
        j = 0 if ex is None or ex.uniform else ex.ranks(x)[1]
        return self.template(x[PP], j)

    def experts_group(self, x, which) -> tuple:
        """x's EP group (which "ep"), expert-TP group ("etp") or experts' replicas ("edp"),
        GPU ids in rank order."""
        ex, at = self.mode.experts, self.layout.at
        key = (which, x)
        g = self._groups.get(key)
        if g is None:
            members = getattr(ex, f"{which}_group")(x)
            g = RankOrdered(at[y] for y in members)
            for y in members:  # one tuple per group, shared by its members
                self._groups[which, y] = g
        return g

    def streams(self) -> dict:
        mode, mesh = self.mode, self.mode.mesh
        out = {}
        ring_cp = mesh.cp > 1 and mode.options.cp_comm == "p2p"
        shared: dict = {}  # TP group -> [its ranks running, its collectives], this call's
        coords = sorted(self.layout.at, key=lambda x: (x[REP], x[SHARD], x[PP], x[CP], x[TP]))
        for x in coords:
            g = self.layout.at[x]
            out[(g, "compute")] = self.compute(x, shared)
            if mesh.pp > 1:
                for name, kinds in mode.send_streams():
                    out[(g, name)] = self.sends(x, kinds, name)
            out[(g, "dp")] = self.reduce(x)
            if mode.shard is not None:
                out[(g, "gather")] = self.gather(x)
            if ring_cp:
                out[(g, "cp")] = self.cp_sends(x)
            if mode.options.tp_comm_overlap and mesh.tp > 1:  # (the template: lazily)
                out[(g, "tp")] = self.tp_side(x)
            if mode.options.ep_comm_overlap or mode.options.shared_expert_overlap:
                out[(g, "ep")] = self.ep_side(x)
        return out

    def ep_side(self, x):
        """ep_comm_overlap or shared_expert_overlap: the all-to-alls the compute stream runs
        beside other work (template.ep_side), each when the compute stream starts it; the
        compute stream waits for its end where it needs it."""
        g = self.layout.at[x]
        for i, item in enumerate(self.template_of(x).ep_side):
            yield Wait(f"{g}:eps{i}")
            yield self._tokens(x, item)
            yield Signal(f"{g}:epd{i}")

    def tp_side(self, x):
        """tp_comm_overlap: the TP collectives beside their operators (template.side), each
        when the compute stream starts it; the compute stream waits for its end after the
        operator."""
        p, r, s, c, t = x
        g, group = self.layout.at[x], self.layout.group(x, ("tp",))
        name = f"p{p}r{r}s{s}c{c}/"
        for i, (k, key, again) in enumerate(self.template_of(x).side):
            yield Wait(f"{g}:tps{i}")
            phase = "recompute" if again else k.phase
            yield Collective(k.op, group, k.nbytes, name + key, k.layer, phase, k.algorithm, k.root)
            yield Signal(f"{g}:tpd{i}")

    # -- compute --------------------------------------------------------------------------
    def compute(self, x, shared_by: dict):
        p, r, s, c, t = x
        layout, at = self.layout, self.layout.at
        g = at[x]
        group = layout.group(x, ("tp",))
        name, chain, gk = f"p{p}r{r}s{s}c{c}/", f"r{r}s{s}c{c}t{t}/", f"{g}:"
        template = self.template_of(x)
        items = template.items
        slot = shared_by.get(group)
        if slot is None:
            slot = shared_by[group] = [0, [None] * len(items)]
        slot[0] += 1
        shared, runs = slot[1], self.mode.compute_runs
        for i, item in enumerate(items):
            if type(item) is ComputeRun:
                if runs:
                    yield item
                else:
                    yield from item.tasks
                continue
            tag = item[0]
            if tag == COLL:
                task = shared[i]
                if task is None:
                    k = item[1]
                    phase = "recompute" if item[3] else k.phase
                    task = shared[i] = Collective(
                        k.op, group, k.nbytes, name + item[2], k.layer, phase, k.algorithm, k.root
                    )
                yield task
            elif tag == RECV:
                yield Recv(at[(item[1], r, s, c, t)], chain + item[2], phase=item[3])
            elif tag == SIGNAL:
                yield Signal(gk + item[1])
            elif tag == ATTN:
                yield from self._attend(x, *item[1:])
            elif tag == ENTER:
                yield Wait(f"{g}:fsdp-gathered:{item[1]}")
                yield Signal(f"{g}:fsdp-started:{item[1]}")
            elif tag == GRADS:
                yield Signal(f"{g}:fsdp-grads:{item[1][0]}.{item[1][1]}")
            elif tag in (A2A, ETP):
                yield self._tokens(x, item)
            elif tag == TPSTART:
                yield Signal(f"{gk}tps{item[1]}")
            elif tag == TPWAIT:
                yield Wait(f"{gk}tpd{item[1]}")
            elif tag == EPSTART:
                yield Signal(f"{gk}eps{item[1]}")
            elif tag == EPWAIT:
                yield Wait(f"{gk}epd{item[1]}")
            else:
                yield Wait(gk + item[1])
        slot[0] -= 1
        if not slot[0]:  # the last running rank of the group: free the shared tasks
            del shared_by[group]

    # -- expert parallelism ---------------------------------------------------------------
    def _tokens(self, x, item) -> Collective:
        """An MoE layer's all-to-all over x's EP group, or its expert-TP all-gather or
        reduce-scatter (mesh/experts.py)."""
        tag, layer, kind, m, again, op = item
        ex = self.mode.experts
        te, j, d = ex.ranks(x)
        p = x[PP]
        phase = (
            "recompute" if again else ("forward" if kind in ("dispatch", "combine") else "backward")
        )
        re = ":re" if again else ""
        if tag == A2A:
            sizes = ex.a2a_sizes(kind)
            group = self.experts_group(x, "ep")
            key = f"ep:p{p}d{d}e{te}:m{m}:{layer}:{kind}{re}"
            return Collective(
                "all_to_all",
                group,
                sum(sizes[j]),
                key,
                layer=layer,
                phase=phase,
                algorithm=ex.a2a_algorithm,
                sizes=sizes,
            )
        group = self.experts_group(x, "etp")
        key = f"etp:p{p}d{d}j{j}:m{m}:{layer}:{kind}-{op}{re}"
        nbytes = (ex.etp_dispatch if kind == "dispatch" else ex.etp_bytes)[j]
        return Collective(op, group, nbytes, key, layer, phase)

    # -- context parallelism --------------------------------------------------------------
    def _tag(self, x, op, phase, m) -> str:
        p, r, s, _, t = x
        return f"cp:p{p}r{r}s{s}t{t}:{m}:{op.id}:{phase}"

    def _attend(self, x, op, step, m):
        mode = self.mode
        g, group = self.layout.at[x], self.layout.group(x, ("cp",))
        tag, forward = self._tag(x, op, step.phase, m), op.phase == "forward"
        if mode.options.cp_comm == "p2p":
            yield from ring_compute(g, group, step, tag, forward)
            return
        a = mode.attention[op.id]
        qkv, out = ulysses_bytes(mode.trace, a, mode.token_ratio(), mode.mesh.tp)
        before, after = (qkv, out) if forward else (out, qkv)
        yield from ulysses(group, step, before, after, tag, mode.collective)

    def cp_sends(self, x):
        """Ring attention's sends, in the order the compute stream reaches them."""
        mode = self.mode
        g, group = self.layout.at[x], self.layout.group(x, ("cp",))
        ratio, tp = mode.token_ratio(), mode.mesh.tp
        for item in self.template_of(x).items:
            if type(item) is tuple and item[0] == ATTN:
                _, op, step, m = item
                nbytes = kv_block_bytes(mode.trace, mode.attention[op.id], ratio, tp)
                tag = self._tag(x, op, step.phase, m)
                yield from ring_sends(
                    g, group, nbytes, tag, op.phase == "forward", step.layer, step.phase
                )

    # -- pipeline sends -------------------------------------------------------------------
    def sends(self, x, kinds: str, name: str):
        mode, mesh = self.mode, self.mode.mesh
        p, r, s, c, t = x
        ratio = mode.pipe._mb_ratio() / (mesh.tp if mode.options.sequence_parallel else 1)
        ratio /= mesh.cp  # each CP rank passes on its tokens' activations
        at = self.layout.at
        yield from chunk_sends(
            at[x],
            mode.orders[p],
            kinds,
            p,
            mode.place,
            mode.pipe.boundary,
            ratio,
            lambda q: at[(q, r, s, c, t)],
            f"r{r}s{s}c{c}t{t}",
            name,
        )

    # -- data parallelism -----------------------------------------------------------------
    def _kinds(self, x, dense, name: str) -> list:
        """[(kind, group, key name)] of x's weights: the dense ones over `dense` (a group
        of the mesh) under `name`, the routed experts' over their replicas (mesh/
        experts.py) under a name their members share (stage, EP and expert-TP ranks)."""
        out = [("dense", dense, name)]
        ex = self.mode.experts
        if ex is not None:
            te, j, _ = ex.ranks(x)
            out.append(("expert", self.experts_group(x, "edp"), f"experts{j}.{te}p{x[PP]}"))
        return out

    def gather(self, x):
        """FSDP: each entry's parameters, one entry ahead of the compute."""
        mode, shard = self.mode, self.mode.shard
        p, r, _, _, t = x
        g, group = self.layout.at[x], self.layout.group(x, SHARD_DIMS)
        kinds = self._kinds(x, group, f"p{p}r{r}t{t}")
        prev = None
        for key, (c, u), phase, gathers in self.template_of(x).entries:
            if prev is not None:
                yield Wait(f"{g}:fsdp-started:{prev}")
            for kind, peers, name in kinds if gathers else ():
                nbytes = shard.of(kind).get((c, u), 0.0)
                if nbytes > 0 and len(peers) > 1:
                    yield Collective(
                        "all_gather",
                        peers,
                        nbytes,
                        f"fsdp:{name}:{key}",
                        shard.names[u],
                        phase,
                        algorithm=mode.collective,
                    )
            prev = key
            yield Signal(f"{g}:fsdp-gathered:{key}")

    def reduce(self, x):
        mode = self.mode
        g = self.layout.at[x]
        peers = self.layout.group(x, DP_DIMS)
        if mode.options.overlap_param_gather:
            yield from self._param_gathers(x, peers)
        if mode.shard is not None:
            yield from self._reduce_units(x)
        else:
            yield from self._reduce_buckets(x, peers)
        yield Signal(f"{g}:reduced")
        if mode.params_after_step:
            p, t = x[PP], x[TP]
            yield Wait(f"{g}:stepped")
            for kind, group, name in self._kinds(x, peers, f"p{p}t{t}"):
                nbytes = mode.weights.held(p, kind, "gathered")  # the parameters
                c = param_gather(group, nbytes, f"params:{name}", mode.collective)
                if c is not None:
                    yield c
            yield Signal(f"{g}:params")

    def _param_gathers(self, x, peers):
        """overlap_param_gather: the last step's updated shards, gathered in the order the
        forward pass reads them (the steady state of Megatron's overlap)."""
        mode, g = self.mode, self.layout.at[x]
        p, t = x[PP], x[TP]
        kinds = self._kinds(x, peers, f"p{p}t{t}")
        groups = {kind: (group, name) for kind, group, name in kinds}
        for k, (_, nbytes, kind) in enumerate(mode.param_buckets[p]):
            group, name = groups[kind]
            if len(group) > 1 and nbytes > 0:
                yield Collective(
                    "all_gather",
                    group,
                    nbytes,
                    f"params:{name}:{k}",
                    "parameters",
                    "forward",
                    mode.collective,
                )
            yield Signal(f"{g}:pg{k}")

    def _reduce_units(self, x):
        mode, shard = self.mode, self.mode.shard
        p, r, s, c, t = x
        g = self.layout.at[x]
        group = self.layout.group(x, SHARD_DIMS)
        replicas = self.layout.group(x, ("dp_replicate",))
        kinds = self._kinds(x, group, f"p{p}r{r}t{t}")
        for cu in self.template_of(x).reduce_order:
            yield Wait(f"{g}:fsdp-grads:{cu[0]}.{cu[1]}")
            unit = shard.names[cu[1]]
            for kind, peers, name in kinds:
                nbytes = shard.of(kind, grads=True).get(cu, 0.0)
                if nbytes > 0 and len(peers) > 1:
                    key = f"fsdp:{name}:grads:{cu[0]}.{cu[1]}"
                    yield Collective(
                        "reduce_scatter", peers, nbytes, key, unit, "backward", mode.collective
                    )
            nbytes = shard.grads.get(cu, 0.0)
            if nbytes > 0 and len(replicas) > 1:  # HSDP: the reduced shard over the replicas
                key = f"hsdp:p{p}s{s}c{c}t{t}:{cu[0]}.{cu[1]}"
                share = nbytes / len(group)
                yield Collective(
                    "allreduce", replicas, share, key, unit, "backward", mode.collective
                )

    def _reduce_buckets(self, x, peers):
        mode = self.mode
        p, t = x[PP], x[TP]
        g = self.layout.at[x]
        kinds = {kind: (group, name) for kind, group, name in self._kinds(x, peers, f"p{p}t{t}")}
        op = mode.reduction
        if mode.options.dp_overlap:
            for k, (_, size, kind) in enumerate(mode.buckets.get(p, ())):
                yield Wait(f"{g}:bucket{k}")
                group, name = kinds[kind]
                if len(group) > 1:
                    yield Collective(
                        op,
                        group,
                        size,
                        f"dp:{name}:bucket{k}",
                        layer=f"bucket{k}" if mode.experts is None else f"{kind} bucket{k}",
                        phase="backward",
                        algorithm=mode.collective,
                    )
            return
        yield Wait(f"{g}:grads")
        for kind, (group, name) in kinds.items():
            nbytes = mode.grad_bytes(p, kind)
            if len(group) > 1 and (kind == "dense" or nbytes > 0):
                yield Collective(
                    op,
                    group,
                    nbytes,
                    f"dp:{name}",
                    layer="gradients" if kind == "dense" else "expert gradients",
                    phase="backward",
                    algorithm=mode.collective,
                )
