"""The Network interface: move bytes between GPUs inside a simpy.Environment.

A parallelism mode's tasks, through the runtime and the communication model, only call `transfer` / `transfer_group` and waits on the
returned events; it never knows which implementation it talks to. To add a network,
subclass `Network`, implement `_start_group`, and register it with `register`.
"""

from __future__ import annotations

import functools
import math

import networkx as nx
import numpy as np
import simpy

from networks import groups
from networks.groups import TransferRecord
from triosim.common import schema
from triosim.common.errors import NetworkError
from triosim.common.registry import Registry

_PLAIN = (int, float)  # sizes of these types need no further check than 0 <= n < inf
LINK_COLUMNS = ("src", "dst", "bandwidth", "latency", "bytes", "busy_time")


class Network:
    """Base class. Subclasses implement `_start_group(records, events)` and declare their
    config fields as an `Options` dataclass (triosim.common.schema); `self.options` holds them,
    given as an Options object or as keyword arguments (units allowed: "20 ms")."""

    kind = "abstract"
    Options = schema.NoOptions
    # True: a switch node with a `reduce` attribute (in-network reduction: NVLS, SHARP) may
    # be a transfer's source or destination, as collectives that reduce in the switch need
    reducing_endpoints = False

    def __init__(self, env: simpy.Environment, graph: nx.DiGraph, options=None, **kwargs):
        if isinstance(options, self.Options) and not kwargs:
            self.options = schema.check(options, "network")
        elif options is None:
            self.options = schema.load(
                self.Options, kwargs, "network", owner=f"network '{self.kind}'"
            )
        else:
            raise NetworkError(f"options must be a {self.Options.__name__} or keyword arguments")
        self.env = env
        self.graph = validate_graph(graph)
        self.gpus = gpu_nodes(self.graph)
        self._gpu_set = set(self.gpus)
        if self.reducing_endpoints:
            self._gpu_set |= set(reducing_switches(self.graph))
        # what was sent: TransferRecords, or group entries (networks.groups) that expand
        # into them when `records` or `transfers()` is asked for
        self._log: list = []
        self.bytes_sent = 0.0
        self.bytes_delivered = 0.0
        self.in_flight = 0

    # -- public API ----------------------------------------------------------------
    def transfer(self, src, dst, nbytes: float, tag: str = "") -> simpy.Event:
        """Start one transfer; the event fires (value: the TransferRecord) on delivery."""
        return self.transfer_group([(src, dst, nbytes)], tag=tag)[0]

    def transfer_all(self, transfers, tag: str = "") -> simpy.Event:
        """As `transfer_group`, but one event that fires (value: the records) once every
        transfer is delivered: what waiting on all of `transfer_group`'s events gives,
        without a SimPy event per transfer."""
        done = self.env.event()
        records: list[TransferRecord] = []
        if not transfers:
            done.succeed(records)
            return done
        member = _AllDelivered(done, records)
        self.transfer_group(transfers, tag=tag, _member=member)
        return done

    def transfer_all_then(self, transfers, then, tag: str = "") -> None:
        """`transfer_all`, its records handed to `then(records)` once every transfer is
        delivered: when its event is processed here; networks that can, at the instant the
        last one lands (no event between)."""
        self.transfer_all(transfers, tag=tag).callbacks.append(lambda e: then(e.value))

    def batch(self, transfers):
        """Transfers to start many times with `transfer_all` (a collective's streams):
        networks that can check and route them once return a prepared object; here, a
        list."""
        return list(transfers)

    def transfer_group(self, transfers, tag: str = "", _member=None) -> list[simpy.Event]:
        """Start many transfers at the same instant (one collective step).

        Each is (src, dst, nbytes) or (src, dst, nbytes, max_rate): a transfer never goes
        faster than max_rate bytes/s (what its sender can feed; networks that model no such
        limit ignore it). Implementations solve their bandwidth allocation once for the
        whole group.
        """
        srcs, dsts, sizes, caps = self._parse(transfers)
        now = self.env.now
        records = [
            TransferRecord(*t, now, tag=tag, max_rate=c)
            for t, c in zip(zip(srcs, dsts, sizes, strict=True), caps, strict=True)
        ]
        self._log += records
        for rec in records:  # one add per transfer, in order (what the counters promise)
            self.bytes_sent += rec.nbytes
        self.in_flight += len(records)
        if _member is not None:
            _member.records += records
            _member.pending = len(records)
            events = [_member] * len(records)
        else:
            events = [self.env.event() for _ in records]
        if records:
            self._start_group(records, events)
        return events

    def _parse(self, transfers):
        """(sources, destinations, sizes, rate caps) of (src, dst, nbytes[, max_rate])
        tuples, each checked."""
        srcs, dsts, sizes, caps = [], [], [], []
        gpus, inf = self._gpu_set, math.inf
        for t in transfers:
            if len(t) == 3:
                src, dst, nbytes = t
                rest = ()
            else:
                src, dst, nbytes, *rest = t
            # the common case checked inline; anything else gets the full check (and message)
            if not (src in gpus and dst in gpus and type(nbytes) in _PLAIN and 0 <= nbytes < inf):
                self._check(src, dst, nbytes)
            rate = float(rest[0]) if rest else inf
            if not rate > 0:
                raise NetworkError(f"transfer max_rate must be > 0 bytes/s, got {rest[0]!r}")
            srcs.append(src)
            dsts.append(dst)
            sizes.append(float(nbytes))
            caps.append(rate)
        return srcs, dsts, sizes, caps

    def ring(self, group, chunk: float, steps: int, tag: str = "") -> simpy.Event:
        """`steps` lock-step ring steps: in each, every group[i] sends `chunk` bytes to
        group[i+1] (cyclic) and the next step starts once all arrived. The event fires when
        the last step is done. Networks may compute it faster; this one starts the steps."""
        done = self.env.event()
        n = len(group)
        pairs = [(group[i], group[(i + 1) % n], chunk) for i in range(n)]
        left = [steps]

        def next_step(_e=None):  # started in the callback, as a process resuming there would
            if left[0] == 0:
                done.succeed()
                return
            left[0] -= 1
            self.transfer_all(pairs, tag=tag).callbacks.append(next_step)

        if n > 1:
            next_step()
        else:
            done.succeed()
        return done

    def _deliver(self, rec: TransferRecord, event: simpy.Event) -> None:
        rec.end = self.env.now
        self.bytes_delivered += rec.nbytes
        self.in_flight -= 1
        event.succeed(rec)

    # -- statistics ----------------------------------------------------------------
    def link_stats(self):
        """A DataFrame with LINK_COLUMNS: one row per link (direction), bytes carried and the
        time it carried any. Every network returns these columns, so results compare."""
        import pandas as pd

        return pd.DataFrame(columns=list(LINK_COLUMNS))

    def stats(self) -> dict:
        """Counters worth reporting (set-ups, reallocations, ...): plain numbers."""
        return {}

    @property
    def records(self) -> list[TransferRecord]:
        """Every transfer started so far, in order of start (expanded from group entries)."""
        return groups.expand_records(self._log)

    def transfers(self):
        """One row per transfer, in order of start: src, dst, nbytes, start, end, tag."""
        return groups.transfer_table(self._log)

    def transfers_later(self):
        """A callable that builds `transfers()` of the transfers started so far when called
        (a finished run's table built only if someone asks for it)."""
        return functools.partial(groups.transfer_table, list(self._log))

    # -- to implement -----------------------------------------------------------------
    def _start_group(self, records: list[TransferRecord], events: list[simpy.Event]) -> None:
        raise NotImplementedError

    def _check(self, src, dst, nbytes) -> None:
        for who, node in (("source", src), ("destination", dst)):
            if node not in self._gpu_set:
                raise NetworkError(
                    f"transfer {who} {node!r} is not a GPU of this topology "
                    f"(GPUs: {_short(self.gpus)})"
                )
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)):
            raise NetworkError(f"transfer size must be a number of bytes, got {nbytes!r}")
        if not (nbytes >= 0) or math.isinf(nbytes):
            raise NetworkError(f"transfer size must be finite and >= 0 bytes, got {nbytes!r}")


