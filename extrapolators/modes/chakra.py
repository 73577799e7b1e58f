"""`parallelism: {mode: chakra, path: DIR}`: a workload of MLCommons Chakra execution traces
(one file per rank, as ASTRA-sim reads them) run on triosim's networks and communication model.

Each rank's nodes become the task streams of the GPU of that rank (rank r: the topology's r-th
GPU). The nodes are taken in a topological order of their dependencies (ties in file order);
each node runs on a stream:

* written by `triosim export-chakra`: the stream it ran on (its `triosim.stream`), with its
  exact duration, byte count and meeting key, so that the run comes back task for task;
* otherwise as ASTRA-sim schedules a rank (one compute, one communication at a time, receives
  apart): compute nodes on `compute` (`cpu` for `is_cpu_op`), collectives and sends on
  `comm`, each receive and each metadata node on a stream of its own. A dependency on a node
  of another stream is a Signal after that node and a Wait before this one.

Collectives meet by communicator group (`pg_name`, members from comm_group.json) and order:
the k-th collective of a group on every member is one collective; sends and receives by
(source, destination, tag) and order. Durations are `duration_micros` (ASTRA-sim's replay);
triosim's performance model is not asked (the workload carries no operators). Bad input is
a TraceError naming the file and node, or a ConfigError on `parallelism.path`.
"""

from __future__ import annotations

from dataclasses import dataclass

from extrapolators.execution.tasks import (
    Collective,
    Compute,
    ComputeRun,
    Recv,
    Send,
    Signal,
    Wait,
)
from extrapolators.modes.base import Extrapolator
from triosim.common.errors import ConfigError, TraceError
from triosim.common.schema import option
from triosim.trace import chakra as et


@dataclass(frozen=True)
class ChakraOptions:
    path: str = option(
        "",
        path=True,
        help="folder of Chakra ET files <prefix>.<rank>.et (or their path prefix), "
        "with comm_group.json for communicator groups",
    )


class ChakraWorkload(Extrapolator):
    """The tasks of a Chakra workload; the trace and the performance model are not used."""

    name = "chakra"
    uses_trace = False  # durations come from the workload; a config may omit `trace`
    Options = ChakraOptions

    def check(self) -> None:
        if not self.options.path:
            raise ConfigError(et.FIELD, "", "the folder of a Chakra workload")
        if self.batch_size is not None:
            raise ConfigError(
                "batch_size",
                self.batch_size,
                "none in mode chakra: the workload's durations are fixed at the batch it was "
                "made with (export it again at another batch size instead)",
            )
        self.workload = et.load_workload(self.options.path)
        n = self.workload.num_ranks
        if n != len(self.gpus):
            where = f"{self.workload.folder / self.workload.prefix}.<rank>.et"
            raise ConfigError(
                "num_gpus",
                len(self.gpus),
                f"the Chakra workload's number of ranks: the folder holds ranks 0-{n - 1} "
                f"({where}); num_gpus is {len(self.gpus)}"
                + (": an earlier export's files?" if n > len(self.gpus) else ""),
            )
        self._streams = workload_streams(self.workload, self.gpus)

    def streams(self) -> dict:
        return {who: iter(tasks) for who, tasks in self._streams.items()}

    # the workload holds no model state: nothing for the memory model
    def held_weight_bytes(self, gpu) -> float:
        return 0.0

    def activation_ratio(self, op) -> float:
        return 0.0


# -- nodes to tasks ----------------------------------------------------------------------------


def _stream_of(node: et.Node, rf) -> str:
    s = node.attrs.get(et.A_STREAM)
    if s:
        return str(s)
    t = node.type
    if t == et.COMP_NODE:
        return "cpu" if node.attrs.get("is_cpu_op") else "compute"
    if t in (et.COMM_COLL_NODE, et.COMM_SEND_NODE):
        return "comm"
    if t in (et.COMM_RECV_NODE, et.METADATA_NODE, et.INVALID_NODE):
        return f"{et.NODE_TYPES[t].lower()} {node.id}"
    raise TraceError(
        f"node {node.id} ({node.kind()}): remote-memory nodes are not simulated by triosim",
        rf.path,
        field="type",
    )


def _marker(node: et.Node):
    """('signal' | 'wait', key) of a node triosim wrote for a Signal or a Wait (a zero-time
    CPU compute node to other readers)."""
    for kind, attr in (("signal", et.A_SIGNAL), ("wait", et.A_WAIT)):
        if node.attrs.get(attr):
            return kind, str(node.attrs[attr])
    return None


def _int(node, name, rf, lo=None, hi=None) -> int:
    v = node.attrs.get(name)
    if type(v) is not int or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" in {lo}..{hi}" if lo is not None and hi is not None else ""
        raise TraceError(
            f"node {node.id} ({node.kind()}): {name} must be an integer{rng}, got {v!r}",
            rf.path,
            field=name,
        )
    return v


