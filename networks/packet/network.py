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
(networks.packet.ringjobs), and a transfer group alone on its links whose flows all end at
its first timer as another (networks.packet.groupjobs), each split back into flows when
other traffic touches their links. Both evaluate the same float expressions in the same
order, so the results agree bit for bit on their own and to round-off under contention
(checked by tests/test_engine_fuzz.py; the jobs against the flow table by
tests/test_ring_job.py and tests/test_group_jobs.py).

`PacketSwitchNetwork` holds the links, the routes and the counters, and one engine; each
piece is an object owning one concern and its state, its class docstring its contract:

* networks.packet.reference: `ReferenceEngine`, the reference engine;
* networks.packet.engine: `FastEngine`, the fast engine's clock: starts, the solve at each
  change, the timer; it holds the pieces below;
* networks.packet.table: `FlowTable`, the flows in flight as numpy columns and their
  change log;
* networks.packet.landing: `Landing`, transfer groups and their landing on arrival;
* networks.packet.solve: `ComponentSolve`, the incremental max-min solve over the
  components that changed, and the links' loads; it holds
* networks.packet.above: `SolveAbove`, within a big component, re-solving the flows above
  a level only, and
* networks.packet.checks: `SolveChecks`, whole-table checks of those solves (tests turn
  them on with `check_solves`);
