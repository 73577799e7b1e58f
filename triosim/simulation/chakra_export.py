"""A run's per-GPU workload as MLCommons Chakra execution traces, one file per rank (what
ASTRA-sim reads): `export_chakra(config, out)`, `triosim export-chakra CONFIG --out DIR`.

Every task each GPU's streams run in one iteration becomes a node of its rank's file:
computes as COMP_NODEs (duration_micros, and the exact seconds in `triosim.duration`),
collectives as COMM_COLL_NODEs (comm_type, comm_size, pg_name; members in comm_group.json),
sends and receives as COMM_SEND/RECV_NODEs (comm_src, comm_dst, comm_tag, comm_size). A
stream's order is its nodes' ctrl_deps (each on the one before); a Signal and a Wait between
streams are zero-time CPU nodes, the Wait's data_deps naming the Signal. Node ids follow a
topological order, so every dependency is on an earlier node. The `triosim.*` attributes
(stream, exact sizes, meeting keys, layers) let `parallelism: {mode: chakra}` bring the
workload back task for task; other readers ignore them.

The output folder is checked first, as `triosim simulate --out` checks its own: a file, a
folder holding files (without --force), a folder that cannot be written, or a file to write
that is one of the run's inputs or a folder is an InputError before anything is simulated.
The run is simulated next (a workload that does not finish is not written), then every file
is written beside its name and renamed into place only once all are ready: a failure leaves
the folder as it was (files an earlier export left there are moved back). With --force the
files an earlier export wrote there (the folder's manifest, triosim.common.outputs) and that
this one does not write again are removed once it is written, never anything else.
"""

from __future__ import annotations

import heapq
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from extrapolators.execution.tasks import (
    Collective,
    Compute,
    ComputeRun,
    Recv,
    Send,
    Signal,
    Wait,
)
from triosim.common.errors import ConfigError, InputError
from triosim.common.outputs import (
    MANIFEST,
    note_written,
    partial_name,
    same_file,
    writable_folder,
    written_before,
)
from triosim.simulation.wiring import Simulation
from triosim.trace import chakra as et


@dataclass
class Exported:
    """What `export_chakra` wrote and the run it came from."""

    folder: Path
    files: list  # the rank files, rank order, then comm_group.json
    nodes: list  # node count per rank
    result: object  # the Result of the simulated run
    removed: list = field(default_factory=list)  # an earlier export's files --force removed

    @property
    def prefix(self) -> Path:
        """What ASTRA-sim's --workload-configuration takes (it appends .<rank>.et)."""
        return self.files[0].parent / self.files[0].name.rsplit(".", 2)[0]


def export_chakra(
    config,
    out,
    *,
    trace=None,
    topology=None,
    prefix: str = "workload",
    force: bool = False,
    inputs=(),
) -> Exported:
    """Simulate `config` (a Config, a dict or a YAML path, as for Simulation) and write its
    workload to the folder `out` as `<prefix>.<rank>.et` and comm_group.json. `inputs`:
    files the run read (the config file), never written over nor removed."""
    out = Path(out)
    _check_folder(out, force)
    sim = Simulation(config, trace=trace, topology=topology)
    if sim.extrapolator.owns_iterations:
        raise ConfigError(
            "parallelism.mode",
            sim.config.parallelism.mode,
            "a mode whose iterations the runtime drives (this one waits for k of n events, "
            "which Chakra's dependencies cannot say)",
        )
    if not prefix.strip() or "/" in prefix or "\\" in prefix or prefix in (".", ".."):
        raise InputError(f"Chakra file prefix {prefix!r}: give a plain name (not a folder's)")
    names = [f"{prefix}.{r}.et" for r in range(len(sim.gpus))] + [et.GROUPS_FILE]
    earlier = [n for n in written_before(out, KIND) if n not in names] if force else []
    _check_targets(out, names, earlier, [*inputs, *_inputs(sim)])
    writable_folder(out, "--out")
    ranks, groups = workload_nodes(sim)
    result = sim.run()
    payloads = [et.encode_stream(meta, nodes) for meta, nodes in ranks]
    groups_text = json.dumps({k: list(v) for k, v in groups.items()}, indent=1) + "\n"
    files = [out / n for n in names]
    _write_all(files, [*payloads, groups_text.encode()])
    removed = _remove_earlier(out, names) if force else []
    note_written(out, names, KIND)
    return Exported(out, files, [len(nodes) for _, nodes in ranks], result, removed=removed)


KIND = "chakra"  # the manifest's kind of folder (triosim.common.outputs)


def _remove_earlier(out: Path, names) -> list:
    """--force, once the new files are in place: the files an earlier export wrote there
    that this one did not write again (a larger run's ranks, another prefix), and no other;
    the manifest then lists this export's files only."""
    earlier = written_before(out, KIND)
    if not earlier:
        return []
    stale = [n for n in earlier if n not in names]
    removed = [n for n in stale if (out / n).is_file() or (out / n).is_symlink()]
    for n in removed:
        (out / n).unlink()
    (out / MANIFEST).unlink(missing_ok=True)
    return removed


