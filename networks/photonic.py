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
from triosim.errors import ConfigError


@dataclass
class _Circuit:
    ends: tuple
    ready: simpy.Event
    lanes: dict = field(default_factory=dict)  # direction -> simpy.Resource(1)
    users: int = 0
    last_used: float = 0.0


def _positive(name, value, allow_inf=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or (math.isinf(value) and not allow_inf):
        raise ConfigError(f"network.{name}", value, "a number > 0")
    return float(value)


@register("photonic")
class PhotonicNetwork(Network):
    def __init__(
        self,
        env,
        graph,
        total_bandwidth: float = 484e9,
        links: int = 8,
        ports: int | None = None,
        setup_time: float = 20e-3,
        latency: float = 0.0,
        buffer_bytes: float = math.inf,
    ):
        super().__init__(env, graph)
        if not isinstance(links, int) or links < 1:
            raise ConfigError("network.links", links, "an integer >= 1")
        ports = links if ports is None else ports
        if not isinstance(ports, int) or ports < 1:
            raise ConfigError("network.ports", ports, "an integer >= 1")
        if not (isinstance(setup_time, (int, float)) and 0 <= setup_time < math.inf):
            raise ConfigError("network.setup_time", setup_time, "a time >= 0 s")
        if not (isinstance(latency, (int, float)) and 0 <= latency < math.inf):
            raise ConfigError("network.latency", latency, "a time >= 0 s")
        self.circuit_bandwidth = _positive("total_bandwidth", total_bandwidth) / links
        self.ports = ports
        self.setup_time = float(setup_time)
        self.latency = float(latency)
        self.buffer_bytes = _positive("buffer_bytes", buffer_bytes, allow_inf=True)
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
        circuit = yield from self._circuit(rec.src, rec.dst)
        amount = min(rec.nbytes, self.buffer_bytes)
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
        idle = [c for c in self.circuits.values()
                if node in c.ends and c.users == 0 and c.ready.triggered]  # fmt: skip
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

    def link_stats(self):
        import pandas as pd

        keys = sorted(self.link_bytes, key=repr)
        return pd.DataFrame(
            {
                "src": [k[0] for k in keys],
                "dst": [k[1] for k in keys],
                "bandwidth": [self.circuit_bandwidth] * len(keys),
                "bytes": [self.link_bytes[k] for k in keys],
                "busy_time": [self.link_busy[k] for k in keys],
            }
        )