class _AllDelivered:
    """Stands in for every transfer's event in `transfer_all`: a network delivers a
    transfer by calling `succeed`; the last one fires the group's event."""

    __slots__ = ("done", "records", "pending")

    def __init__(self, done: simpy.Event, records: list):
        self.done, self.records, self.pending = done, records, 0

    def succeed(self, _value=None):
        self.pending -= 1
        if self.pending == 0:
            self.done.succeed(self.records)


def _short(items, n=8) -> str:
    items = list(items)
    s = ", ".join(map(repr, items[:n]))
    return s + (f", ... ({len(items)} in all)" if len(items) > n else "")


def gpu_nodes(graph: nx.DiGraph) -> list:
    """GPUs are nodes with kind='gpu' (the builders set it); default: every node."""
    gpus = [n for n, d in graph.nodes(data=True) if d.get("kind", "gpu") == "gpu"]
    return sorted(gpus, key=lambda n: (str(type(n)), n))


def reducing_switches(graph) -> dict:
    """Switch nodes that reduce data in flight: name -> 'nvls' (NVSwitch3 NVLink SHARP) or
    'sharp' (InfiniBand SHARP), from the node attribute `reduce`."""
    return {
        n: d["reduce"]
        for n, d in graph.nodes(data=True)
        if d.get("kind") == "switch" and d.get("reduce")
    }