def _check_folder(out: Path, force: bool) -> None:
    """Before any work, as `simulate --out` does: a folder (or none yet), empty unless
    --force."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; name a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InputError(
            f"--out {out} already holds files; pass --force to overwrite them (only the "
            "files an export wrote there are removed), or name another folder"
        )


def _inputs(sim) -> list:
    """The files the run read (triosim.config.inputs: the trace, a Chakra workload's files,
    every path option)."""
    from triosim.config.inputs import input_files

    return input_files(sim.config)


def _check_targets(out: Path, names, earlier, inputs) -> None:
    """Every file to write, and every earlier file --force removes, checked before the run:
    none is an input of the run or a folder."""
    for n in [*names, *earlier]:
        f = out / n
        for i in inputs:
            if i is not None and same_file(f, i):
                raise InputError(
                    f"--out {out}: its {n} is an input of this run ({i}); name another "
                    "folder (an input is never overwritten, not even with --force)"
                )
        if f.is_dir() and not f.is_symlink():
            raise InputError(f"--out {out}: {n} is a folder, where the export writes a file")


def _write_all(files, payloads) -> None:
    """Every file whole or none: each written beside its name; the files already there moved
    aside, all renamed into place, and those moved aside removed. A failure at any step puts
    the folder back as it was; an OS error is an InputError naming the file."""
    tmps = [partial_name(f) for f in files]
    asides = [f.with_name(f".{f.name}.earlier-{os.getpid()}") for f in files]
    moved, placed = [], []
    step = None
    try:
        for tmp, data in zip(tmps, payloads, strict=True):
            step = tmp
            tmp.write_bytes(data)
        for f, aside in zip(files, asides, strict=True):
            if f.exists() or f.is_symlink():
                step = f
                os.replace(f, aside)
                moved.append((f, aside))
        for tmp, f in zip(tmps, files, strict=True):
            step = f
            os.replace(tmp, f)
            placed.append(f)
    except BaseException as e:
        for f in placed:
            f.unlink(missing_ok=True)
        for f, aside in moved:
            os.replace(aside, f)
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise InputError(
                f"--out {files[0].parent}: cannot write {Path(step).name} "
                f"({e.strerror or e}); nothing was written"
            ) from None
        raise
    for _, aside in moved:
        aside.unlink(missing_ok=True)


def _expanded(tasks, scale: float):
    """The stream's tasks, ComputeRuns as their computes, durations as the runtime runs
    them on this GPU (times its compute factor)."""
    for t in tasks:
        if type(t) is ComputeRun:
            yield from (_scaled(c, scale) for c in t.tasks)
        elif type(t) is Compute:
            yield _scaled(t, scale)
        else:
            yield t


def _scaled(c: Compute, scale: float) -> Compute:
    if scale == 1.0 or not c.duration:
        return c
    return Compute(c.name, c.layer, c.phase, c.duration * scale, c.op_id, c.mb)


def workload_nodes(sim: Simulation) -> tuple[list, dict]:
    """([(metadata, nodes)] by rank, {pg_name: ranks}) of one iteration of `sim`'s plan."""
    ex, mode = sim.extrapolator, sim.config.parallelism.mode
    het = sim.config.heterogeneity
    for name in ("op_cv", "link_cv"):
        if getattr(het, name):
            raise ConfigError(
                f"heterogeneity.{name}",
                getattr(het, name),
                "0 to export: a workload carries one iteration's fixed times and a topology "
                "its rated links, not the draws (simulate each draw instead)",
            )
    mesh = getattr(ex, "mesh", None)
    if mesh is not None and mesh.cp > 1 and ex.options.cp_comm == "p2p":
        raise ConfigError(
            "parallelism.cp_comm",
            "p2p",
            "a2a to export (Ulysses' all-to-alls): ring attention's sends each wait for both "
            "GPUs to reach the step, a dependency across ranks that Chakra's nodes cannot say",
        )
    gpus = list(sim.gpus)
    rank = {g: r for r, g in enumerate(gpus)}
    streams: dict = {}  # gpu -> {stream: [tasks]}
    for (g, s), tasks in sim.extrapolator.streams().items():
        scale = sim.compute_slowdown.get(g, 1.0)
        streams.setdefault(g, {})[s] = list(_expanded(tasks, scale))
    sent: dict = {}  # key -> bytes of the send
    tags: dict = {}  # key -> comm_tag
    for by_stream in streams.values():
        for tasks in by_stream.values():
            for t in tasks:
                if type(t) is Send:
                    sent[t.key] = t.nbytes
                    tags.setdefault(t.key, len(tags))
    groups: dict = {}  # tuple of ranks -> pg_name
    out = []
    for g in gpus:
        nodes = _rank_nodes(g, rank, streams.get(g, {}), sent, tags, groups, mode)
        meta = {"triosim.rank": rank[g], "triosim.ranks": len(gpus), et.A_NODES: len(nodes)}
        out.append((meta, nodes))
    return out, {name: grp for grp, name in groups.items()}