* networks.packet.ringjobs: `RingJobs`, ring collectives as reserved jobs
  (networks.packet.ringjob: one job's step times);
* networks.packet.groupjobs: `GroupJobs`, transfer groups alone on their links as
  reserved jobs;
* networks.packet.footprint: `Footprint`, what a batch started many times adds to its
  links, at once where that is exact.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import simpy

from networks.base import Network, register
from networks.groups import Group, Then
from networks.packet.engine import FastEngine
from networks.packet.quotient import Quotient
from networks.packet.reference import ReferenceEngine
from networks.routing import Routes, path_latencies
from triosim.common.errors import NetworkError, QuotientBroken
from triosim.common.schema import option


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
    # by orbits (networks.packet.quotient): every transfer's (srcs, dsts, nb, maxr), and
    # each one's kept flow (an index into srcs); None: the batch is its transfers
    full: tuple | None = None
    expand: np.ndarray | None = None
    # by orbits: the full group's bytes less the kept flows' (float sums, made once: a
    # start and a landing add them to the network's counters)
    extra_bytes: float = 0.0
    # what the kept flows get alone on their links (networks.packet.groupjobs), made when
    # first asked for
    _alone: list = field(default_factory=list, repr=False, compare=False)
    # by orbits: the transfers of each kept flow (index arrays), and `expand` as a list
    _by_kept: list = field(default_factory=list, repr=False, compare=False)
    # [starts asked for, the Footprint once made] (`footprint`)
    _footprint: list = field(default_factory=lambda: [0, None], repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.srcs)

    def by_kept(self) -> tuple:
        """(each kept flow's transfers, `expand` as a list), made once."""
        if not self._by_kept:
            order = np.argsort(self.expand, kind="stable")
            cuts = np.cumsum(np.bincount(self.expand, minlength=len(self.srcs)))[:-1]
            self._by_kept.append((np.split(order, cuts), self.expand.tolist()))
        return self._by_kept[0]

    def alone(self):
        """networks.packet.groupjobs.Alone of these flows, made once (from the
        capacities then: a batch does not outlive a change of them)."""
        if not self._alone:
            groups = self.net._engine.groups
            self._alone.append(groups.alone(self.flat, self.nh, self.nb, self.maxr, self.lat))
        return self._alone[0]

    def footprint(self):
        """networks.packet.footprint.Footprint of these flows, made at the second start
        (a batch started once does not pay for it); None before."""
        fp = self._footprint
        if fp[1] is None:
            fp[0] += 1
            if fp[0] < 2:
                return None
            from networks.packet.footprint import Footprint

            fp[1] = Footprint(self.flat, self.nh, self.nb)
        return fp[1]

    def tuples(self) -> list:
        """Every transfer (by orbits: the full group's, not only the kept flows)."""
        srcs, dsts, nb, maxr = (
            self.full if self.full is not None else (self.srcs, self.dsts, self.nb, self.maxr)
        )
        return list(zip(srcs, dsts, nb.tolist(), maxr.tolist(), strict=True))


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


def _part(path: str, name: str) -> property:
    """A property of the network that is attribute `name` of one of its parts (`path`:
    attributes from the network, dotted), read and written there."""
    owner = operator.attrgetter(path)

    def get(self):
        return getattr(owner(self), name)

    def put(self, value):
        setattr(owner(self), name, value)

    return property(get, put, doc=f"`{path}.{name}` (the fast engine's)")


@register("packet")
class PacketSwitchNetwork(Network):
    """Transfers as flows along shortest paths (networks.routing), each link shared
    max-min fairly by the flows crossing it, the rates recomputed whenever a flow starts
    or ends; a transfer's last byte lands one path latency after it left.

    Holds the links, the routes and the counters, and one engine (the module docstring
    says how the pieces fit). Gives: Network's interface (`transfer`, `transfer_group`,
    `transfer_all`, `batch`, `ring`, `records`, `link_stats`, `stats`) and `path_links`,
    `path`, `flow_rates`; the counters `link_bytes`, `link_busy`, `max_utilisation`,
    `reallocations`; with the fast engine, its parts' counters and settings as
    attributes of the network (below: `alone_solves`, ..., `above_min`, `SLIDE_MAX`).
    `check_solves` (on the class or an instance) turns the fast engine's whole-table
    checks on.

    Needs: a topology graph (Network's) and its options (`routing`, `engine`).
    """

    Options = PacketOptions
    reducing_endpoints = True  # a switch that reduces (NVLS, SHARP) may send and receive
    check_solves = False  # tests: compare every solve with the whole-table one (checks.py)

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
        self.reallocations = 0
        self._routing_tables()
        self._route_cache: dict = {}
        self._fast = self.options.engine == "fast"
        self._engine = FastEngine(self) if self._fast else ReferenceEngine(self)
        self.quotient: Quotient | None = None  # a symmetric run's flows by orbits

    quotients = True  # may a symmetric run move its flows by orbits (tests turn it off)

    def by_orbits(self, copies) -> bool:
        """Move the flows of a symmetric run's copies by orbits from now on
        (networks.packet.quotient; `copies`: its `copies`, `reps`, `images`), where this
        network can: the fast engine of this class, `quotients` set. Says whether it does.
        None: move every flow again (before any transfer started)."""
        if self.quotient is not None:  # back to every flow: the capacities as built
            self.capacity[:] = self.quotient.capacity0
            self.quotient = None
        if copies is None:
            return False
        if not (self.quotients and self._fast and type(self) is PacketSwitchNetwork):
            return False
        self.quotient = Quotient(self, copies)
        return True

    # the fast engine's parts' counters and settings, as attributes of the network
    alone_solves = _part("_engine.solver", "alone_solves")
    component_solves = _part("_engine.solver", "component_solves")
    full_solves = _part("_engine.solver", "full_solves")
    round_one_solves = _part("_engine.solver", "round_one_solves")
    capped_solves = _part("_engine.solver", "capped_solves")
    capped_skips = _part("_engine.solver", "capped_skips")
    resolved = _part("_engine.solver", "resolved")
    above_solves = _part("_engine.solver.above", "above_solves")
    above_capped = _part("_engine.solver.above", "above_capped")
    reach_solves = _part("_engine.solver.above", "reach_solves")
    tight_levels = _part("_engine.solver.above", "tight_levels")
    above_min = _part("_engine.solver.above", "above_min")
    RELOAD_EVERY = _part("_engine.solver.above", "RELOAD_EVERY")
    SLIDE_MAX = _part("_engine.table", "SLIDE_MAX")
    ring_jobs = _part("_engine.rings", "ring_jobs")
    ring_splits = _part("_engine.rings", "ring_splits")
    group_jobs = _part("_engine.groups", "group_jobs")
    group_splits = _part("_engine.groups", "group_splits")

    # -- routing ----------------------------------------------------------------------
    def _routing_tables(self):
        self.routes = Routes(self.graph, self.routing)

    def reuse_routes(self, routes) -> bool:
        """Route with `routes`, another network's on this very graph and routing (what
        they walked is kept: a symmetric run that falls back builds a second network),
        where nothing was routed here yet. Says whether it does."""
        if routes is self.routes:
            return True
        fresh = not self._route_cache and self.in_flight == 0 and not self._log
        if not fresh or routes.graph is not self.graph or routes.mode != self.routing:
            return False
        self.routes = routes
        return True

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

    # -- transfers ----------------------------------------------------------------------
    def _start_group(self, records, events):
        """Network.transfer_group's start (the reference engine's way)."""
        self._engine.start_group(records, events)

    def transfer_group(self, transfers, tag: str = "", _member=None) -> list[simpy.Event]:
        """Network's; `transfers` may be this network's batch of them (`batch`: checked and
        routed once, for a group started many times)."""
        if not self._fast:
            if type(transfers) is _Batch:
                transfers = transfers.tuples()
            return super().transfer_group(transfers, tag, _member)
        b = self._batch_for(transfers)
        if b is None:
            return []
        if b.expand is not None:
            return self.quotient.start_group(b, tag)
        events = [self.env.event() for _ in b.srcs]
        g = Group(b.srcs, b.dsts, b.nb, b.maxr, self.env.now, tag, events)
        self._engine.start(g, b.flat, b.nh, b.lat, alone=b.alone, footprint=b.footprint)
        return events

    def transfer_all(self, transfers, tag: str = "") -> simpy.Event:
        if not self._fast:
            return super().transfer_all(transfers, tag)
        done = self.env.event()
        b = self._batch_for(transfers)
        if b is None:
            return done.succeed([])
        return self._start_all(b, tag, done)

    def _batch_for(self, transfers) -> _Batch | None:
        """`transfers` as this network's batch: itself where it is one, else checked and
        routed now (another network's batch: its transfers again); None for none."""
        if type(transfers) is _Batch and transfers.net is self:
            return transfers
        if type(transfers) is _Batch:
            transfers = transfers.tuples()
        srcs, dsts, sizes, caps = self._parse(transfers)
        return self._prepare(srcs, dsts, sizes, caps) if srcs else None

    def transfer_all_then(self, transfers, then, tag: str = "") -> None:
        """Network's, for a batch of this network's fast engine: `then(records)` is called
        when the last transfer lands (networks.groups.Then), with no event between."""
        if not (self._fast and type(transfers) is _Batch and transfers.net is self):
            return super().transfer_all_then(transfers, then, tag)
        self._start_all(transfers, tag, Then(then))

    def _start_all(self, b: _Batch, tag: str, done):
        """Start a batch as one group whose `done` (an event, or a Then) is succeeded with
        its records when the last transfer lands; returns `done`."""
        if b.expand is not None:
            return self.quotient.start_all(b, tag, done)
        g = Group(b.srcs, b.dsts, b.nb, b.maxr, self.env.now, tag, None, done)
        self._engine.start(g, b.flat, b.nh, b.lat, b.distinct, b.alone, b.footprint)
        return done

    def batch(self, transfers):
        """The transfers checked and routed once, for `transfer_all` to start many times
        (a collective's streams, every time it runs)."""
        if not self._fast:
            return super().batch(transfers)
        srcs, dsts, sizes, caps = self._parse(transfers)
        return self._prepare(srcs, dsts, sizes, caps) if srcs else []

    def _prepare(self, srcs, dsts, sizes, caps) -> _Batch:
        if self.quotient is not None:
            return self.quotient.prepare(srcs, dsts, sizes, caps)
        self._distances(srcs)
        routes = self._routes(list(zip(srcs, dsts, strict=True)))
        nh = np.fromiter((len(r[0]) for r in routes), np.int64, count=len(routes))
        flat = np.concatenate([r[0] for r in routes])
        lat = np.array([r[1] for r in routes], float)
        distinct = len(flat) <= 64 and len(set(flat.tolist())) == len(flat)
        return _Batch(
            self, srcs, dsts, np.array(sizes, float), np.array(caps, float), flat, nh, lat, distinct
        )

    def batch_of(self, srcs, dsts, nb, maxr, flat, nh, lat, full=None, expand=None) -> _Batch:
        """A batch of routed transfers (`flat`: their links, `nh` per transfer)."""
        extra = 0.0 if full is None else float(np.sum(full[2])) - float(np.sum(nb))
        return _Batch(self, srcs, dsts, nb, maxr, flat, nh, lat, False, full, expand, extra)

    def ring(self, group, chunk: float, steps: int, tag: str = "") -> simpy.Event:
        """Network's ring; the fast engine runs it as a reserved job where its links are
        free (networks.packet.ringjobs), unless a subclass counts deliveries itself."""
        if self.quotient is not None:
            raise QuotientBroken("a ring collective (reserved links) in a run by orbits")
        if not self._fast or self._engine.landing.per_record:
            return super().ring(group, chunk, steps, tag)
        return self._engine.rings.ring(group, chunk, steps, tag)

    # -- statistics --------------------------------------------------------------------
    def flow_rates(self) -> np.ndarray:
        """Rates (bytes/s) of the flows in flight, in the order they started."""
        if self._fast:
            engine = self._engine
            if engine.groups.jobs:  # group jobs' flows into the table, to be solved with it
                engine.advance()
                engine.groups.split_all()
                engine.solve_soon()
            engine.solve_now()
            t = engine.table
            # a split job's flows joined the table's end: in the order the groups started
            return t.rate[np.argsort(t.gid, kind="stable")]
        return np.array([f.rate for f in self._engine.flows])

    def stats(self) -> dict:
        return {"reallocations": self.reallocations, "max_utilisation": self.max_utilisation}

    def link_stats(self):
        import pandas as pd

        engine = self._engine
        engine.advance()
        if self._fast and (engine.rings.jobs or engine.groups.jobs):  # count what jobs did so far
            for job in list(engine.rings.jobs.values()):
                engine.rings.split(job)
            engine.groups.split_all()
            engine.finish()
        cap, nbytes, busy = self.capacity, self.link_bytes, self.link_busy
        if self.quotient is not None:
            cap, nbytes, busy = self.quotient.link_stats_columns(nbytes, busy)
        return pd.DataFrame(
            {
                "src": [u for u, _ in self.links],
                "dst": [v for _, v in self.links],
                "bandwidth": cap,
                "latency": self.latency,
                "bytes": nbytes,
                "busy_time": busy,
            }
        )