def validate_graph(graph) -> nx.DiGraph:
    """Check a topology: non-empty, positive bandwidth, non-negative latency, GPUs connected."""
    if not isinstance(graph, nx.Graph):
        raise NetworkError(f"topology must be a networkx graph, got {type(graph).__name__}")
    if not graph.is_directed():
        graph = graph.to_directed()
    gpus = gpu_nodes(graph)
    if not gpus:
        raise NetworkError("topology has no GPUs (it is empty or no node has kind='gpu')")
    data = [d for *_, d in graph.edges(data=True)]
    bws = [d.get("bandwidth") for d in data]
    lats = [d.get("latency", 0.0) for d in data]
    # the common case in a few array passes (262,144 links at 131,072 GPUs); anything else
    # link by link, for the message naming the first bad one
    plain = {float, int}
    ok = set(map(type, bws)) <= plain and set(map(type, lats)) <= plain
    if ok and data:
        b, la = np.array(bws, float), np.array(lats, float)
        ok = bool((b > 0).all() and (la >= 0).all() and (la < math.inf).all())
    if not ok:
        for u, v, d in graph.edges(data=True):
            bw, lat = d.get("bandwidth"), d.get("latency", 0.0)
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
                raise NetworkError(f"link {u!r}->{v!r}: bandwidth must be > 0 bytes/s, got {bw!r}")
            if (
                isinstance(lat, bool)
                or not isinstance(lat, (int, float))
                or not (0 <= lat < math.inf)
            ):
                raise NetworkError(
                    f"link {u!r}->{v!r}: latency must be finite and >= 0 s, got {lat!r}"
                )
    if len(gpus) > 1:
        # weak connectivity here; a one-way graph may still lack a path for some pair,
        # which routing reports when such a transfer is asked for
        reach = _weak_component(graph, gpus[0])
        cut = [g for g in gpus if g not in reach]
        if cut:
            raise NetworkError(
                f"topology is disconnected: GPU(s) {_short(cut)} cannot exchange data with "
                f"GPU {gpus[0]!r}"
            )
    return graph


def _weak_component(graph, node) -> set:
    """The nodes joined to `node` ignoring the links' directions (scipy's components:
    networkx's walk in Python took a second at 131,072 GPUs)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    nodes = list(graph.nodes)
    index = {x: i for i, x in enumerate(nodes)}
    edges = list(graph.edges())
    u = np.fromiter((index[a] for a, _ in edges), np.int64, count=len(edges))
    v = np.fromiter((index[b] for _, b in edges), np.int64, count=len(edges))
    adj = csr_matrix((np.ones(len(edges)), (u, v)), shape=(len(nodes), len(nodes)))
    labels = connected_components(adj, directed=True, connection="weak")[1]
    mine = labels[index[node]]
    return {x for x, lab in zip(nodes, labels.tolist(), strict=True) if lab == mine}


NETWORKS = Registry("network.kind", "kind", "network")
register = NETWORKS.register
network_class = NETWORKS.get
