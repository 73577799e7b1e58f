"""The packet network's reference engine: one object per flow, a whole solve per change (a mixin).

The straightforward engine (`engine: reference`), kept to check the fast one: every start
or end of a flow moves all flows forward to now (`_advance`), delivers the ones done, and
re-solves max-min fairness over all the rest (networks.maxmin.max_min_rates), each rate-
capped flow crossing a private link of its cap; one timer waits for the next to finish,
and a newer solve supersedes it (`_generation`). A flow lands one path latency after its
last byte left.

What the host provides: `env`, `links`, `capacity`, `latency`, `path_links(src, dst)`
and `_distances(sources)` (routing), the counters `link_bytes`, `link_busy`, `_load`,
`max_utilisation`, `reallocations`, `_generation`, the clock `_last`, `_flows` (a list,
empty at first) and Network's `_deliver`. The fast engine shares the done rule (REL_TOL,
TIME_TOL) and evaluates the same float expressions in the same order.
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
    def _start_group(self, records, events):
        self._advance()
        self._distances([r.src for r in records])
        for rec, ev in zip(records, events, strict=True):
            links = self.path_links(rec.src, rec.dst)
            lat = float(self.latency[links].sum()) if len(links) else 0.0
            self._flows.append(_Flow(rec, ev, links, lat, rec.nbytes))
            np.add.at(self.link_bytes, links, rec.nbytes)
        self._finish_and_reallocate()

    def _advance(self):
        """Move every flow forward to now at its current rate."""
        dt = self.env.now - self._last
        if dt > 0 and self._flows:
            for f in self._flows:
                f.remaining -= f.rate * dt
            self.link_busy += np.where(self._load > 0, dt, 0.0)
        self._last = self.env.now

    def _finish_and_reallocate(self):
        still = []
        # a flow whose remaining time is below the clock's resolution is done: otherwise
        # now + dt == now and the timer would fire forever without progress
        tick = _TIME_TOL * max(self.env.now, 1e-9)
        for f in self._flows:
            if (
                f.remaining <= _REL_TOL * f.rec.nbytes
                or len(f.links) == 0
                or (f.rate > 0 and f.remaining <= f.rate * tick)
            ):
                self._schedule_delivery(f)
            else:
                still.append(f)
        self._flows = still
        self._generation += 1
        if not still:
            self._load[:] = 0.0
            return
        self.reallocations += 1
        rows, cols, capacity = self._incidence(still)
        rates = max_min_rates(rows, cols, len(still), capacity)
        for f, r in zip(still, rates, strict=True):
            f.rate = float(r)
        if np.isinf(rates).any():  # flows over infinitely fast links only: done at once
            for f in still:
                if f.rate == np.inf:
                    self._schedule_delivery(f)
            self._flows = still = [f for f in still if f.rate != np.inf]
            if not still:
                self._load[:] = 0.0
                return
            rows, cols, _ = self._incidence(still)
            rates = np.array([f.rate for f in still])
        real = rows < len(self.links)  # not the private rate-cap links
        self._load = link_loads(rows[real], cols[real], rates, len(self.links))
        with np.errstate(divide="ignore", invalid="ignore"):
            util = np.where(np.isfinite(self.capacity), self._load / self.capacity, 0.0)
        self.max_utilisation = max(self.max_utilisation, float(util.max(initial=0.0)))
        with np.errstate(divide="ignore"):
            dt = min(f.remaining / f.rate for f in still)
        gen = self._generation
        self.env.timeout(max(dt, 0.0)).callbacks.append(lambda _e: self._on_timer(gen))

    def _incidence(self, flows):
        """Incidence of the flows over the links, plus one private link per capped flow."""
        n = len(self.links)
        capped = [k for k, f in enumerate(flows) if f.rec.max_rate < np.inf]
        extra = [np.array([n + j]) for j in range(len(capped))]
        paths = [f.links for f in flows]
        for j, k in enumerate(capped):
            paths[k] = np.concatenate([paths[k], extra[j]])
        rows, cols = incidence(paths)
        if not capped:
            return rows, cols, self.capacity
        caps = np.array([flows[k].rec.max_rate for k in capped])
        return rows, cols, np.concatenate([self.capacity, caps])

    def _on_timer(self, gen):
        if gen != self._generation:
            return  # superseded by a later reallocation
        self._advance()
        self._finish_and_reallocate()

    def _schedule_delivery(self, f: _Flow):
        if f.latency > 0:
            self.env.timeout(f.latency).callbacks.append(lambda _e: self._deliver(f.rec, f.event))
        else:
            self._deliver(f.rec, f.event)
