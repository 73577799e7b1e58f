"""The symmetry of a mesh run (`symmetry: auto`): copies of a stage's GPUs that run the
same streams mapped by coordinates, so the runtime simulates one copy and moves the others'
bytes as images (extrapolators.execution.symmetry)."""

from __future__ import annotations

import itertools
import math
import operator

from extrapolators.execution.symmetry import Symmetry
from extrapolators.modes.mesh.dims import CP, PP, REP, SHARD, TP, RankOrdered


def mesh_symmetry(mode) -> Symmetry:
    """Copies of a stage's GPUs along every digit of their local index (dims.Mesh.local,
    Megatron-Core's dense order) whose ranks run the same streams: the digits of the
    data-parallel dimensions (dp_replicate, dp_shard), of TP and, without data
    parallelism, of CP; with experts on the mesh the digits of the common refinement of the
    dense and the expert mesh (`digits`), EP's only where every EP rank keeps the same
    tokens. CP's ranks do the same work (the load-balanced chunks, cp_attention); ring
    attention sends to the next CP rank, an image of the sender (execution.symmetry: a
    send to an image). Every group of the mesh is a product
    of whole digits, so a copy (a shift of each digit, modulo its radix) maps groups to
    groups. Copy 0's GPUs (every stage of it) represent the others; a group along some of
    the digits is a representative at the copies of those digits, its images the other
    cosets' groups (execution.symmetry). Where that breaks in the run (a network that
    treats the copies apart: a data-parallel ring that leaves a host at one GPU of it
    tells the EP ranks of the host apart), the fallbacks are the same without EP's
    digits, then one axis (`one_axis`)."""
    radices, shifts, ep = digits(mode)
    chain = []  # the declarations to try, finest first
    if radices is not None:
        parity = _node_parity_digit(mode, radices) if mode.experts is not None else None
        same_parity = [d for d in shifts if d != parity]
        for ds in (shifts, same_parity, [d for d in shifts if d not in ep]):
            ds = [d for d in ds if radices[d] > 1]
            if len(ds) >= 2 and all(c[1] != ds for c in chain):
                chain.append((radices, ds))
    sym = one_axis(mode)
    for radices, ds in reversed(chain):  # each falls back to the next coarser
        finer = _along(mode, radices, ds)
        finer.fallback, sym = sym, finer
    return sym


def _per_mode(f):
    """`f(mode)` computed once per mode (its layout and topology do not change): `digits`
    and the fallbacks built after it ask the same questions of the same layout."""
    name = f"_symmetry_{f.__name__}"

    def once(mode):
        d = mode.__dict__
        if name not in d:
            d[name] = f(mode)
        return d[name]

    once.__doc__, once.__name__ = f.__doc__, f.__name__
    return once