def workload_streams(wl: et.Workload, gpus) -> dict:
    """{(gpu, stream): [tasks]} of every rank, collectives and point-to-point pairs checked
    across ranks (members agree on op, size and group; every send has its receive)."""
    gpus = list(gpus)
    n = wl.num_ranks
    out: dict = {}
    colls: dict = {}  # key -> {rank: (op, nbytes, group, where)}
    sends: dict = {}  # key -> (size, where)
    recvs: dict = {}
    for rf in wl.ranks:
        r = rf.rank
        order = et.topological_order(rf)
        by_id = {nd.id: nd for nd in rf.nodes}
        stream = {nd.id: _stream_of(nd, rf) for nd in order}
        # dependencies across streams: a Signal after the node, a Wait before its dependant
        # (a triosim Wait marker's on its Signal marker meet by their own key)
        signal_after: dict = {}
        waits: dict = {}
        for nd in order:
            mk = _marker(nd)
            for d in nd.deps:
                if stream[d] == stream[nd.id]:
                    continue
                dm = _marker(by_id[d])
                if mk is not None and mk[0] == "wait" and dm == ("signal", mk[1]):
                    continue
                key = f"chakra:{r}:{d}"
                signal_after[d] = key
                waits.setdefault(nd.id, []).append(key)
        seq: dict = {}  # counters for generated meeting keys
        tasks: dict = {}
        for nd in order:
            s = stream[nd.id]
            mine = tasks.setdefault(s, [])
            mine.extend(Wait(k) for k in waits.get(nd.id, ()))
            task = _task(nd, rf, wl, gpus, seq, colls, sends, recvs)
            if task is not None:
                mine.append(task)
            if nd.id in signal_after:
                mine.append(Signal(signal_after[nd.id]))
        for s, ts in tasks.items():
            out[(gpus[r], s)] = _runs(ts)
    _check_meetings(colls, sends, recvs, n)
    return out


def _task(nd: et.Node, rf, wl, gpus, seq, colls, sends, recvs):
    r, a, n = rf.rank, nd.attrs, wl.num_ranks
    where = (rf.path, nd.id)
    layer, phase = str(a.get(et.A_LAYER, "")), str(a.get(et.A_PHASE, ""))
    t = nd.type
    mk = _marker(nd)
    if mk is not None:
        return Signal(mk[1]) if mk[0] == "signal" else Wait(mk[1])
    if t == et.COMP_NODE:
        d = a.get(et.A_DURATION)
        duration = float(d) if d is not None else nd.duration_micros * 1e-6
        if not duration >= 0:
            raise TraceError(f"node {nd.id}: duration {duration!r}", rf.path, field=et.A_DURATION)
        op_id = a.get(et.A_OP_ID)
        return Compute(nd.name, layer, phase, duration, op_id, int(a.get(et.A_MB, 0)))
    if t == et.COMM_COLL_NODE:
        ct = _int(nd, "comm_type", rf)
        op = a.get(et.A_OP) or et.COMM_TO_OP.get(ct)
        if op is None:
            raise TraceError(
                f"node {nd.id}: collective {et.COMM_TYPES.get(ct, ct)} is not simulated by "
                f"triosim (it runs {', '.join(sorted(set(et.COMM_TO_OP.values())))})",
                rf.path,
                field="comm_type",
            )
        group = wl.group(rf, nd)
        size = _int(nd, "comm_size", rf, lo=0)
        nb = a.get(et.A_NBYTES)
        nbytes = float(nb) if nb is not None else et.nbytes_of(op, size, len(group))
        key = a.get(et.A_KEY)
        if not key:
            k = seq[("coll", group)] = seq.get(("coll", group), -1) + 1
            key = f"chakra:{a.get('pg_name') or 'all'}:{k}"
        root = a.get(et.A_ROOT)
        if root is None and op in ("broadcast", "reduce"):
            root = group[0]
        sizes = _sizes(a.get(et.A_SIZES), len(group), nd, rf)
        # the members agree on the bytes, or on the per-pair table of an uneven all-to-all
        colls.setdefault(key, {})[r] = (op, nbytes if sizes is None else sizes, group, where)
        return Collective(
            op,
            tuple(gpus[g] for g in group),
            nbytes,
            key,
            layer,
            phase,
            a.get(et.A_ALGORITHM) or None,
            None if root is None else gpus[root],
            sizes=sizes,
        )
    if t in (et.COMM_SEND_NODE, et.COMM_RECV_NODE):
        send = t == et.COMM_SEND_NODE
        me, peer = ("comm_src", "comm_dst") if send else ("comm_dst", "comm_src")
        other = _int(nd, peer, rf, 0, n - 1)
        if me in a and _int(nd, me, rf) != r:
            raise TraceError(
                f"node {nd.id}: {me} is {a[me]}, but the node is in rank {r}'s file",
                rf.path,
                field=me,
            )
        if other == r:
            raise TraceError(f"node {nd.id}: {peer} is its own rank {r}", rf.path, field=peer)
        size = _int(nd, "comm_size", rf, lo=0)
        nb = a.get(et.A_NBYTES)
        nbytes = float(nb) if nb is not None else float(size)
        src, dst = (r, other) if send else (other, r)
        key = a.get(et.A_KEY)
        if not key:
            tag = a.get("comm_tag", 0)
            k = seq[(src, dst, tag, send)] = seq.get((src, dst, tag, send), -1) + 1
            key = f"chakra:p2p:{src}>{dst}:tag{tag}:{k}"
        book = sends if send else recvs
        if key in book:
            raise TraceError(
                f"node {nd.id}: a second {'send' if send else 'receive'} {key!r}", rf.path
            )
        book[key] = (nbytes, src, dst, where)
        if send:
            return Send(gpus[dst], nbytes, key, layer, phase)
        return Recv(gpus[src], key, layer, phase)
    return None  # metadata and invalid nodes: no work (their dependencies still hold)