def _rank_nodes(g, rank, by_stream: dict, sent, tags, groups, mode: str) -> list:
    r = rank[g]
    nodes: list = []  # in stream order, ids = positions (renumbered below)
    signals: dict = {}  # key -> node position
    waits: list = []  # (position, key)
    for s, tasks in by_stream.items():
        prev = None
        for t in tasks:
            nd = _node(t, r, rank, sent, tags, groups)
            nd.attrs[et.A_STREAM] = s
            nd.id = len(nodes)
            if prev is not None:
                nd.ctrl_deps = [prev]
            if type(t) is Signal:
                signals[t.key] = nd.id
            elif type(t) is Wait:
                waits.append((nd.id, t.key))
            nodes.append(nd)
            prev = nd.id
    for pos, key in waits:
        if key not in signals:
            raise ConfigError(
                "parallelism.mode",
                mode,
                f"a workload whose GPUs wait only on their own streams: GPU {g} waits for "
                f"{key!r}, which none of its streams signals",
            )
        nodes[pos].data_deps = [signals[key]]
    return _renumbered(nodes)


def _node(t, r, rank, sent, tags, groups) -> et.Node:
    T = type(t)
    if T is Compute:
        a = {
            "is_cpu_op": False,
            et.A_DURATION: float(t.duration),
            et.A_LAYER: t.layer,
            et.A_PHASE: t.phase,
            et.A_MB: int(t.mb),
        }
        if t.op_id is not None:
            a[et.A_OP_ID] = int(t.op_id)
        return et.Node(0, t.name, et.COMP_NODE, duration_micros=_micros(t.duration), attrs=a)
    if T is Collective:
        if t.op not in et.OP_TO_COMM:
            raise ConfigError(
                "parallelism.mode",
                "",
                f"collectives Chakra has a type for; {t.op} {t.key!r} has none",
            )
        members = tuple(rank[m] for m in t.group)
        pg = groups.setdefault(members, str(len(groups) + 1))
        a = {
            "is_cpu_op": False,
            "comm_type": et.OP_TO_COMM[t.op],
            "comm_size": et.comm_size(t.op, t.nbytes, len(members)),
            "pg_name": pg,
            et.A_OP: t.op,
            et.A_NBYTES: float(t.nbytes),
            et.A_KEY: t.key,
            et.A_LAYER: t.layer,
            et.A_PHASE: t.phase,
        }
        if t.algorithm:
            a[et.A_ALGORITHM] = t.algorithm
        if t.root is not None:
            a[et.A_ROOT] = rank[t.root]
        if t.sizes is not None:
            a[et.A_SIZES] = [float(x) for row in t.sizes for x in row]
        return et.Node(0, f"{t.op} {t.key}", et.COMM_COLL_NODE, attrs=a)
    if T is Send or T is Recv:
        if T is Send:
            src, dst, nbytes = r, rank[t.dst], t.nbytes
        else:
            src, dst, nbytes = rank[t.src], r, sent.get(t.key)
            if nbytes is None:
                raise ConfigError(
                    "parallelism.mode", "", f"a send for every receive; {t.key!r} has none"
                )
        a = {
            "is_cpu_op": False,
            "comm_src": src,
            "comm_dst": dst,
            "comm_tag": tags[t.key] % 2**31,
            "comm_size": round(nbytes),
            et.A_NBYTES: float(nbytes),
            et.A_KEY: t.key,
            et.A_LAYER: t.layer,
            et.A_PHASE: t.phase,
        }
        kind = et.COMM_SEND_NODE if T is Send else et.COMM_RECV_NODE
        what = f"send to {dst}" if T is Send else f"recv from {src}"
        return et.Node(0, f"{what} {t.key}", kind, attrs=a)
    if T is Signal or T is Wait:
        attr = et.A_SIGNAL if T is Signal else et.A_WAIT
        name = f"{'signal' if T is Signal else 'wait'} {t.key}"
        return et.Node(0, name, et.COMP_NODE, attrs={"is_cpu_op": True, attr: t.key})
    raise ConfigError(
        "parallelism.mode",
        "",
        f"tasks Chakra can hold (compute, collective, send, receive, signal, wait); "
        f"{type(t).__name__} has no Chakra node",
    )


def _micros(seconds: float) -> int:
    return max(0, round(seconds * 1e6))


def _renumbered(nodes: list) -> list:
    """The nodes in a topological order (ties: stream order), ids their positions."""
    waiting = [len(n.deps) for n in nodes]
    children: dict = {}
    for n in nodes:
        for d in n.deps:
            children.setdefault(d, []).append(n.id)
    ready = [i for i, k in enumerate(waiting) if k == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for c in children.get(i, ()):
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(ready, c)
    if len(order) != len(nodes):  # the run finished, so its waits cannot form a cycle
        raise AssertionError("the exported dependencies form a cycle")
    new = {old: k for k, old in enumerate(order)}
    out = []
    for old in order:
        n = nodes[old]
        n.id = new[old]
        n.ctrl_deps = [new[d] for d in n.ctrl_deps]
        n.data_deps = [new[d] for d in n.data_deps]
        out.append(n)
    return out
