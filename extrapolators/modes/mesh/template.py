"""A pipeline stage's compute stream as a template: built once per stage and shared by every
GPU of the stage (mesh/streams.py completes it per GPU with its groups and names).

The stage's schedule (extrapolators.modes.schedules: (F|B, micro-batch, local chunk) steps;
with one stage, F0 B0 F1 B1 ...: gradient accumulation) is walked once. A forward step
receives the activation of the chunk before (a pipeline's later chunks) and runs the
chunk's forward operators; a backward step receives the gradient of the chunk after and
runs its backward operators, with the forward operators a recomputation policy re-runs
inserted before their block's first backward operator (phase "recompute"). Around each
operator: the tensor-parallel collectives the TP plan puts before and after it (again for
a recomputed one, phase "recompute"), the attention across the CP group where it is one of
the attention operators, and with FSDP the waits for each unit's gather where the compute
enters it. In the last backward step of a chunk, after the operator that completes them:
the signals of the gradient buckets (DDP) or of the units' gradients (FSDP). Each step ends
with a signal for the send streams. Then: the signals of what no backward operator
completed, the waits for the send streams (pipelines), the reduction, the optimizer step
on the GPU's share (with the TP collectives sequence parallelism puts before it) and, where
the parameters come back after the step (the distributed optimizer, ZeRO-1/2), the wait
for them.

Items: ComputeRuns (the computes between two other items, the same tasks in the same
order as one per operator; a walk's stretches of operators that add nothing but their
compute task are cut once and added as their tasks at every micro-batch's step) and tuples
tagged COLL (collective template, key suffix,
recomputed), TPSTART / TPWAIT (the index of a collective in `side`: with tp_comm_overlap
a TP collective beside its operator, started before it and waited for after it), RECV
(source stage, key suffix, phase), SIGNAL / WAIT (name), ATTN (attention
op, one step's Compute, micro-batch), ENTER (FSDP entry key), GRADS ((chunk, unit)), A2A
and ETP (layer, all-to-all kind, micro-batch, recomputed, the expert-TP collective: an MoE
layer's all-to-all or expert-TP gather / reduce-scatter, mesh/experts.py). With experts a
stage has one template per EP rank where their loads differ (their experts' times).
`entries`: FSDP's (key, (chunk, unit), phase, gathers) in the order the compute enters
units: a unit is gathered where it is not resident (sharding.ShardPlan says when it
reshards). `reduce_order`: the (chunk, unit) pairs in the order their gradients complete.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from extrapolators.execution.tasks import ComputeRun
from extrapolators.modes.mesh.moe_tp import moe_block_of
from extrapolators.modes.schedules import split_steps
from triosim.trace.precision import MATMULS

COLL, RECV, SIGNAL, WAIT, ATTN, ENTER, GRADS, A2A, ETP, TPSTART, TPWAIT = range(11)
EPSTART, EPWAIT = 11, 12
PLAIN_STRETCHES = True  # a walk's plain stretches added as made tasks (tests: False, the
# operators one by one, to compare)


@dataclass
class Template:
    items: list = field(default_factory=list)
    entries: list = field(default_factory=list)
    reduce_order: list = field(default_factory=list)
    # tp_comm_overlap: the TP collectives run beside their operator on the GPU's "tp"
    # stream, in this order: (collective template, key suffix, recomputed); TPSTART i and
    # TPWAIT i in the items start the i-th and wait for its end
    side: list = field(default_factory=list)
    # ep_comm_overlap: the all-to-alls of paired steps on the GPU's "ep" stream, in this
    # order (A2A items); EPSTART i / EPWAIT i start the i-th and wait for its end
    ep_side: list = field(default_factory=list)


def stage_template(mode, p: int, ep_rank: int = 0) -> Template:
    """Stage p's template (module docstring) for an EP rank (its experts' loads). `mode`
    is the mesh mode after `check`."""
    o, mesh = mode.options, mode.mesh
    C, place = mesh.pp * mode.v, mode.place
    out, run = Template(), []
    items = out.items
    # a run's computes are prototypes at micro-batch 0 (`made`, the optimizer's), each
    # sequence made into a ComputeRun once and shared by every micro-batch's copy
    runs: dict = {}  # the prototypes' ids -> their ComputeRun (holding them: ids stay valid)
    run_mb = [0]

    def close(into):
        key = tuple(map(id, run))
        base = runs.get(key)
        if base is None:
            base = runs[key] = ComputeRun(run)
        into.append(base if run_mb[0] == 0 else ComputeRun.at_mb(base, run_mb[0]))
        run.clear()

    def other(item):
        if run:
            close(items)
        items.append(item)

    tpx, comm = mode.tpx, mesh.tp > 1
    before, after = (tpx.before, tpx.after) if comm else ({}, {})  # op id -> TP collectives
    split, whole = mode.target(mode.op_micro, tp=mesh.tp), mode.target(mode.op_micro)
    attention, shard = mode.attention, mode.shard
    p2p = o.cp_comm == "p2p"

    ex = mode.experts
    moe = ex is not None and (ex.ep > 1 or ex.etp > 1)

    def tokens(layer, kind, m, again, first):
        """An MoE layer's all-to-all (EP) and expert-TP collective (Megatron's dispatcher:
        A2A then AG before the experts, RS then A2A after them)."""
        steps = [(A2A, None)] if ex.ep > 1 else []
        if ex.etp > 1:
            gather = kind in ("dispatch", "combine-grad")
            steps.insert(
                len(steps) if first else 0, (ETP, "all_gather" if gather else "reduce_scatter")
            )
        for tag, op in steps:
            other((tag, layer, kind, m, again, op))

    overlap = comm and o.tp_comm_overlap
    # the linear layers' products, forward and backward: TransformerEngine overlaps their
    # all-gathers and reduce-scatters (not the embedding's or the loss's all-reduces)
    # (a layer's backward collectives sit before its first backward operator, often a view
    # of the gradient: they start there and end with the layer's product, `main`)
    products, main, pending = set(), set(), []  # pending: [layer, side indices started]
    if overlap:
        ops = mode.trace.operators
        fwd = {op.id for op in ops if op.name in MATMULS and op.phase == "forward"}
        products = fwd | {op.id for op in ops if op.fwd_id in fwd}
        main = fwd | {op.id for op in ops if op.fwd_id in fwd and "mm" in op.name.lower()}

    def flush():
        for i in pending[1:]:
            other((TPWAIT, i))
        pending.clear()

    secs: dict = {}  # op id -> its seconds (the same at every micro-batch)
    timed = mode.timed

    def seconds(op):
        t = secs.get(op.id)
        if t is None:
            t = secs[op.id] = mode.op_seconds(op, split, whole, 1.0, ep_rank)
        return t

    made: dict = {}  # (op id, part, phase) -> its task at micro-batch 0 (the same at every one)
    whole_in: dict = {}  # phase -> op id -> made[op id, 1.0, phase]

    def make(op, phase, part):
        c = made.get((op.id, part, phase))
        if c is None:
            c = made.get((op.id, part, None))
            if c is None:
                c = made[op.id, part, None] = timed(op, seconds(op) * part, 0, None, part)
            if phase is not None:
                c = made[op.id, part, phase] = dataclasses.replace(c, phase=phase)
        return c

    def full_task(op, phase):
        """The op's compute task with all its time (looked up by op id alone)."""
        mine = whole_in.setdefault(phase, {})
        c = mine.get(op.id)
        if c is None:
            c = mine[op.id] = make(op, phase, 1.0)
        return c

    def compute(op, m, phase, part):
        """The op's compute task, `part` of its time (a split backward's B: what is not
        W), or none where nothing is left."""
        if part == 1.0:  # (most tasks)
            c = full_task(op, phase)
        elif part > 0.0:  # (x 1.0: the same double)
            c = make(op, phase, part)
        else:
            return
        run.append(c)
        run_mb[0] = m

    def op_tasks(op, m, again, part=1.0):
        phase = "recompute" if again else None
        re = ":re" if again else ""
        if pending and op.layer != pending[0]:
            flush()
        if overlap and op.id in products:
            coll = [*before.get(op.id, ()), *after.get(op.id, ())]
            if coll or pending:  # (TE's userbuffers: the product pipelined with them)
                for c in coll:
                    if not pending:
                        pending.append(op.layer)
                    pending.append(len(out.side))
                    other((TPSTART, len(out.side)))
                    out.side.append((c, f"m{m}/{c.key}{re}", again))
                if moe:
                    for layer, kind in ex.before.get(op.id, ()):
                        tokens(layer, kind, m, again, True)
                compute(op, m, phase, part)
                if op.id in main:  # the layer's product: its collectives end with it
                    flush()
                return
        for c in before.get(op.id, ()):
            other((COLL, c, f"m{m}/{c.key}{re}", again))
        if moe:
            for layer, kind in ex.before.get(op.id, ()):
                tokens(layer, kind, m, again, True)
        if op.id in attention:  # a step of it (ring) or all of it (Ulysses), on its shard
            scale = 1 / mesh.cp if p2p else 1.0
            other((ATTN, op, mode.op_time(op, split, whole, m, phase, scale, ep_rank), m))
        else:
            compute(op, m, phase, part)
        for c in after.get(op.id, ()):
            other((COLL, c, f"m{m}/{c.key}{re}", again))

    def after_tasks(op, m, again):
        for layer, kind in ex.after.get(op.id, ()):
            tokens(layer, kind, m, again, False)

    order = mode.orders[p]
    last_b = {j: k for k, (kind, _, j) in enumerate(order) if kind == "B"}
    # zero-bubble schedules: the backwards split into B and W (wgrad.py), and the step
    # after which each chunk's gradients are complete (its last W or unsplit B)
    wsplit, last_g = split_steps(order)
    shares = mode.wgrad_shares if wsplit else {}
    # with accumulation, each schedule's last backward of a chunk reshards its units
    per = mode.flush_size
    flush_b = {(m // per, j): k for k, (kind, m, j) in enumerate(order) if kind == "B"}
    buckets_at: dict = {}
    param_at = mode.gather_before[p]
    for k, (pos, _, _) in enumerate(mode.buckets.get(p, ())):
        buckets_at.setdefault(pos, []).append(k)
    fired: set = set()
    resident: set = set()
    fwd_walks: dict = {}  # chunk -> its forward walk (one list object, for `segments`)
    # a walk's plain stretches: operators that add only their compute task to the run
    # (no collective, attention step, unit entry or parameter wait at them; the steps
    # that split backwards or signal gradients, and TP overlap and MoE layouts, take
    # every operator one by one), their tasks made once for every micro-batch's step
    plain_ok = PLAIN_STRETCHES and not overlap and not moe
    special = set(before) | set(after) | set(attention) | set(param_at)
    cut: dict = {}  # id(walk) -> (walk, its segments)

    def segments(walk):
        """The walk as lists of (op, recomputed) to take one by one and tuples of the
        compute tasks of plain stretches."""
        hit = cut.get(id(walk))
        if hit is not None and hit[0] is walk:
            return hit[1]
        segs, seen = [], set()  # [(plain, [its tasks, or its (op, recomputed)])]
        for op, again in walk:
            plain = op.id not in special
            if shard is not None:
                first = ("backward" if again else op.phase, shard.unit_of.get(op.id, 0))
                plain = plain and first in seen
                seen.add(first)
            if not segs or segs[-1][0] != plain:
                segs.append((plain, []))
            segs[-1][1].append(
                full_task(op, "recompute" if again else None) if plain else (op, again)
            )
        out = [tuple(x) if plain else x for plain, x in segs]
        cut[id(walk)] = (walk, out)
        return out

    entered: list = []  # (chunk, unit) entered in a forward step, in order
    steps = []  # each step's items

    def grads_signals(op):  # (in the step that completes chunk c's gradients)
        for k in buckets_at.get(mode.position[op.id], ()):
            fired.add(k)
            other((SIGNAL, f"bucket{k}"))
        for cu in mode.units_done.get((c, op.id), ()):
            out.reduce_order.append(cu)
            other((GRADS, cu))

    for step, (kind, m, j) in enumerate(order):
        items = []
        steps.append(items)
        c = place.chunk(p, j)
        if kind == "W":  # the weight gradients the step's B left
            for op in mode.pipe.bwd_ops[c]:
                compute(op, m, None, shares.get(op.id, 0.0))
                if last_g[j] == step:
                    grads_signals(op)
            if run:
                close(items)
            continue
        if kind == "F":
            if c > 0 and place.stage(c - 1) == p:  # (DualPipeV's turn: on this stage)
                other((WAIT, f"F{m}.{c - 1}"))
            elif c > 0:
                other((RECV, place.stage(c - 1), f"act{c - 1}.{m}", "forward"))
            walk = fwd_walks.get(c)
            if walk is None:
                walk = fwd_walks[c] = [(op, False) for op in mode.pipe.fwd_ops[c]]
            params = m == 0
        else:
            if c < C - 1 and place.stage(c + 1) == p:
                other((WAIT, f"B{m}.{c + 1}"))
            elif c < C - 1:
                other((RECV, place.stage(c + 1), f"grad{c + 1}.{m}", "backward"))
            walk = mode.walks.walk(c, m)
            params = False
        final = kind == "B" and last_b[j] == step
        input_only = kind == "B" and (m, j) in wsplit  # (its W comes later)
        here: set = set()
        fast = plain_ok and not input_only and not (final and last_g[j] == step)
        for seg in segments(walk) if fast else (walk,):
            if type(seg) is tuple:  # plain computes: the tasks op_tasks would add
                run.extend(seg)
                run_mb[0] = m
                continue
            for op, again in seg:
                if shard is not None:
                    u = shard.unit_of.get(op.id, 0)
                    phase = "backward" if again else op.phase
                    if (phase, u) not in here:
                        here.add((phase, u))
                        key = f"{m}:{phase}:{c}.{u}"
                        gathers = (c, u) not in resident
                        resident.add((c, u))
                        out.entries.append((key, (c, u), phase, gathers))
                        if phase == "forward" and (c, u) not in entered:
                            entered.append((c, u))
                        other((ENTER, key))
                if params and not again:  # overlap_param_gather: the updated shards
                    for k in param_at.get(op.id, ()):
                        other((WAIT, f"pg{k}"))
                op_tasks(op, m, again, 1.0 - shares.get(op.id, 0.0) if input_only else 1.0)
                if final and not again and last_g[j] == step:
                    grads_signals(op)
                if moe:
                    after_tasks(op, m, again)
        if pending:
            flush()
        if shard is not None:  # what this step leaves gathered
            if kind == "F":
                resident -= {(c, u) for ph, u in here if ph == "forward" and shard.reshards(u)}
            elif mesh.pp == 1 or final or flush_b[m // per, j] == step:
                resident -= {(c, u) for _, u in here}
        other((SIGNAL, f"{kind}{m}.{c}"))
    items = out.items
    if o.shared_expert_overlap:
        prefix = shared_prefix(ex.moe)
        steps = [beside_shared(one, prefix, out) for one in steps]
    if o.ep_comm_overlap:
        pairs = mode.pairs[p] if mode.pairs is not None else None
        for merged in paired(steps, order, out, per, pairs):
            items.extend(merged)
    else:
        for one in steps:
            items.extend(one)
    for k in range(len(mode.buckets.get(p, ()))):  # gradients no backward operator made
        if k not in fired:
            other((SIGNAL, f"bucket{k}"))
    for cu in entered:  # units no backward operator of the stage completes
        if cu not in out.reduce_order:
            out.reduce_order.append(cu)
            other((GRADS, cu))
    if mesh.pp > 1:
        for name, _ in mode.send_streams():
            other((WAIT, f"{name} done"))
    if not o.dp_overlap and shard is None:
        other((SIGNAL, "grads"))
    other((WAIT, "reduced"))
    scale = mode.optimizer_scale(p)
    for op in mode.ops("optimizer"):
        if comm:  # sequence parallelism: the partial weight gradients reduced here
            for c in tpx.before.get(op.id, ()):
                other((COLL, c, f"opt/{c.key}", False))
        run.append(mode.compute(op, split, scale))
        run_mb[0] = 0
    if mode.params_after_step:
        other((SIGNAL, "stepped"))
        other((WAIT, "params"))
    if run:
        close(items)
    return out


def paired(steps: list, order: list, out: Template, per: int | None = None, pairs=None):
    """ep_comm_overlap (Megatron's combined 1F1B): in the 1F1B steady state each backward
    step runs together with the forward step after it (Megatron adds a warm-up forward so
    that the two do not wait on each other across stages): both steps' receives first,
    then their items cut at their all-to-alls into segments, alternating (backward's k-th,
    forward's k-th, ...), each all-to-all started on the "ep" stream after the segment
    before it and waited for before the segment after it: one step's all-to-all runs
    beside the other's compute. Other steps as they are, and never two of different
    schedules (accumulation: `per` micro-batches a schedule; the last backward of one and
    the first forward of the next wait on each other across stages). Yields each step's items;
    renumbers `out.side` (TP overlap) in the new order of its starts and orders
    `out.entries` (FSDP's gathers) as the compute now enters the units. `pairs`: the
    steps k that run with step k + 1 where the schedule names them (DualPipeV's forward
    with a backward), instead of the steady state's."""
    k, merged = 0, []
    while k < len(steps):
        nxt = order[k + 1] if k + 1 < len(steps) else None
        same = nxt is not None and (per is None or order[k][1] // per == nxt[1] // per)
        if pairs is not None:
            pair = k in pairs
        else:
            pair = order[k][0] == "B" and same and nxt[0] == "F"
        if pair:
            merged.append(_interleave(steps[k], steps[k + 1], out))
            k += 2
            continue
        merged.append(steps[k])
        k += 1
    if out.side:  # the TP stream runs its collectives in the order the compute starts them
        new, where = [], {}
        for items in merged:
            for i, item in enumerate(items):
                if type(item) is tuple and item[0] == TPSTART:
                    where[item[1]] = len(new)
                    new.append(out.side[item[1]])
                    items[i] = (TPSTART, where[item[1]])
                elif type(item) is tuple and item[0] == TPWAIT:
                    items[i] = (TPWAIT, where[item[1]])
        out.side[:] = new
    if out.entries:  # FSDP's gather stream gathers in the order the compute enters units
        at = {e[0]: e for e in out.entries}
        order_in = [
            it[1] for items in merged for it in items if type(it) is tuple and it[0] == ENTER
        ]
        out.entries[:] = [at[key] for key in order_in]
    yield from merged


def _segments(items: list) -> tuple[list, list, list]:
    """(its receives, the segments between all-to-alls, the all-to-alls) of a step."""
    recv = [x for x in items if type(x) is tuple and x[0] == RECV]
    segs, a2a = [[]], []
    for item in items:
        if type(item) is tuple and item[0] == A2A:
            a2a.append(item)
            segs.append([])
        elif not (type(item) is tuple and item[0] == RECV):
            segs[-1].append(item)
    return recv, segs, a2a


def _interleave(first: list, second: list, out: Template) -> list:
    parts = [_segments(first), _segments(second)]
    items = [x for recv, _, _ in parts for x in recv]
    started = [None, None]  # each step's all-to-all in flight (its index in ep_side)
    for k in range(max(len(parts[0][1]), len(parts[1][1]))):
        for s, (_, segs, a2a) in enumerate(parts):
            if k >= len(segs):
                continue
            if started[s] is not None:
                items.append((EPWAIT, started[s]))
                started[s] = None
            items.extend(segs[k])
            if k < len(a2a):
                started[s] = len(out.ep_side)
                out.ep_side.append(a2a[k])
                items.append((EPSTART, started[s]))
    return items


def shared_prefix(moe: dict):
    """An expert layer's name -> its MoE layer's shared experts' module, as a dotted prefix
    (`layers.3.feed_forward.experts` -> `.layers.3.feed_forward.shared_experts.`)."""
    block_of, shared = moe_block_of(moe)
    return lambda layer: block_of(layer) + shared + "."


def beside_shared(items: list, prefix, out: Template) -> list:
    """shared_expert_overlap: each MoE layer's first all-to-all of a phase on the "ep"
    stream beside the layer's shared-expert operators of that phase (they need only the
    layer's input, or its output's gradient). Backward, where the shared experts come
    first: the combine's gradient starts before them and is waited for where it stood.
    Forward (and recomputed), where they come after the combine: they move to just after
    the dispatch's start, the dispatch waited for after them; left in line where any other
    item (a gather's wait, a parameter bucket's wait) stands between. Every other item
    keeps its place (a gradient bucket's signal stays after the operators it follows)."""
    flat = []  # ("t", task) or ("i", item)
    for it in items:
        if type(it) is ComputeRun:
            flat.extend(("t", t) for t in it.tasks)
        else:
            flat.append(("i", it))
    firsts = [
        k for k, (w, it) in enumerate(flat)
        if w == "i" and type(it) is tuple and it[0] == A2A and it[2] in ("dispatch", "combine-grad")
    ]  # fmt: skip
    if not firsts:
        return items
    start: dict = {}  # position -> the all-to-all started just before it
    wait_at: dict = {}  # position of the all-to-all -> (the all-to-all, its moved tasks)
    moved: set = set()
    for k in firsts:
        a2a = flat[k][1]
        phase = "backward" if a2a[2] == "combine-grad" else ("recompute" if a2a[4] else "forward")
        pre = prefix(a2a[1])
        mine = [
            q for q, (w, t) in enumerate(flat)
            if w == "t" and t.phase == phase and ("." + (t.layer or "") + ".").startswith(pre)
        ]  # fmt: skip
        if not mine:
            continue
        if phase == "backward" and max(mine) < k:
            start[min(mine)] = a2a
            wait_at[k] = (a2a, [])
        elif phase != "backward" and min(mine) > k:
            between = flat[k + 1 : max(mine)]
            if any(w == "i" and not (type(x) is tuple and x[0] == A2A) for w, x in between):
                continue  # a wait stands between: left in line
            wait_at[k] = (a2a, [flat[q][1] for q in mine])
            moved.update(mine)
    out_items, run = [], []

    def emit(x):
        if run:
            out_items.append(ComputeRun(run))
            run.clear()
        out_items.append(x)

    index: dict = {}  # an all-to-all (by identity) -> its ep_side index
    for q, (w, x) in enumerate(flat):
        if q in start:
            index[id(start[q])] = len(out.ep_side)
            out.ep_side.append(start[q])
            emit((EPSTART, index[id(start[q])]))
        if q in wait_at:
            a2a, tasks = wait_at[q]
            if tasks:  # forward: started here, the shared experts beside it
                index[id(a2a)] = len(out.ep_side)
                out.ep_side.append(a2a)
                emit((EPSTART, index[id(a2a)]))
                run.extend(tasks)
            emit((EPWAIT, index[id(a2a)]))
            continue
        if q in moved:
            continue
        if w == "t":
            run.append(x)
        else:
            emit(x)
    if run:
        out_items.append(ComputeRun(run))
    return out_items