def _runs(tasks: list) -> list:
    """Consecutive computes as one ComputeRun (the runtime's fast path; the same times)."""
    out, run = [], []
    for t in tasks:
        if type(t) is Compute:
            run.append(t)
            continue
        if run:
            out.append(ComputeRun(run) if len(run) > 1 else run[0])
            run = []
        out.append(t)
    if run:
        out.append(ComputeRun(run) if len(run) > 1 else run[0])
    return out


def _sizes(flat, n: int, nd, rf):
    """An uneven all-to-all's per-pair bytes (et.A_SIZES) as an n x n table, or None."""
    if flat is None:
        return None
    if not isinstance(flat, list) or len(flat) != n * n:
        raise TraceError(
            f"node {nd.id}: {et.A_SIZES} holds {len(flat) if isinstance(flat, list) else flat!r}"
            f" values; its group of {n} needs {n * n} (bytes per pair, row-major)",
            rf.path,
            field=et.A_SIZES,
        )
    return tuple(tuple(float(x) for x in flat[i * n : (i + 1) * n]) for i in range(n))


def _check_meetings(colls: dict, sends: dict, recvs: dict, n: int) -> None:
    for key, posts in colls.items():
        first_rank = min(posts)
        op, nbytes, group, (path, node) = posts[first_rank]
        for op2, nb2, group2, (path2, node2) in posts.values():
            if (op2, group2) != (op, group) or nb2 != nbytes:
                raise ConfigError(
                    et.FIELD,
                    str(path2.parent),
                    f"members of a collective to agree: collective {key!r} is {op} of "
                    f"{_exact(nbytes)} bytes over ranks {list(group)} in {path.name} (node {node}) "
                    f"but {op2} of {_exact(nb2)} bytes over ranks {list(group2)} in {path2.name} "
                    f"(node {node2})",
                )
        if set(posts) != set(group):
            missing = sorted(set(group) - set(posts))
            extra = sorted(set(posts) - set(group))
            raise ConfigError(
                et.FIELD,
                str(path.parent),
                f"every member of collective {key!r} ({op} over ranks {list(group)}, "
                f"{path.name} node {node}) to post it: "
                + (f"rank(s) {missing} do not" if missing else "")
                + ("; " if missing and extra else "")
                + (f"rank(s) {extra} post it outside the group" if extra else ""),
            )
    for key, (nb, src, dst, (path, node)) in sends.items():
        got = recvs.get(key)
        if got is None:
            raise ConfigError(
                et.FIELD,
                str(path.parent),
                f"a receive for every send: rank {src}'s send {key!r} ({path.name} node {node}) "
                f"has no receive on rank {dst}",
            )
        if got[0] != nb:
            raise ConfigError(
                et.FIELD,
                str(path.parent),
                f"a send and its receive to agree: {key!r} sends {_exact(nb)} bytes "
                f"({path.name} node {node}), receives {_exact(got[0])} ({got[3][0].name} node "
                f"{got[3][1]})",
            )
    for key, (_nb, src, dst, (path, node)) in recvs.items():
        if key not in sends:
            raise ConfigError(
                et.FIELD,
                str(path.parent),
                f"a send for every receive: rank {dst}'s receive {key!r} ({path.name} node "
                f"{node}) has no send from rank {src}",
            )


def _exact(nbytes: float) -> str:
    """A byte count as it is: 1048576, not 1.04858e+06 (and 0.5 where it has a fraction);
    an uneven all-to-all's table as its rows' sums."""
    if isinstance(nbytes, tuple):
        return "per-pair (rows " + ", ".join(_exact(sum(row)) for row in nbytes) + ")"
    return str(int(nbytes)) if float(nbytes).is_integer() else repr(float(nbytes))
