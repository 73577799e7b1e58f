"""Photonic circuit-switched network (the paper's wafer-scale case study, with what it lacked).

A transfer needs a circuit between sender and receiver. Setting one up costs
`setup_time`; each GPU has `ports` optical ports and a circuit holds one at each end.
When a GPU has no free port, its circuit idle the longest is torn down (LRU); when
every circuit is busy, the transfer waits for one to go idle. The sender then waits
for buffer space at the receiver, and the bytes cross the circuit one transfer at a
time per direction in bytes / circuit_bandwidth + latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import simpy

from networks.base import Network, register
from triosim.common.errors import ConfigError
from triosim.common.schema import option


@dataclass
class _Circuit:
    ends: tuple
    ready: simpy.Event
    lanes: dict = field(default_factory=dict)  # direction -> simpy.Resource(1)
    users: int = 0
    last_used: float = 0.0


@dataclass(frozen=True)
class PhotonicOptions:
    total_bandwidth: float = option(
        484e9, unit="bandwidth", gt=0, help="optical bandwidth per GPU, shared by its links"
    )
    links: int = option(8, ge=1, help="circuits per GPU; each gets total_bandwidth / links")
    ports: int | None = option(None, ge=1, help="optical ports per GPU (default: links)")
    setup_time: float = option(
        20e-3, unit="seconds", ge=0, lt=math.inf, help="time to set up a circuit"
    )
    latency: float = option(
        0.0, unit="seconds", ge=0, lt=math.inf, help="propagation latency of a transfer"
    )
    buffer_bytes: float = option(
        math.inf, unit="bytes", gt=0, help="receiver buffer; a transfer must fit in it"
    )


@register("photonic")
class PhotonicNetwork(Network):
    Options = PhotonicOptions

    def __init__(self, env, graph, options=None, **kwargs):
        super().__init__(env, graph, options, **kwargs)
        o = self.options
        self.circuit_bandwidth = o.total_bandwidth / o.links
        self.ports = o.links if o.ports is None else o.ports
        self.setup_time = o.setup_time
        self.latency = o.latency
        self.buffer_bytes = o.buffer_bytes
        self.circuits: dict[frozenset, _Circuit] = {}
        self._ports_used = {g: 0 for g in self.gpus}
        self._buffers = {}
        self._idle = env.event()
        self.setups = 0
        self.teardowns = 0
        self.link_bytes: dict[tuple, float] = {}
        self.link_busy: dict[tuple, float] = {}

    def _start_group(self, records, events):
        for rec, ev in zip(records, events, strict=True):
            self.env.process(self._send(rec, ev))

    def _send(self, rec, ev):
        if rec.src == rec.dst:
            self._deliver(rec, ev)
            return
        if rec.nbytes > self.buffer_bytes:
            raise ConfigError(
                "network.buffer_bytes",
                self.buffer_bytes,
                f"at least the largest transfer: {rec.nbytes:.0f} bytes from GPU "
                f"{rec.src} to GPU {rec.dst} ({rec.tag or 'untagged'})",
            )
        circuit = yield from self._circuit(rec.src, rec.dst)
        amount = rec.nbytes
        buf = self._buffer(rec.dst)
        if buf is not None and amount > 0:
            yield buf.put(amount)  # waits for free space at the receiver
        lane = circuit.lanes.setdefault((rec.src, rec.dst), simpy.Resource(self.env, 1))
        with lane.request() as req:
            yield req
            start = self.env.now
            yield self.env.timeout(rec.nbytes / self.circuit_bandwidth)
            key = (rec.src, rec.dst)
            self.link_bytes[key] = self.link_bytes.get(key, 0.0) + rec.nbytes
            self.link_busy[key] = self.link_busy.get(key, 0.0) + self.env.now - start
        circuit.users -= 1
        circuit.last_used = self.env.now
        if circuit.users == 0:
            self._signal_idle()
        if self.latency:
            yield self.env.timeout(self.latency)
        if buf is not None and amount > 0:
            yield buf.get(amount)
        self._deliver(rec, ev)

    def _buffer(self, dst):
        if math.isinf(self.buffer_bytes):
            return None
        if dst not in self._buffers:
            self._buffers[dst] = simpy.Container(self.env, capacity=self.buffer_bytes)
        return self._buffers[dst]

    def _circuit(self, a, b):
        """Return a ready circuit a<->b with one more user, setting one up if needed."""
        key = frozenset((a, b))
        while True:
            c = self.circuits.get(key)
            if c is not None:
                c.users += 1
                if not c.ready.triggered:
                    yield c.ready
                return c
            if self._free_port(a) and self._free_port(b):
                c = _Circuit((a, b), self.env.event(), users=1)
                self.circuits[key] = c
                self._ports_used[a] += 1
                self._ports_used[b] += 1
                self.setups += 1
                yield self.env.timeout(self.setup_time)
                c.last_used = self.env.now
                c.ready.succeed()
                return c
            yield self._idle  # every circuit at a or b is busy: wait for one to go idle

    def _free_port(self, node) -> bool:
        if self._ports_used[node] < self.ports:
            return True
        idle = [
            c
            for c in self.circuits.values()
            if node in c.ends and c.users == 0 and c.ready.triggered
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last_used)  # least recently used
        del self.circuits[frozenset(victim.ends)]
        for end in set(victim.ends):
            self._ports_used[end] -= 1
        self.teardowns += 1
        return True

    def _signal_idle(self):
        ev, self._idle = self._idle, self.env.event()
        ev.succeed()

    def stats(self) -> dict:
        return {"setups": self.setups, "teardowns": self.teardowns}

    def link_stats(self):
        """One row per circuit direction that carried bytes."""
        import pandas as pd

        keys = sorted(self.link_bytes, key=repr)
        return pd.DataFrame(
            {
                "src": [k[0] for k in keys],
                "dst": [k[1] for k in keys],
                "bandwidth": [self.circuit_bandwidth] * len(keys),
                "latency": [self.latency] * len(keys),
                "bytes": [self.link_bytes[k] for k in keys],
                "busy_time": [self.link_busy[k] for k in keys],
            }
        )
