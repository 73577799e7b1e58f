"""Flow-based packet-switched network: shortest-path routing, per-link latency, max-min sharing.

A transfer's bytes enter the path at the max-min fair rate, which is recomputed
whenever a flow starts or ends; its last byte arrives one path latency after it
left, so a lone transfer takes latency + bytes / bandwidth. A transfer with a max_rate
crosses, besides its path, a private link of that capacity, so max-min fairness gives
it at most that rate and the others what it leaves.

Two engines compute the same numbers: `reference` keeps one object per flow and loops over
them; `fast` (the default) keeps the flows in numpy arrays (remaining bytes, rates, routes
as one flat array of link ids), caches each (source, destination) route and its latency,
and delivers the flows that arrive at the same instant with one timer. Both evaluate the
same float expressions in the same order, so the results agree bit for bit (checked by
tests/test_engine_fuzz.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import simpy

from networks.base import Network, TransferRecord, register
from networks.maxmin import incidence, link_loads, max_min_rates
from networks.routing import Routes
from triosim.errors import NetworkError
from triosim.schema import option

_REL_TOL = 1e-9  # a flow with this fraction of its bytes left is done (float round-off)
_TIME_TOL = 1e-12  # relative to the clock: shorter remaining times are below its resolution


@dataclass(slots=True)
class _Flow:
    rec: TransferRecord
    event: simpy.Event
    links: np.ndarray
    latency: float
    remaining: float
    rate: float = 0.0


@dataclass(frozen=True)
class PacketOptions:
    routing: Literal["latency", "hops"] = option(
        "latency",
        help="after fewest inter-node hops: least summed latency (ties: fastest "
        "links, then fewest hops), or fewest hops (networks.routing)",
    )
    engine: Literal["fast", "reference"] = option(
        "fast",
        help="fast: flows held as numpy arrays, one event per transfer group; reference: "
        "the straightforward per-flow engine (same results, kept to check the fast one)",
    )


@register("packet")
class PacketSwitchNetwork(Network):
    Options = PacketOptions
    reducing_endpoints = True  # a switch that reduces (NVLS, SHARP) may send and receive

    def __init__(self, env, graph, options=None, **kwargs):
        super().__init__(env, graph, options, **kwargs)
        self.routing = self.options.routing
        self.links = list(self.graph.edges())
        self._link_index = {e: i for i, e in enumerate(self.links)}
        self.capacity = np.array([self.graph.edges[e]["bandwidth"] for e in self.links], float)
        self.latency = np.array([self.graph.edges[e].get("latency", 0.0) for e in self.links])
        self.link_bytes = np.zeros(len(self.links))
        self.link_busy = np.zeros(len(self.links))
        self.max_utilisation = 0.0  # highest load/capacity seen on any link (<= 1)
        self._flows: list[_Flow] = []
        self._load = np.zeros(len(self.links))
        self._last = env.now
        self._generation = 0
        self.reallocations = 0
        self._routing_tables()
        if self.options.engine == "fast":
            self._start_group = self._start_group_fast
            self._advance = self._advance_fast
            self._on_timer = self._on_timer_fast
            self._route_cache: dict = {}
            self._recs: list[TransferRecord] = []
            self._evs: list[simpy.Event] = []
            self._rem = np.zeros(0)
            self._rate = np.zeros(0)
            self._nb = np.zeros(0)
            self._lat = np.zeros(0)
            self._maxr = np.zeros(0)
            self._nh = np.zeros(0, np.int64)
            self._flat = np.zeros(0, np.int64)

    # -- routing ----------------------------------------------------------------------
    def _routing_tables(self):
        self.routes = Routes(self.graph, self.routing)

    def _distances(self, sources) -> None:
        self.routes.distances(sources)

    def path_links(self, src, dst) -> np.ndarray:
        links = self.routes.path_links(src, dst)
        if links is None:
            raise NetworkError(f"no path from GPU {src!r} to GPU {dst!r} in this topology")
        return links

    def path(self, src, dst) -> list:
        links = self.path_links(src, dst)
        return [src] + [self.links[i][1] for i in links]

    # -- flow dynamics ----------------------------------------------------------------
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
            if (f.remaining <= _REL_TOL * f.rec.nbytes or len(f.links) == 0
                    or (f.rate > 0 and f.remaining <= f.rate * tick)):  # fmt: skip
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

    # -- the fast engine: flows as numpy arrays ----------------------------------------------
    def _route(self, src, dst):
        key = (src, dst)
        r = self._route_cache.get(key)
        if r is None:
            links = np.asarray(self.path_links(src, dst), dtype=np.int64)
            lat = float(self.latency[links].sum()) if len(links) else 0.0
            r = self._route_cache[key] = (links, lat)
        return r

    def _start_group_fast(self, records, events):
        self._advance_fast()
        srcs = [r.src for r in records]
        self._distances(srcs)
        paths, lats = [], []
        for rec in records:
            links, lat = self._route(rec.src, rec.dst)
            paths.append(links)
            lats.append(lat)
        nb = np.array([r.nbytes for r in records], float)
        nh = np.fromiter((len(x) for x in paths), np.int64, count=len(paths))
        flat = np.concatenate(paths) if paths else np.zeros(0, np.int64)
        # one unbuffered add in flow order: the same sums as one add per flow
        np.add.at(self.link_bytes, flat, np.repeat(nb, nh))
        self._recs += records
        self._evs += events
        self._rem = np.concatenate([self._rem, nb])
        self._rate = np.concatenate([self._rate, np.zeros(len(records))])
        self._nb = np.concatenate([self._nb, nb])
        self._lat = np.concatenate([self._lat, np.array(lats, float)])
        self._maxr = np.concatenate([self._maxr, [r.max_rate for r in records]])
        self._nh = np.concatenate([self._nh, nh])
        self._flat = np.concatenate([self._flat, flat])
        self._finish_fast()

    def _advance_fast(self):
        dt = self.env.now - self._last
        if dt > 0 and len(self._rem):
            self._rem = self._rem - self._rate * dt
            self.link_busy += np.where(self._load > 0, dt, 0.0)
        self._last = self.env.now

    def _keep(self, keep: np.ndarray) -> None:
        """Keep the flows where `keep` is True (order preserved)."""
        idx = np.flatnonzero(keep)
        self._recs = [self._recs[i] for i in idx]
        self._evs = [self._evs[i] for i in idx]
        self._flat = self._flat[np.repeat(keep, self._nh)]
        for name in ("_rem", "_rate", "_nb", "_lat", "_maxr", "_nh"):
            setattr(self, name, getattr(self, name)[idx])

    def _deliver_fast(self, done: np.ndarray) -> None:
        """Deliver the flows at indices `done`, in order: at once without latency, else one
        timer per distinct arrival time (the order of delivery within it kept)."""
        now = self.env.now
        later: dict[float, list] = {}
        for i in done.tolist():
            lat = float(self._lat[i])
            rec, ev = self._recs[i], self._evs[i]
            if lat > 0:
                later.setdefault(now + lat, []).append((lat, rec, ev))
            else:
                self._deliver(rec, ev)
        for items in later.values():
            self.env.timeout(items[0][0]).callbacks.append(
                lambda _e, items=items: [self._deliver(r, e) for _, r, e in items]
            )

    def _finish_fast(self):
        tick = _TIME_TOL * max(self.env.now, 1e-9)
        rem, rate = self._rem, self._rate
        done = (rem <= _REL_TOL * self._nb) | (self._nh == 0) | ((rate > 0) & (rem <= rate * tick))
        if done.any():
            self._deliver_fast(np.flatnonzero(done))
            self._keep(~done)
        self._generation += 1
        n_flows = len(self._rem)
        if not n_flows:
            self._load[:] = 0.0
            return
        self.reallocations += 1
        rows, cols, capacity = self._incidence_fast()
        rates = max_min_rates(rows, cols, n_flows, capacity)
        self._rate = rates
        inf = np.isinf(rates)
        if inf.any():  # flows over infinitely fast links only: done at once
            self._deliver_fast(np.flatnonzero(inf))
            self._keep(~inf)
            if not len(self._rem):
                self._load[:] = 0.0
                return
            rows, cols, _ = self._incidence_fast()
            rates = self._rate
        real = rows < len(self.links)
        self._load = link_loads(rows[real], cols[real], rates, len(self.links))
        with np.errstate(divide="ignore", invalid="ignore"):
            util = np.where(np.isfinite(self.capacity), self._load / self.capacity, 0.0)
        self.max_utilisation = max(self.max_utilisation, float(util.max(initial=0.0)))
        with np.errstate(divide="ignore"):
            dt = float((self._rem / rates).min())
        gen = self._generation
        self.env.timeout(max(dt, 0.0)).callbacks.append(lambda _e: self._on_timer_fast(gen))

    def _incidence_fast(self):
        """As `_incidence`: the flat routes, each capped flow's private link after its path."""
        n, nh = len(self.links), self._nh
        cols = np.repeat(np.arange(len(nh)), nh)
        capped = np.flatnonzero(self._maxr < np.inf)
        if not len(capped):
            return self._flat, cols, self.capacity
        ext = nh.copy()
        ext[capped] += 1
        ends = np.cumsum(ext)  # the private link is the last entry of a capped flow
        rows = np.empty(int(ends[-1]) if len(ends) else 0, np.int64)
        mask = np.ones(len(rows), bool)
        mask[ends[capped] - 1] = False
        rows[mask] = self._flat
        rows[~mask] = n + np.arange(len(capped))
        cols = np.repeat(np.arange(len(nh)), ext)
        return rows, cols, np.concatenate([self.capacity, self._maxr[capped]])

    def _on_timer_fast(self, gen):
        if gen != self._generation:
            return
        self._advance_fast()
        self._finish_fast()

    # -- statistics --------------------------------------------------------------------
    def flow_rates(self) -> np.ndarray:
        """Rates (bytes/s) of the flows in flight, in the order they started."""
        if self.options.engine == "fast":
            return self._rate.copy()
        return np.array([f.rate for f in self._flows])

    def stats(self) -> dict:
        return {"reallocations": self.reallocations, "max_utilisation": self.max_utilisation}

    def link_stats(self):
        import pandas as pd

        self._advance()
        return pd.DataFrame(
            {
                "src": [u for u, _ in self.links],
                "dst": [v for _, v in self.links],
                "bandwidth": self.capacity,
                "latency": self.latency,
                "bytes": self.link_bytes,
                "busy_time": self.link_busy,
            }
        )
