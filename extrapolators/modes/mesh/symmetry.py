"""The symmetry of a mesh run (`symmetry: auto`): copies of a stage's GPUs that run the
same streams mapped by coordinates, so the runtime simulates one copy and moves the others'
bytes as images (extrapolators.execution.symmetry)."""

from __future__ import annotations

import math

from extrapolators.execution.symmetry import Symmetry
from extrapolators.modes.mesh.dims import REP, SHARD, TP


def mesh_symmetry(mode) -> Symmetry:
    """Copies of a stage's GPUs (numbered in the dense order, dims.Mesh.local) along every
    axis whose ranks run the same streams: the data-parallel dimensions (dp_replicate,
    dp_shard) and TP (its ranks run the same operators on their shards). Copy 0's GPUs
    (every stage of it) represent the others, mapped by moving the axes' coordinates
    (modulo each degree); a group along some of the axes (TP's, FSDP's) is a
    representative at the copies of those axes, its images the other cosets' groups
    (execution.symmetry). Where that breaks in the run (a network that treats the copies
    apart), the fallback is one axis (`one_axis`). With experts on the mesh: one axis only
    (`copy_axis`)."""
    if mode.experts is not None:
        return one_axis(mode)
    mesh = mode.mesh
    dims = [k for k in (REP, SHARD, TP) if mesh.shape[k] > 1]
    if len(dims) < 2:
        return one_axis(mode)
    sym = _along(mode, dims)
    sym.fallback = one_axis(mode)
    return sym


def _along(mode, dims: list) -> Symmetry:
    """Copies along the mesh dimensions `dims` (outermost first: the last is the fastest
    axis of a copy's index)."""
    mesh, at, layout = mode.mesh, mode.layout.at, mode.layout
    coord = layout.coord
    axes = [mesh.shape[k] for k in dims]
    first = sorted(x for x in at if all(x[k] == 0 for k in dims))

    def offsets(k: int) -> list:
        out = []
        for n in reversed(axes):
            k, d = divmod(k, n)
            out.append(d)
        return out[::-1]

    def moved(x, k):
        c = list(x)
        for dim, n, d in zip(dims, axes, offsets(k), strict=True):
            c[dim] = (c[dim] + d) % n
        return tuple(c)

    copies = math.prod(axes)
    replicas = [[at[moved(x, k)] for x in first] for k in range(copies)]

    def image_group(group, k):
        images = tuple(at[moved(coord[g], k)] for g in group)
        ring = layout.ring_order(group)
        return layout.ring_order(images) if tuple(group) == ring else images

    sym = Symmetry.of_replicas(replicas, image_group, axes)
    sym.sample = 2  # the streams come from shared stage templates (one_axis says more)
    return sym


def one_axis(mode) -> Symmetry:
    """Copies along one axis of a stage's GPUs (numbered in the dense order, dims.Mesh.
    local): the outer data-parallel dimension (dp_replicate, else dp_shard; without
    either, TP: its ranks run the same streams). With experts on the mesh: the EP rank
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
    strides = {REP: mesh.tp * mesh.cp * mesh.dp_shard, SHARD: mesh.tp * mesh.cp, TP: 1}
    k = next((k for k in (REP, SHARD, TP) if mesh.shape[k] > 1), None)
    return (1, 1) if k is None else (strides[k], mesh.shape[k])
