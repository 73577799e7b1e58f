"""Flow-based packet-switched network: shortest-path routing, per-link latency, max-min sharing.

A transfer's bytes enter the path at the max-min fair rate, which is recomputed
whenever a flow starts or ends; its last byte arrives one path latency after it
left, so a lone transfer takes latency + bytes / bandwidth. A transfer with a max_rate
crosses, besides its path, a private link of that capacity, so max-min fairness gives
it at most that rate and the others what it leaves.

Two engines compute the same numbers: `reference` keeps one object per flow and loops over
them; `fast` (the default) keeps the flows in numpy arrays (remaining bytes, rates, routes
as one flat array of link ids), caches each (source, destination) route and its latency,
keeps one record per transfer group (networks.groups; per-transfer records are built when
asked for), and delivers the flows that arrive at the same instant with one timer. It also
runs a ring collective on links nothing else uses as one reserved job
(networks.packet.ringjobs), split back into flows when other traffic touches them. Both evaluate
the same float expressions in the same order, so the results agree bit for bit on their
own and to round-off under contention (checked by tests/test_engine_fuzz.py).

`PacketSwitchNetwork` is put together from mixins, one concern each, that share the
instance's attributes (so the solver's loops read them as directly as before):

* networks.packet.reference: the reference engine;
* networks.packet.table: the fast engine's flow table (numpy columns) and its change log;
* networks.packet.solve: the incremental max-min solve over the components that changed;
* networks.packet.above: within a big component, re-solving the flows above a level only;
* networks.packet.checks: whole-table checks of those solves (tests turn them on);
* networks.packet.landing: transfer groups and their landing on arrival;
* networks.packet.ringjobs: ring collectives as reserved jobs.

This module holds the rest: the network's links and routes, and the fast engine's clock.
A start (`_start_fast`) routes the transfers, adds their flows to the table and asks for
one solve at this instant (`_solve_soon`), after every start queued there; a solve
(`_finish_fast`) takes the queued rows, delivers the flows that are done, re-solves the
rates (`_solve_changed`), updates the loads and sets one timer for the next flow to
finish; a newer solve supersedes it (`_generation`). Between solves nothing moves but the
clock: `_advance_fast` moves every flow forward at its rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import simpy

from networks.base import Network, register
from networks.groups import Group, seq_sum
from networks.packet.above import SolveAbove
from networks.packet.checks import SolveChecks
from networks.packet.landing import Landing
from networks.packet.reference import ReferenceEngine, _Flow
from networks.packet.ringjob import REL_TOL as _REL_TOL
from networks.packet.ringjob import TIME_TOL as _TIME_TOL
from networks.packet.ringjobs import RingJobs
from networks.packet.solve import ComponentSolve
from networks.packet.table import FlowTable
from networks.routing import Routes, path_latencies
from triosim.common.errors import NetworkError
from triosim.common.schema import option

# one-row columns shared by point-to-point starts (only ever copied into the table)
_ZERO_I, _ZERO_F = np.zeros(1, np.int64), np.zeros(1)


@dataclass(frozen=True, slots=True)
class _Batch:
    """Checked, routed transfers (`PacketSwitchNetwork.batch`); groups started from it
    share its arrays, which nothing writes."""

    net: object
    srcs: list
    dsts: list
    nb: np.ndarray
    maxr: np.ndarray
    flat: np.ndarray
    nh: np.ndarray
    lat: np.ndarray
    distinct: bool = False  # no link twice in `flat` (checked for short ones only)

    def __len__(self) -> int:
        return len(self.srcs)

    def tuples(self) -> list:
        return list(zip(self.srcs, self.dsts, self.nb.tolist(), self.maxr.tolist(), strict=True))


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
class PacketSwitchNetwork(
    RingJobs, ReferenceEngine, Landing, FlowTable, ComponentSolve, SolveAbove, SolveChecks, Network
):
    Options = PacketOptions
    reducing_endpoints = True  # a switch that reduces (NVLS, SHARP) may send and receive

    def __init__(self, env, graph, options=None, **kwargs):
        super().__init__(env, graph, options, **kwargs)
        self.routing = self.options.routing
        self.links = list(self.graph.edges())
        self._link_index = {e: i for i, e in enumerate(self.links)}
        data = [d for *_, d in self.graph.edges(data=True)]  # in `links` order
        self.capacity = np.array([d["bandwidth"] for d in data], float)
        self.latency = np.array([d.get("latency", 0.0) for d in data])
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
            self._advance = self._advance_fast
            self._on_timer = self._on_timer_fast
            self._route_cache: dict = {}
            self._busy: np.ndarray | None = np.zeros(0, np.int64)  # links with load > 0
            self._solve_queued = False  # new flows wait for a solve at this instant
            # the instant of the last done check, and the least remaining time found then
            # (when at _tmin_at)
            self._checked = self._tmin_at = None
            self._tmin = np.inf
            self._init_rings()
            self._init_landing()
            self._init_table()
            self._init_solver()
            self._init_above()

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

    # -- the fast engine: starts, the clock and the solve at each change ------------------
    def _route(self, src, dst):
        return self._routes([(src, dst)])[0]

    def _routes(self, pairs) -> list:
        """(links, path latency) of each (src, dst) pair, cached; the new ones routed
        together (Routes.paths_links)."""
        cache = self._route_cache
        new = [k for k in dict.fromkeys(pairs) if k not in cache]
        if new:
            paths = self.routes.paths_links(new)
            if any(x is None for x in paths):  # name the first pair without a path, in order
                bad = next(k for k in pairs if self.routes.path_links(*k) is None)
                raise NetworkError(
                    f"no path from GPU {bad[0]!r} to GPU {bad[1]!r} in this topology"
                )
            lats = path_latencies(self.latency, paths)
            for key, links, lat in zip(new, paths, lats, strict=True):
                cache[key] = (links, lat)
        return [cache[k] for k in pairs]

    def transfer_group(self, transfers, tag: str = "", _member=None) -> list[simpy.Event]:
        if self.options.engine == "reference":
            return super().transfer_group(transfers, tag, _member)
        srcs, dsts, sizes, caps = self._parse(transfers)
        events = [self.env.event() for _ in srcs]
        if srcs:
            self._start_parsed(srcs, dsts, sizes, caps, tag, events=events)
        return events

    def transfer_all(self, transfers, tag: str = "") -> simpy.Event:
        if self.options.engine == "reference":
            return super().transfer_all(transfers, tag)
        done = self.env.event()
        if type(transfers) is _Batch and transfers.net is self:
            b = transfers
        else:
            if type(transfers) is _Batch:  # another network's: its transfers again
                transfers = transfers.tuples()
            srcs, dsts, sizes, caps = self._parse(transfers)
            if not srcs:
                return done.succeed([])
            b = self._prepare(srcs, dsts, sizes, caps)
        g = Group(b.srcs, b.dsts, b.nb, b.maxr, self.env.now, tag, None, done)
        self._start_fast(g, b.flat, b.nh, b.lat, b.distinct)
        return done

    def batch(self, transfers):
        """The transfers checked and routed once, for `transfer_all` to start many times
        (a collective's streams, every time it runs)."""
        if self.options.engine == "reference":
            return super().batch(transfers)
        srcs, dsts, sizes, caps = self._parse(transfers)
        return self._prepare(srcs, dsts, sizes, caps) if srcs else []

    def _prepare(self, srcs, dsts, sizes, caps) -> _Batch:
        self._distances(srcs)
        routes = self._routes(list(zip(srcs, dsts, strict=True)))
        nh = np.fromiter((len(r[0]) for r in routes), np.int64, count=len(routes))
        flat = np.concatenate([r[0] for r in routes])
        lat = np.array([r[1] for r in routes], float)
        distinct = len(flat) <= 64 and len(set(flat.tolist())) == len(flat)
        return _Batch(
            self, srcs, dsts, np.array(sizes, float), np.array(caps, float), flat, nh, lat, distinct
        )

    def _start_parsed(self, srcs, dsts, sizes, caps, tag, events=None, done=None):
        b = self._prepare(srcs, dsts, sizes, caps)
        g = Group(srcs, dsts, b.nb, b.maxr, self.env.now, tag, events, done)
        self._start_fast(g, b.flat, b.nh, b.lat)

    def _start_fast(self, g: Group, flat, nh, lat, distinct: bool = False):
        """Start the transfers of `g` (their routes' links `flat`, `nh` per transfer, path
        latencies `lat`; `distinct`: no link twice in `flat`)."""
        self._advance_fast()
        if len(self._jobs) and (self._owner[flat] >= 0).any():
            for jid in dict.fromkeys(self._owner[flat][self._owner[flat] >= 0].tolist()):
                self._split(self._jobs[jid])
        nb = g.nb
        k = len(nb)
        if distinct:  # each link gets one add: a buffered add is the unbuffered one
            self.link_bytes[flat] += nb[0] if k == 1 else np.repeat(nb, nh)
        else:  # one unbuffered add in flow order: the same sums as one add per flow
            np.add.at(self.link_bytes, flat, np.repeat(nb, nh))
        self.bytes_sent = seq_sum(self.bytes_sent, nb)
        self.in_flight += k
        self._log.append(g)
        gid = self._register(g)
        if k == 1:  # a point-to-point send (pipelines: hundreds of thousands at 16k GPUs)
            self._add_flows(gid, g, _ZERO_I, nb, _ZERO_F, lat, nh, flat, distinct)
        else:
            self._add_flows(gid, g, np.arange(k), nb, np.zeros(k), lat, nh, flat, distinct)
        self._solve_soon()

    def _solve_soon(self) -> None:
        """Solve once the events already queued for this instant have run: transfers
        started at one instant by many processes (the pipeline sends of thousands of
        replicas) then cost one solve, not one each. The flows wait in the table; nothing
        moves before the solve, as the clock cannot pass this instant before it."""
        if self._solve_queued:
            return
        self._solve_queued = True
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None
        ev.callbacks.append(self._solve_now)
        self.env.schedule(ev)

    def _solve_now(self, _event=None) -> None:
        if self._solve_queued:
            self._solve_queued = False
            self._finish_fast()

    def _advance_fast(self):
        dt = self.env.now - self._last
        if dt > 0 and len(self._rem):
            self._rem -= self._rate * dt  # in place: the same floats as rem - rate * dt
            # the links with load > 0 gain dt, the others 0.0 (which leaves them unchanged)
            self.link_busy[self._busy_links()] += dt
        self._last = self.env.now

    def _busy_links(self) -> np.ndarray:
        if self._busy is None:
            self._busy = np.flatnonzero(self._load > 0)
        return self._busy

    def _finish_fast(self):
        self._solve_queued = False  # a timer at this instant solves the queued flows too
        if self._waiting_rows:
            self._take_rows()
        now = self.env.now
        tick = _TIME_TOL * max(now, 1e-9)
        n = len(self._rem)
        if self._stale is not None and self._checked == now:
            # the other flows were found not done at this instant and have not changed
            cand = self._stale
            if self._new:
                cand = np.concatenate([cand, np.arange(n - self._new, n)])
            done = cand[self._done(cand, tick)]
        else:
            done = np.flatnonzero(self._done(slice(None), tick))
        if self.check_solves:
            assert np.array_equal(done, np.flatnonzero(self._done(slice(None), tick)))
        departed = len(done) > 0
        if departed:
            self._deliver_fast(done)
            keep = np.ones(n, bool)
            keep[done] = False
            self._keep(keep)
        self._checked, self._stale = now, None
        self._generation += 1
        if not len(self._rem):
            self._load[:] = 0.0
            self._busy = np.zeros(0, np.int64)
            self._seeds, self._gone, self._new = [], [], 0
            self._gone_links = []
            self._stale, self._tmin_at = np.zeros(0, np.int64), None
            return
        self.reallocations += 1
        peak = self.max_utilisation
        touched = self._solve_changed()
        if touched is None:  # no flow left
            self._load[:] = 0.0
            self._busy = np.zeros(0, np.int64)
            self._stale, self._tmin_at = np.zeros(0, np.int64), None
            return
        if len(touched):
            self._update_loads(touched)
        if self.check_solves:
            self._check_loads(peak)
        k = self._solved_tail
        with np.errstate(divide="ignore"):
            if self._tmin_at == now and not departed and k >= 0:
                # only the k flows at the end changed since the last minimum, at this instant
                dt = (
                    self._tmin
                    if k == 0
                    else min(self._tmin, float((self._rem[-k:] / self._rate[-k:]).min()))
                )
            else:
                dt = float((self._rem / self._rate).min())
            if self.check_solves:
                assert dt == float((self._rem / self._rate).min())
        self._tmin, self._tmin_at = dt, now
        gen = self._generation
        self.env.timeout(max(dt, 0.0)).callbacks.append(lambda _e: self._on_timer_fast(gen))

    def _done(self, sel, tick):
        """Which flows `sel` are done: (almost) no bytes left, no links, or less time left
        than the clock resolves."""
        rem, rate = self._rem[sel], self._rate[sel]
        return (
            (rem <= _REL_TOL * self._nb[sel])
            | (self._nh[sel] == 0)
            | ((rate > 0) & (rem <= rate * tick))
        )

    def _on_timer_fast(self, gen):
        if gen != self._generation:
            return
        self._advance_fast()
        self._finish_fast()

    # -- statistics --------------------------------------------------------------------
    def flow_rates(self) -> np.ndarray:
        """Rates (bytes/s) of the flows in flight, in the order they started."""
        if self.options.engine == "fast":
            self._solve_now()
            return self._rate.copy()
        return np.array([f.rate for f in self._flows])

    def stats(self) -> dict:
        return {"reallocations": self.reallocations, "max_utilisation": self.max_utilisation}

    def link_stats(self):
        import pandas as pd

        self._advance()
        if self.options.engine == "fast" and self._jobs:  # count what ring jobs did so far
            for job in list(self._jobs.values()):
                self._split(job)
            self._finish_fast()
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