@_per_mode
def _node_size(mode) -> int | None:
    """GPUs a node holds, in a stage's local index, where the first stage's local index
    runs node by node (local i on node i // g); None otherwise or without a topology."""
    graph = getattr(mode, "graph", None)
    if graph is None:
        return None
    from extrapolators.communication.nccl.system import node_partition

    part, mesh, at = node_partition(graph), mode.mesh, mode.layout.at
    nodes = {}
    for x in at:
        if x[PP] == 0:
            nodes[mesh.local(x)] = part.get(at[x])
    if None in nodes.values():
        return None
    order = [nodes[i] for i in sorted(nodes)]
    g = order.count(order[0])
    first = {}
    ok = all(first.setdefault(n, i // g) == i // g for i, n in enumerate(order))
    return g if ok and len(order) % g == 0 else None


def _node_parity_digit(mode, radices: list):
    """The digit (index into `radices`) of a stage's local index that steps from a node
    to the next where the next digit's copies keep the node's parity: NCCL's rail rings
    enter and leave alternate nodes on alternate GPUs, so a copy that moves a GPU to a
    node of the other parity may meet another ring (None where there is no such digit)."""
    g = _node_size(mode)
    if g is None:
        return None
    lo = 1
    for d, r in enumerate(radices):
        if lo == g and r == 2:
            return d
        lo *= r
    return None


def digits(mode):
    """(radices of a stage's local index, fastest first; the digits copies shift; EP's
    digits), or (None, None, None) where the dense and the expert mesh have no common
    refinement."""
    mesh, ex = mode.mesh, mode.experts
    dense = [mesh.tp, mesh.cp, mesh.dp_shard, mesh.dp_replicate]
    cuts = {math.prod(dense[: i + 1]) for i in range(4)}
    if ex is not None:
        cuts |= {ex.etp, ex.etp * ex.ep, mesh.stage_size}
        g = _node_size(mode)  # EP's copies across nodes: a node, and two (its parity:
        if g is not None:  # _node_parity_digit)
            cuts |= {c for c in (g, 2 * g) if mesh.stage_size % c == 0}
    bounds = sorted(cuts)
    radices, prev = [], 1
    for b in bounds:
        if b % prev:
            return None, None, None
        if b > prev:
            radices.append(b // prev)
        prev = b
    ends = list(itertools.accumulate(radices, operator.mul))  # each digit's upper bound
    starts = [e // r for e, r in zip(ends, radices, strict=True)]
    cp_lo, cp_hi = mesh.tp, mesh.tp * mesh.cp  # CP's digits: between these
    # with data parallelism the data-parallel groups fold CP in (FSDP over dp_shard x cp):
    # their NCCL rings are no orbits of a CP shift, so the network would move every copy's
    # flows, slower than keeping the CP ranks (torchtitan's 405B 4D layout at 1,024 GPUs:
    # 18.8 s against 15.6)
    cp_fixed = mesh.cp > 1 and (mesh.dp_replicate * mesh.dp_shard > 1 or not _cp_rings(mode))
    shifts, ep = [], []
    for d, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        if ex is not None and lo >= ex.etp and hi <= ex.etp * ex.ep:
            ep.append(d)
            if not ex.uniform:
                continue  # EP ranks with other loads
        if cp_fixed and lo >= cp_lo and hi <= cp_hi:
            continue
        shifts.append(d)
    return radices, shifts, ep


@_per_mode
def _cp_rings(mode) -> bool:
    """Whether every CP group of the first stage lies in CP-rank order (either way round,
    from any rank): a CP shift then maps each ring attention's sends to sends. The groups
    are in the topology's ring order (dims.Layout), which on hosts of several GPUs may
    snake ([0, 4, 12, 8]): its copies would break the symmetry, and the run fall back."""
    layout, cp = mode.layout, mode.mesh.cp
    for x in layout.at:
        if x[PP] or x[CP]:
            continue
        ranks = [layout.coord[g][CP] for g in layout.group(x, ("cp",))]
        steps = {(b - a) % cp for a, b in zip(ranks, ranks[1:] + ranks[:1], strict=True)}
        if steps not in ({1}, {cp - 1}):
            return False
    return True


def _along(mode, radices: list, shifts: list) -> Symmetry:
    """Copies shifting the local index's digits `shifts` (of `radices`, fastest first)."""
    mesh, at, layout = mode.mesh, mode.layout.at, mode.layout
    coord = layout.coord
    axes = [radices[d] for d in reversed(shifts)]  # the slowest first (Symmetry's order)
    weights = list(itertools.accumulate([1] + radices[:-1], operator.mul))

    def offsets(k: int) -> dict:
        out = {}
        for d in shifts:  # the fastest axis last in k
            k, out[d] = divmod(k, radices[d])
        return out

    def moved(x, k):
        i, step = mesh.local(x), offsets(k)
        j = 0
        for d, (r, w) in enumerate(zip(radices, weights, strict=True)):
            j += ((i // w % r + step.get(d, 0)) % r) * w
        return mesh.from_local(x[0], j)

    first = sorted(
        x for x in at if all(mesh.local(x) // weights[d] % radices[d] == 0 for d in shifts)
    )
    copies = math.prod(axes)
    replicas = [[at[moved(x, k)] for x in first] for k in range(copies)]

    def image_group(group, k):
        images = tuple(at[moved(coord[g], k)] for g in group)
        if isinstance(group, RankOrdered):  # the expert mesh's groups, in rank order
            return RankOrdered(sorted(images, key=lambda g: mesh.local(coord[g])))
        return layout.ring_order(images)  # the mesh's groups: in ring order

    sym = Symmetry.of_replicas(replicas, image_group, axes)
    sym.sample = 2  # the streams come from shared stage templates (one_axis says more)
    return sym


def one_axis(mode) -> Symmetry:
    """Copies along one axis of a stage's GPUs (numbered in the dense order, dims.Mesh.
    local): the outer data-parallel dimension (dp_replicate, else dp_shard; without
    either, TP, then CP: their ranks run the same streams). With experts on the mesh: the EP rank
    where every rank's experts keep the same tokens and no TP or CP group spans EP ranks
    (an EP group is then one class, its all-to-all run once over the whole group; along
    the replicas, with more copies, Megatron's Mixtral layout at 1,024 GPUs broke the
    symmetry: the data-parallel ring across the copies meets each host at another
    point), else each expert's replicas (the expert-DP rank: an EP group lies in a copy).
    Copy 0's GPUs (every stage of it) represent the others, mapped by moving the axis;
    groups inside a copy map to the same group of the others, and a group across the
    copies (one GPU per copy and position: data-parallel, EP) is a union of classes."""
    mesh, at = mode.mesh, mode.layout.at
    stride, copies = copy_axis(mode)
    if copies < 2:  # every GPU its own class: the runtime says so and runs them all
        return Symmetry.of_replicas([list(at.values())])
    first = sorted(x for x in at if mesh.local(x) // stride % copies == 0)

    def moved(x, k):
        return mesh.from_local(x[0], mesh.local(x) + k * stride)

    replicas = [[at[moved(x, k)] for x in first] for k in range(copies)]
    coord, layout = mode.layout.coord, mode.layout

    def image_group(group, k):
        images = tuple(at[moved(coord[g], k)] for g in group)
        # a group in ring order (the mesh's) maps to its image in ring order; one in
        # rank order (EP, expert-TP, an expert's replicas) member by member
        ring = layout.ring_order(group)
        return layout.ring_order(images) if tuple(group) == ring else images

    sym = Symmetry.of_replicas(replicas, image_group)
    # every copy's streams come from the same stage templates mapped by coordinates:
    # the stream check compares the first, a middle and the last copy
    sym.sample = 2
    return sym


def copy_axis(mode) -> tuple[int, int]:
    """(stride in a stage's local index, copies) of the symmetry's axis."""
    mesh, ex = mode.mesh, mode.experts
    if ex is not None:
        if ex.ep > 1 and ex.uniform and mesh.tp == 1 and mesh.cp == 1:
            return ex.etp, ex.ep
        return ex.ep * ex.etp, ex.edp
    strides = {REP: mesh.tp * mesh.cp * mesh.dp_shard, SHARD: mesh.tp * mesh.cp, TP: 1, CP: mesh.tp}
    k = next((k for k in (REP, SHARD, TP) if mesh.shape[k] > 1), None)
    if k is None and mesh.cp > 1 and _cp_rings(mode):
        k = CP
    return (1, 1) if k is None else (strides[k], mesh.shape[k])
