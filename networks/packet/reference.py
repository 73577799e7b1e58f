"""The packet network's reference engine: one object per flow, a whole solve per change
(`ReferenceEngine`).

The straightforward engine (`engine: reference`), kept to check the fast one: every start
or end of a flow moves all flows forward to now (`advance`), delivers the ones done, and
re-solves max-min fairness over all the rest (networks.maxmin.max_min_rates), each rate-
capped flow crossing a private link of its cap; one timer waits for the next to finish,
and a newer solve supersedes it (`generation`). A flow lands one path latency after its
last byte left. The fast engine shares the done rule (REL_TOL, TIME_TOL) and evaluates the
same float expressions in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import simpy

from networks.groups import TransferRecord
from networks.maxmin import incidence, link_loads, max_min_rates
from networks.packet.ringjob import REL_TOL as _REL_TOL
from networks.packet.ringjob import TIME_TOL as _TIME_TOL


@dataclass(slots=True)
class _Flow:
    rec: TransferRecord
    event: simpy.Event
    links: np.ndarray
    latency: float
    remaining: float
    rate: float = 0.0


class ReferenceEngine:
    """The reference engine's flows, rates and clock.

    Gives: `start_group(records, events)` (Network's `_start_group`: the records' flows
    start now), `advance()` (every flow moved forward to now), `flows` (the flows in
    flight, in the order they started, each with its `rate`) and `load` (each link's load
    as of the last solve).

    Needs: the network (`env`, `links`, `capacity`, `latency`, `path_links(src, dst)` and
    `_distances(sources)`, its counters `link_bytes`, `link_busy`, `max_utilisation`,
    `reallocations`, and `_deliver`).
    """

    def __init__(self, net) -> None:
        self.net, self.env = net, net.env
        self.flows: list[_Flow] = []
        self.load = np.zeros(len(net.links))
        self.last = net.env.now  # the instant the flows were last moved forward to
        self.generation = 0  # solves so far: a timer of an older one does nothing

    def start_group(self, records, events):
        net = self.net
        self.advance()
        net._distances([r.src for r in records])
        for rec, ev in zip(records, events, strict=True):
            links = net.path_links(rec.src, rec.dst)
            lat = float(net.latency[links].sum()) if len(links) else 0.0
            self.flows.append(_Flow(rec, ev, links, lat, rec.nbytes))
            np.add.at(net.link_bytes, links, rec.nbytes)
        self._finish_and_reallocate()

    def advance(self):
        """Move every flow forward to now at its current rate."""
        dt = self.env.now - self.last
        if dt > 0 and self.flows:
            for f in self.flows:
                f.remaining -= f.rate * dt
            self.net.link_busy += np.where(self.load > 0, dt, 0.0)
        self.last = self.env.now

    def _finish_and_reallocate(self):
        net = self.net
        still = []
        # a flow whose remaining time is below the clock's resolution is done: otherwise
        # now + dt == now and the timer would fire forever without progress
        tick = _TIME_TOL * max(self.env.now, 1e-9)
        for f in self.flows:
            if (
                f.remaining <= _REL_TOL * f.rec.nbytes
                or len(f.links) == 0
                or (f.rate > 0 and f.remaining <= f.rate * tick)
            ):
                self._schedule_delivery(f)
            else:
                still.append(f)
        self.flows = still
        self.generation += 1
        if not still:
            self.load[:] = 0.0
            return
        net.reallocations += 1
        rows, cols, capacity = self._incidence(still)
        rates = max_min_rates(rows, cols, len(still), capacity)
        for f, r in zip(still, rates, strict=True):
            f.rate = float(r)
        if np.isinf(rates).any():  # flows over infinitely fast links only: done at once
            for f in still:
                if f.rate == np.inf:
                    self._schedule_delivery(f)
            self.flows = still = [f for f in still if f.rate != np.inf]
            if not still:
                self.load[:] = 0.0
                return
            rows, cols, _ = self._incidence(still)
            rates = np.array([f.rate for f in still])
        real = rows < len(net.links)  # not the private rate-cap links
        self.load = link_loads(rows[real], cols[real], rates, len(net.links))
        with np.errstate(divide="ignore", invalid="ignore"):
            util = np.where(np.isfinite(net.capacity), self.load / net.capacity, 0.0)
        net.max_utilisation = max(net.max_utilisation, float(util.max(initial=0.0)))
        with np.errstate(divide="ignore"):
            dt = min(f.remaining / f.rate for f in still)
        gen = self.generation
        self.env.timeout(max(dt, 0.0)).callbacks.append(lambda _e: self._on_timer(gen))

    def _incidence(self, flows):
        """Incidence of the flows over the links, plus one private link per capped flow."""
        n = len(self.net.links)
        capped = [k for k, f in enumerate(flows) if f.rec.max_rate < np.inf]
        extra = [np.array([n + j]) for j in range(len(capped))]
        paths = [f.links for f in flows]
        for j, k in enumerate(capped):
            paths[k] = np.concatenate([paths[k], extra[j]])
        rows, cols = incidence(paths)
        if not capped:
            return rows, cols, self.net.capacity
        caps = np.array([flows[k].rec.max_rate for k in capped])
        return rows, cols, np.concatenate([self.net.capacity, caps])

    def _on_timer(self, gen):
        if gen != self.generation:
            return  # superseded by a later reallocation
        self.advance()
        self._finish_and_reallocate()

    def _schedule_delivery(self, f: _Flow):
        net = self.net
        if f.latency > 0:
            self.env.timeout(f.latency).callbacks.append(lambda _e: net._deliver(f.rec, f.event))
        else:
            net._deliver(f.rec, f.event)
