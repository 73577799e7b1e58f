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
(networks.ringjobs), split back into flows when other traffic touches them. Both evaluate
the same float expressions in the same order, so the results agree bit for bit on their
own and to round-off under contention (checked by tests/test_engine_fuzz.py).

When flows start or end, the fast engine re-solves max-min fairness only on the connected
components of the flow-link graph that changed (`_solve_changed`): components are tracked
by labels, a new flow alone on its links (a pipeline send) takes its least capacity
without looking at the table, and loads, utilisation and the done check are updated for
the changed flows and links only. Max-min rates decompose over components and the solver
computes each with the same floats alone as within the table, so this changes no bit
(`check_solves` compares every solve with the whole-table one; tests/test_component_solve.py).
In a big component (a data-parallel all-reduce's ring steps over shared spine links, with
pipeline sends coming and going) most changes cannot reach most flows: progressive filling
runs as before up to the least rate a change can touch, so only the flows above that level
are re-solved, over the capacity the others leave (`_solve_above`; exact up to round-off in
the residual capacities, about 1e-15 relative, checked against whole solves to 1e-11).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import simpy

from networks.base import Network, TransferRecord, register
from networks.groups import Group, Records, at, seq_sum
from networks.maxmin import incidence, link_loads, max_min_rates
from networks.ringjob import REL_TOL as _REL_TOL
from networks.ringjob import TIME_TOL as _TIME_TOL
from networks.ringjob import RingJob
from networks.ringjobs import RingJobs
from networks.routing import Routes, path_latencies
from triosim.common.errors import NetworkError
from triosim.common.schema import option

# one-row columns shared by point-to-point starts (only ever copied into the table)
_ZERO_I, _ZERO_F, _NO_LABEL = np.zeros(1, np.int64), np.zeros(1), np.full(1, -1)
_COLUMNS = (
    ("_gid", np.int64),
    ("_idx", np.int64),
    ("_rem", float),
    ("_rate", float),
    ("_nb", float),
    ("_lat", float),
    ("_maxr", float),
    ("_nh", np.int64),
    ("_flab", np.int64),
)


@dataclass(slots=True)
class _Flow:
    rec: TransferRecord
    event: simpy.Event
    links: np.ndarray
    latency: float
    remaining: float
    rate: float = 0.0


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
class PacketSwitchNetwork(RingJobs, Network):
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
            self._advance = self._advance_fast
            self._on_timer = self._on_timer_fast
            self._route_cache: dict = {}
            self._groups: dict[int, Group] = {}  # groups with transfers not yet landed
            self._next_gid = 0
            self._rings: dict = {}  # ring group -> RingPaths
            self._jobs: dict[int, RingJob] = {}  # ring jobs under way
            self._owner = np.full(len(self.links), -1, np.int64)  # job holding each link
            self.ring_jobs = self.ring_splits = 0
            # a subclass that counts deliveries itself gets one _deliver call per transfer
            self._per_record = type(self)._deliver is not Network._deliver
            # the flow table: one column per flow (_gid: its group, _idx: its index in the
            # group, _rem: bytes left, _rate, _nb: bytes, _lat: path latency, _maxr: rate
            # cap, _nh: links, _flab: component label) and _flat (the links of every flow,
            # one after another), each a view of the first rows of a buffer that grows by
            # doubling, so that adding flows does not copy the table
            self._buffers = {name: np.zeros(16, dtype) for name, dtype in _COLUMNS}
            self._buffers["_flat"] = np.zeros(64, np.int64)
            for name in self._buffers:
                setattr(self, name, self._buffers[name][:0])
            self._seeds: list[np.ndarray] = []  # links whose flows changed since the solve
            self._solve_queued = False  # new flows wait for a solve at this instant
            self._waiting_rows: list[tuple] = []  # their rows, appended at the solve
            self._finite = np.isfinite(self.capacity)
            # a link of capacity 0 makes the whole-table utilisation max nan (0 / 0), which
            # max() then ignores: kept as is, so the counter stays what it always was
            self._nan_util = bool((self.capacity == 0).any())
            self._busy: np.ndarray | None = np.zeros(0, np.int64)  # links with load > 0
            self._mark = np.zeros(len(self.links), bool)  # scratch, all False between uses
            self._occ = np.zeros(len(self.links), np.int64)  # flows in the table on each link
            self._new = 0  # flows at the end of the table added since the last solve
            # component labels (networks joined by shared finite links) of each flow and
            # link: every component within one label; -1: a new flow, or a link never used
            self._llab = np.full(len(self.links), -1, np.int64)
            self._labels = 0  # labels handed out so far (never reused)
            self._gone: list[np.ndarray] = []  # labels of the flows gone since the solve
            # the gone flows' links, with the flow's rate and label on each (_solve_above)
            self._gone_links: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
            self._capped: set[int] = set()  # labels whose flows all ran at their rate cap
            self.capped_solves = self.capped_skips = self.round_one_solves = 0
            self._r1_wait = self._r1_backoff = 0  # big sets to solve without _round_one
            # flows whose rate changed at the last solve (None: all), the instant of the
            # last done check, and the least remaining time found then (when at _tmin_at)
            self._stale: np.ndarray | None = None
            self._checked = self._tmin_at = None
            self._tmin, self._solved_tail = np.inf, -1
            self._pos = np.zeros(len(self.links), np.int64)  # scratch
            # solves: of new flows alone on their links, of some components, of the table
            self.alone_solves = self.component_solves = self.full_solves = 0
            self.above_solves = 0  # solves of the flows above a level only (_solve_above)
            self.above_capped = 0  # ... with flows at a rate cap among them
            self.reach_solves = 0  # ... of the components a change reaches only
            self.tight_levels = 0  # ... from the rates on the new flows' links
            self.resolved = 0  # flows whose rate the last solve computed

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

    # -- the fast engine: flows as numpy arrays, records per group ---------------------------
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

    def _register(self, g: Group) -> int:
        gid = self._next_gid
        self._next_gid += 1
        self._groups[gid] = g
        return gid

    def _add_flows(self, gid: int, g: Group, idx, rem, rate, lat, nh, flat, distinct: bool = False):
        """Put transfers idx of group g in the flow table (rem bytes left, sending at rate).
        The rows wait in `_waiting_rows` until the solve at this instant (`_take_rows`):
        the groups started at one instant are appended with one copy per column.
        (`distinct`: no link twice in `flat`.)"""
        k = len(idx)
        if k == 1 and len(g.nb) == 1:  # the whole group: its own arrays (never written)
            nb, maxr, lab = g.nb, g.maxr, _NO_LABEL
        else:
            nb, maxr, lab = g.nb[idx], g.maxr[idx], np.full(k, -1)
        gids = np.array([gid]) if k == 1 else np.full(k, gid)  # np.full: ~1 us more
        self._waiting_rows.append((gids, idx, rem, rate, nb, lat, maxr, nh, lab, flat))
        if distinct:
            self._occ[flat] += 1
        else:
            np.add.at(self._occ, flat, 1)
        self._seeds.append(flat)
        self._new += k

    def _take_rows(self) -> None:
        """Append the waiting rows to the table, in the order they were added."""
        rows, self._waiting_rows = self._waiting_rows, []
        n, k = len(self._rem), sum(len(r[1]) for r in rows)
        for j, (name, _) in enumerate(_COLUMNS):
            self._append(
                name, n, rows[0][j] if len(rows) == 1 else np.concatenate([r[j] for r in rows]), k
            )
        flat = rows[0][-1] if len(rows) == 1 else np.concatenate([r[-1] for r in rows])
        self._append("_flat", len(self._flat), flat, len(flat))

    def _append(self, name: str, n: int, values, k: int) -> None:
        buf = self._buffers[name]
        if n + k > len(buf):
            grown = np.empty(max(2 * len(buf), n + k), buf.dtype)
            grown[:n] = buf[:n]
            self._buffers[name] = buf = grown
        buf[n : n + k] = values
        setattr(self, name, buf[: n + k])

    def _advance_fast(self):
        dt = self.env.now - self._last
        if dt > 0 and len(self._rem):
            self._rem -= self._rate * dt  # in place: the same floats as rem - rate * dt
            # the links with load > 0 gain dt, the others 0.0 (which leaves them unchanged)
            self.link_busy[self._busy_links()] += dt
        self._last = self.env.now

    def _entries(self, flows: np.ndarray, ends=None) -> np.ndarray:
        """Positions in `_flat` of the entries of `flows` (ascending), in order: each
        flow's first entry from the running sum of hops (`ends`: its value at `flows`,
        if known), then one repeat over these flows only (repeating a mask over the whole
        table costs ~7 ns a flow: 0.35 ms at 50,000 flows, per call)."""
        nh = self._nh[flows]
        first = (np.cumsum(self._nh)[flows] if ends is None else ends) - nh
        if len(flows) == 1:
            return np.arange(first[0], first[0] + nh[0])
        return np.repeat(first - (np.cumsum(nh) - nh), nh) + np.arange(int(nh.sum()))

    def _keep(self, keep: np.ndarray, seed: bool = True) -> None:
        """Keep the flows where `keep` is True (order preserved); the links of the others
        lose a flow (and are re-solved at the next solve if `seed`)."""
        drop = np.flatnonzero(~keep)
        nh = self._nh[drop]
        ends = np.cumsum(self._nh)[drop]  # where each dropped flow's entries end
        de = self._entries(drop, ends)
        gone = self._flat[de]
        np.subtract.at(self._occ, gone, 1)
        if seed:
            lab = self._flab[drop]
            self._seeds.append(gone)
            self._gone.append(lab)
            # a flow no solve saw (label -1; a split ring's may carry a rate) is not in
            # the loads: it takes nothing off them
            rate = np.where(lab >= 0, self._rate[drop], 0.0)
            self._gone_links.append((gone, np.repeat(rate, nh), np.repeat(lab, nh)))
        if self._new:
            self._new -= int(np.count_nonzero(drop >= len(keep) - self._new))
        if len(drop) <= self.SLIDE_MAX:  # a few rows: slide the stretches between them
            lo = drop.tolist()
            hi = [x + 1 for x in lo]
            self._slide("_flat", (ends - nh).tolist(), ends.tolist(), len(self._flat))
            n = len(keep)
            for name, _ in _COLUMNS:
                self._slide(name, lo, hi, n)
            return
        # rows before the first one dropped stay where they are: only the rest moves
        first = int(drop[0])
        efirst = int(de[0]) if len(de) else len(self._flat)
        ent = np.ones(len(self._flat) - efirst, bool)
        ent[de - efirst] = False
        self._compact("_flat", efirst, np.flatnonzero(ent) + efirst)
        idx = np.flatnonzero(keep)
        for name, _ in _COLUMNS:
            self._compact(name, first, idx[first:])

    SLIDE_MAX = 16  # flows removed from which the table is compacted by one gather

    def _slide(self, name: str, lo: list, hi: list, length: int) -> None:
        """Remove rows [lo[j], hi[j]) (ascending, disjoint) from column `name` of `length`
        rows, moving each stretch between them left by a slice copy (numpy copies
        overlapping slices correctly): the rows before the first cut stay put."""
        if not lo:
            return
        buf = self._buffers[name]
        out = lo[0]
        for j, a in enumerate(hi):
            b = lo[j + 1] if j + 1 < len(lo) else length
            if b > a:
                buf[out : out + b - a] = buf[a:b]
                out += b - a
        setattr(self, name, buf[:out])

    def _compact(self, name: str, first: int, rest: np.ndarray) -> None:
        """Keep rows :first and then the rows `rest` (ascending, all >= first)."""
        buf = self._buffers[name]
        buf[first : first + len(rest)] = buf[rest]  # the gather copies before writing
        setattr(self, name, buf[: first + len(rest)])

    def _deliver_fast(self, done: np.ndarray) -> None:
        """Deliver the flows at indices `done`: at once without latency, else one timer per
        distinct arrival time (the order of delivery within it kept)."""
        lat, gid, idx = self._lat[done], self._gid[done], self._idx[done]
        self._land_later(self.env.now + lat, lat, gid, idx)

    def _land_later(self, arrival, delay, gid, idx):
        """Land transfers (gid, idx) at `arrival` (delay: arrival - now as a timeout sees
        it; None: schedule at the absolute time)."""
        now = self.env.now
        if len(arrival) == 1 or (arrival == arrival[0]).all():
            runs = [np.arange(len(arrival))]
        else:  # one run per distinct arrival, in order of first appearance, order kept within
            _, first, inv = np.unique(arrival, return_index=True, return_inverse=True)
            perm = np.argsort(inv, kind="stable")
            runs = np.split(perm, np.cumsum(np.bincount(inv))[:-1])
            runs = [runs[j] for j in np.argsort(first)]
        for ks in runs:
            t = float(arrival[ks[0]])
            g, i = gid[ks], idx[ks]
            if t <= now:
                self._land(g, i)
            elif delay is not None:
                self.env.timeout(float(delay[ks[0]])).callbacks.append(
                    lambda _e, g=g, i=i: self._land(g, i)
                )
            else:
                at(self.env, t, lambda _e, g=g, i=i: self._land(g, i))

    def _land(self, gids, idxs) -> None:
        """Transfers (group id, index) arrive now."""
        now = self.env.now
        if self._per_record:  # a subclass delivers record by record
            for g, i in zip(gids.tolist(), idxs.tolist(), strict=True):
                grp = self._groups[g]
                rec = grp.record(i)
                self._deliver(rec, grp if grp.events is None else grp.events[i])
                grp.ends[i] = rec.end
            return
        for g in dict.fromkeys(gids.tolist()):
            grp = self._groups[g]
            sel = idxs if gids[0] == gids[-1] == g else idxs[gids == g]
            grp.ends[sel] = now
            self.bytes_delivered = seq_sum(self.bytes_delivered, grp.nb[sel])
            self.in_flight -= len(sel)
            grp.pending -= len(sel)
            if grp.events is not None:
                for i in sel.tolist():
                    grp.events[i].succeed(grp.record(i))
            if grp.pending == 0:
                del self._groups[g]
                if grp.done is not None:
                    grp.done.succeed(Records(grp))

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

    check_solves = False  # tests: compare every solve with the whole-table one, bit for bit

    def _solve_changed(self) -> np.ndarray | None:
        """Max-min rates of the flows in the connected components (links joined by the
        flows crossing them; infinite links join nothing, as they never bind) that changed
        since the last solve: those of departed flows and those joined by new flows. The
        other flows keep their rates.

        The allocation decomposes over components, and max_min_rates computes each
        component with the same floats whether alone or with others (each of its steps
        reads one link's own flows and their links; the sub-table keeps the flows' order,
        hence each link's order of sums), so the rates are those of a whole-table solve,
        bit for bit. Components are found by labels (`_relabel`): every component lies
        within one label, so the flows of the changed labels are a union of components.
        Flows with an infinite rate are delivered at once. Returns the links whose load
        may have changed, or None when no flow is left."""
        seeds = self._seeds[0] if len(self._seeds) == 1 else np.concatenate(self._seeds or [[]])
        seeds = seeds.astype(np.int64, copy=False)  # links, repeats possible
        gone = np.concatenate(self._gone) if self._gone else np.zeros(0, np.int64)
        gone_links = self._gone_links
        self._seeds, self._gone, self._gone_links = [], [], []
        new, self._new = self._new, 0
        self._solved_tail = -1  # flows at the end of the table solved alone, if >= 0
        alone = self._solve_alone(seeds, new)
        if alone is not False:
            return alone
        gone = gone[gone >= 0]
        if not new and len(gone) and all(x in self._capped for x in gone.tolist()):
            # flows left components in which every flow ran at its rate cap: the shares
            # of their links only grew, so each flow still gets its cap (see _round_one)
            self.resolved = 0
            self.capped_skips += 1
            if self.check_solves:
                self._check_against_full()
            self._stale = np.zeros(0, np.int64)
            return np.unique(seeds)
        dirty, changed = self._dirty(gone, new)
        idx = np.flatnonzero(dirty)
        self.resolved = n = len(idx)
        if not n:  # the changed links lost their last flows
            self._stale = idx
            return np.unique(seeds)
        if n >= self.above_min:
            # the departed flows' entries (links, rates, labels), joined once for both
            gone_e = (
                tuple(np.concatenate([x[j] for x in gone_links]) for j in range(3))
                if gone_links
                else None
            )
            above = self._solve_above(idx, new, gone_e)
            if above is not None:
                return self._after_above(*above, idx, changed, new, seeds, gone_e)
        links = self._flat[self._entries(idx)]
        one = self._try_round_one(idx, links)
        capped = one is not None and one[1]
        solved = idx  # the flows whose rates may have changed
        if one is not None:
            self.round_one_solves += 1
            self.capped_solves += capped
            self._rate[idx] = one[0]
        elif n == len(self._rem):
            self.full_solves += 1
            rows, cols, capacity = self._incidence_fast()
            self._rate[:] = max_min_rates(rows, cols, n, capacity)
        else:
            self.component_solves += 1
            self._rate[idx] = self._solve_flows(idx)
        first = self._labels
        self._relabel(idx, links)
        if capped:
            self._capped.update(range(first, self._labels))
        if self.check_solves:
            self._check_against_full()
        mark = self._mark
        mark[seeds] = True
        mark[links] = True
        touched = np.flatnonzero(mark)
        mark[touched] = False
        return touched if self._land_infinite(solved) else None

    def _land_infinite(self, solved: np.ndarray) -> bool:
        """Deliver at once the flows of `solved` whose rate is infinite (over infinitely
        fast links only), else mark `solved` (new rates) to check again at this instant.
        False when no flow is left."""
        inf = np.zeros(len(self._rem), bool)
        inf[solved] = np.isinf(self._rate[solved])
        if inf.any():
            self._deliver_fast(np.flatnonzero(inf))
            self._keep(~inf, seed=False)
            return len(self._rem) > 0
        self._stale = solved
        return True

    def _solve_alone(self, seeds: np.ndarray, new: int):
        """The common case of point-to-point traffic, without scanning the table: the
        `new` flows at the end of the table each alone on their links (so each is a
        component: its rate is the least capacity on its path, max_min_rates' result for
        one flow) and the other changed links (`seeds`, repeats allowed: a repeat of a
        new flow's link only sends this to the general path) without flows. Sets their rates,
        labels, loads and the peak utilisation; returns no links left to update (None: no
        flow left), or False when the changed links hold anything else (the general
        path)."""
        occ = self._occ
        if new:
            nh = self._nh[-new:]
            tail = self._flat[-int(nh.sum()) :]
            if (occ[tail] != 1).any() or np.count_nonzero(occ[seeds]) != len(tail):
                return False
        elif occ[seeds].any():
            return False
        self._load[seeds] = 0.0
        self._busy = None
        self.resolved = new
        n = len(self._rem)
        self._stale = np.arange(n - new, n)
        if not new:
            self._solved_tail = 0
            return seeds[:0]
        self.alone_solves += 1
        caps = self.capacity[tail]
        rate = np.minimum.reduceat(caps, np.cumsum(nh) - nh) if new > 1 else caps.min(keepdims=True)
        rate = np.minimum(rate, self._maxr[-new:])
        self._rate[-new:] = rate
        labels = np.arange(self._labels, self._labels + new)
        self._labels += new
        self._flab[-new:] = labels
        self._llab[tail] = labels if new == 1 else np.repeat(labels, nh)
        if self.check_solves:
            self._check_against_full()
        sending = np.isfinite(rate)
        links = tail if sending.all() else tail[np.repeat(sending, nh)]
        self._load[links] = np.repeat(rate[sending], nh[sending])
        if not self._nan_util:
            fin = links[self._finite[links]]
            if len(fin):
                util = float((self._load[fin] / self.capacity[fin]).max())
                self.max_utilisation = max(self.max_utilisation, util)
        if not sending.all():  # flows over infinitely fast links only: done at once
            inf = np.zeros(len(self._rem), bool)
            inf[len(inf) - new :] = ~sending
            self._deliver_fast(np.flatnonzero(inf))
            self._keep(~inf, seed=False)
            self._stale = None
            if not len(self._rem):
                return None
        else:
            self._solved_tail = new
        return seeds[:0]

    above_min = 1024  # dirty flows from which _solve_above is tried (tests lower it)
    ABOVE_MARGIN = 1e-9  # relative: flows this close below the level are re-solved too
    ABOVE_CHECK_RTOL = 1e-11  # check_solves: rates after solves above a level, vs whole
    RELOAD_EVERY = 1024  # solves above a level between loads summed afresh (bounds drift)
    REACH_STEPS = 12  # steps of growing the reached components before solving them all

    def _solve_above(self, idx, new: int, gone_e):
        """Max-min rates of the dirty flows `idx` (a union of components; the last `new`
        are new; `gone_e`: the departed flows' entries as links, rates and labels, or
        None) by re-solving only those whose rates can change: (those flows, their
        rates, their distinct links, each entry's index among those links, links per flow,
        what the other flows take on each link), or None when that is most of them.

        Progressive filling raises every flow together and freezes a link's flows when
        it saturates. Below the level L it runs exactly as before the change, where L is
        the least of: the level departed flows can reach (`_departure_level`), and for each
        new flow its rate cap and capacity / flows on each of its links (the new flow adds
        at most t to a link's load at level t, and the others at most t each, so the link
        cannot saturate below that). So every flow below L keeps its rate, and the others
        get the max-min rates of the same problem with each link's capacity less what the
        flows below L take on it (the filling continued from L). What they take is the
        link's load at the last solve less the rates of the re-solved and departed flows on
        it. The rates equal a whole solve's to round-off (the residual capacities are
        summed in another order), not bit for bit."""
        n = len(self._rem)
        gl, ge, gb = gone_e if gone_e is not None else (None, None, None)
        level = dep = np.inf if gl is None else self._departure_level(gl, ge, gb)
        if new:
            nh = self._nh[n - new :]
            if not nh.all():
                return None
            tail = self._flat[len(self._flat) - int(nh.sum()) :]
            share = self.capacity[tail] / self._occ[tail]  # inf on infinite links
            starts = np.cumsum(nh) - nh
            low = np.minimum.reduceat(share, starts) if new > 1 else share.min(keepdims=True)
            level = min(level, float(np.minimum(low, self._maxr[n - new :]).min()))
        if not level > 0:  # 0 or nan: nothing to gain
            return None

        def at_or_above(level):  # the flows to re-solve: new ones, and those near or above
            above = self._rate[idx] >= level * (1 - self.ABOVE_MARGIN)
            above[len(idx) - new :] = True
            return above, int(np.count_nonzero(above))

        above, k = at_or_above(level)
        if 2 * k > len(idx) and new:  # a second look: the rates on the new flows' links
            tight = min(dep, self._new_flow_level(tail))
            if tight > level:
                above, k = at_or_above(tight)
                self.tight_levels += 2 * k <= len(idx)
        if 2 * k > len(idx):
            return None
        solved = idx[above]
        nh = self._nh[solved]
        links = self._flat[self._entries(solved)]
        prev = self._rate[solved]
        old = prev  # new flows take nothing yet (split ring flows have rates)
        if new:
            old = old.copy()
            old[k - new :] = 0.0
        old = np.repeat(old, nh)
        uniq, rows = self._renumber(links)
        taken = np.bincount(rows, weights=old, minlength=len(uniq))
        seeds = rows[:0]
        if gl is not None:  # the departed flows' rates on these links
            mark, pos = self._mark, self._pos
            mark[uniq] = True
            pos[uniq] = np.arange(len(uniq))
            on = mark[gl]
            mark[uniq] = False
            seeds = pos[gl[on]]
            taken += np.bincount(seeds, weights=ge[on], minlength=len(uniq))
        below = np.maximum(self._load[uniq] - taken, 0.0)  # what the kept flows take
        with np.errstate(invalid="ignore"):  # inf - inf: an infinite link stays infinite
            capacity = np.where(
                self._finite[uniq],
                np.maximum(self.capacity[uniq] - below, 0.0),
                self.capacity[uniq],
            )
        maxr = self._maxr[solved]
        capped = np.flatnonzero(maxr < np.inf)
        ext, entries = nh, rows
        if len(capped):
            self.above_capped += 1
            entries, ext = self._with_private_links(rows, nh, capped, len(uniq))
            capacity = np.concatenate([capacity, maxr[capped]])
        cols = np.repeat(np.arange(k), ext)
        reach = self._reach(rows, nh, self._finite[uniq], seeds, new)
        if reach is None:
            rate = max_min_rates(entries, cols, k, capacity)
        else:  # the other components of the residual problem keep their rates
            self.reach_solves += 1
            rate = prev.copy()
            sub = reach[cols]
            rate[reach] = max_min_rates(
                entries[sub],
                (np.cumsum(reach) - 1)[cols[sub]],
                int(np.count_nonzero(reach)),
                capacity,
            )
        return solved, rate, uniq, rows, nh, below

    def _reach(self, rows, nh, finite, seeds, new: int):
        """Which of the flows to re-solve above a level (their entries `rows`, indices into
        their links; `nh` per flow; `finite`: which of those links bind) share a component
        of the residual problem with a changed link (`seeds`: the departed flows' links,
        repeats allowed) or one of the `new` flows (the last ones): None when most do.

        The residual problem decomposes over its components (links joined by the flows
        crossing them, infinite links joining nothing). One that holds no changed link
        and no new flow was a component of the problem before the change too, with the
        same flows and the same residual capacities (no departed flow crossed its links),
        so its flows keep the rates of the last solve (the max-min rates of the problem
        above the same level then). Found by growing the reached set from the seeds, one
        pass over the entries per step (None after REACH_STEPS steps)."""
        k = len(nh)
        if not len(rows) or not nh.all():
            return None
        m = len(finite)
        r = np.where(finite[rows], rows, m)  # slot m: never marked (joins nothing)
        on = np.zeros(m + 1, bool)
        on[seeds] = True
        starts = np.cumsum(nh) - nh
        reach = np.zeros(k, bool)
        reach[k - new :] = True
        grown, count = reach, new  # the flows reached by the last step
        for _ in range(self.REACH_STEPS):
            if count:
                on[r[np.repeat(grown, nh)]] = True
            on[m] = False
            hit = np.logical_or.reduceat(on[r], starts)
            hit &= ~reach
            more = int(np.count_nonzero(hit))
            if not more:
                return reach
            count += more
            if 2 * count > k:
                return None
            reach |= hit
            grown = hit
        return None  # still growing: likely most of them, and each step is a pass

    def _new_flow_level(self, tail: np.ndarray) -> float:
        """A level below which the new flows (the last ones, each crossing some link;
        `tail`: their entries, the last of `_flat`) saturate no link, from the rates of the flows already on their links: on a finite
        link l with new flows n_l and old flows of rates r_1 <= ... <= r_k, the load at
        level t is at most f(t) = sum_i min(r_i, t) + n_l t while the old flows fill as
        before (the new ones at most t each, less when capped), so l holds until f(t) =
        c_l. Each line g_j(t) = r_1 + ... + r_j + (k - j + n_l) t lies on or above f
        (min(r_i, t) <= r_i and <= t), and on f between r_j and r_(j+1), so the root of
        f is the largest of the lines' roots (c_l - r_1 - ... - r_j) / (k - j + n_l);
        j = 0 is capacity / flows, the first bound of `_solve_above`. Below the least
        such level over the new flows' links (and the departures' level) the filling of
        the old flows runs as before, by induction over the filling's events: a link
        without new flows sees the same loads, and one with new flows that saturated
        before at t would make f(t) >= c_l. The new flows' rate caps only lower f. The
        roots are lowered by a bound on their sums' rounding: a root a hair too high would
        leave flows just below it unsolved (the solve's margin is 1e-9 relative)."""
        e_old = len(self._flat) - len(tail)
        tail = tail[self._finite[tail]]
        if not len(tail):
            return np.inf
        links, fresh = np.unique(tail, return_counts=True)
        mark = self._mark
        mark[links] = True
        pos = np.flatnonzero(mark[self._flat[:e_old]])  # the old flows' entries there
        mark[links] = False
        cap = self.capacity[links]
        level = cap / fresh  # j = k: every old flow frozen below the root
        if len(pos):
            flow = np.searchsorted(np.cumsum(self._nh), pos, side="right")
            lk, r = np.searchsorted(links, self._flat[pos]), self._rate[flow]
            order = np.lexsort((r, lk))  # by link, rates ascending within it
            lk, r = lk[order], r[order]
            k = np.bincount(lk, minlength=len(links))
            first = np.cumsum(k) - k  # each link's first entry
            j = np.arange(len(r)) - first[lk]  # rank of the rate on its link
            cs = np.concatenate(([0.0], np.cumsum(r)))  # cs[i]: the rates before entry i
            below = cs[:-1] - cs[first][lk]  # r_1 + ... + r_j on its link
            # one running sum crosses every link's rates, so its rounding (i additions of
            # rates >= 0: at most i units of cs[i]) can dwarf a slow link's own rates:
            # each root is lowered by that bound, to stay below the exact one (j = 0 has
            # nothing to round); the sums per link from bincount round on their own scale
            eps = np.finfo(float).eps
            off = np.where(j > 0, (2 * np.arange(len(r)) + 2) * eps * cs[:-1], 0.0)
            total = np.bincount(lk, weights=r, minlength=len(links))
            level = (cap - total - ((k + 1) * eps * total + eps * cap)) / fresh
            np.maximum.at(
                level, lk, (cap[lk] - below - off - eps * cap[lk]) / (k[lk] - j + fresh[lk])
            )
        return float(level.min())

    def _departure_level(self, gl, ge, gb) -> float:
        """The least level at which departed flows change the filling (their entries: link,
        rate, label; label -1: a flow that left before any solve saw it, which changes
        nothing). A departed flow's link that did not saturate (load below capacity at the
        last solve) froze nothing, and without the flow it still does not; a saturated
        link froze its last flows at the highest rate on it, at least the departed flow's
        rate and at least capacity / flows (their mean), and without the flow it saturates
        later. So the filling runs as before up to the least such bound. (The highest rate
        on the link itself, one pass over the table away, gained nothing measurable: the
        departed flow is usually the highest.)"""
        keep = gb >= 0
        if not keep.all():
            gl, ge = gl[keep], ge[keep]
        cap = self.capacity[gl]
        sat = self._finite[gl] & (self._load[gl] >= cap * (1 - self.ABOVE_MARGIN))
        if not sat.any():
            return np.inf
        gl, ge, cap = gl[sat], ge[sat], cap[sat]
        _, inv, count = np.unique(gl, return_inverse=True, return_counts=True)
        before = self._occ[gl] + count[inv.reshape(-1)]  # at least the flows there then
        return float(np.maximum(ge, cap / before).min())

    def _after_above(self, solved, rate, uniq, rows, nh, below, idx, changed, new, seeds, gone_e):
        """Book a solve above a level: rates, labels and loads, each updated for what
        changed only (no pass over the table). Labels: the dirty flows keep their one
        label, new flows take it (several labels are merged into a fresh one). Loads: a
        re-solved link carries what the kept flows take plus the new rates; another link
        of a departed flow loses the departed rates (0 once it holds no flow). These sums
        are in another order than a whole-table update's, so they agree to round-off."""
        self.above_solves += 1
        self.resolved = len(solved)
        self._rate[solved] = rate
        n = len(self._rem)
        if len(changed) == 1:
            lab = int(changed[0])
        else:
            lab = self._labels
            self._labels += 1
            self._flab[idx] = lab
            if len(changed):
                self._llab[np.isin(self._llab, changed)] = lab
        self._capped.difference_update(changed.tolist())
        if new:
            tail = self._flat[len(self._flat) - int(self._nh[n - new :].sum()) :]
            self._flab[n - new :] = lab
            self._llab[tail[self._finite[tail]]] = lab
        if self.check_solves:
            self._check_against_full()
        load = self._load
        fin_rate = np.where(np.isfinite(rate), rate, 0.0)
        load[uniq] = below + np.bincount(rows, weights=np.repeat(fin_rate, nh), minlength=len(uniq))
        touched = uniq
        if self.above_solves % self.RELOAD_EVERY == 0:  # now and then afresh: booked sums drift
            rate_e = np.repeat(np.where(np.isfinite(self._rate), self._rate, 0.0), self._nh)
            load[:] = np.bincount(self._flat, weights=rate_e, minlength=len(load))
            gone_e = None  # their rates are gone from these sums already
        if gone_e is not None:
            gl, ge, _ = gone_e
            mark = self._mark
            mark[uniq] = True
            other = ~mark[gl]
            mark[uniq] = False
            gl, ge = gl[other], ge[other]
            if len(gl):
                np.subtract.at(load, gl, ge)
                gl = np.unique(gl)
                load[gl] = np.where(self._occ[gl] > 0, np.maximum(load[gl], 0.0), 0.0)
                touched = np.concatenate([uniq, gl])
        self._busy = None
        if not self._nan_util:
            fin = touched[self._finite[touched]]
            if len(fin):
                util = float((load[fin] / self.capacity[fin]).max())
                self.max_utilisation = max(self.max_utilisation, util)
        return seeds[:0] if self._land_infinite(solved) else None

    def _try_round_one(self, idx: np.ndarray, links: np.ndarray):
        """`_round_one`, except on big sets after it failed on big sets: a failed try costs
        about a third of a solve there, so after a failure the next big sets skip it,
        twice as many each time (up to 64), until it succeeds again. Either way the rates
        are the same; this only chooses the cheaper way."""
        if len(links) <= 2048:
            return self._round_one(idx, links)
        if self._r1_wait:
            self._r1_wait -= 1
            return None
        one = self._round_one(idx, links)
        self._r1_backoff = 0 if one is not None else min(2 * self._r1_backoff or 1, 64)
        self._r1_wait = self._r1_backoff
        return one

    def _round_one(self, idx: np.ndarray, links: np.ndarray):
        """max_min_rates of the flows `idx` (a union of components; `links`: their
        entries) when its first round freezes them all, computed without building their
        incidence: (rates, whether every flow runs at its rate cap), or None when some
        flow would need another round. The same floats as max_min_rates: each link's share
        is capacity / flows on it (all of them among these flows; a rate cap is a private
        link of share cap / 1); a flow's tightest share is the least over its links; a
        link is locally minimal unless one of its flows has a tighter one (infinite links
        take no part); a flow freezes at its tightest share if one of its links is."""
        maxr = self._maxr[idx]
        nh = self._nh[idx]
        share = self.capacity[links] / self._occ[links]  # inf on infinite links
        starts = np.cumsum(nh) - nh
        tight = np.minimum.reduceat(share, starts) if len(idx) > 1 else share.min(keepdims=True)
        tight = np.minimum(tight, maxr)
        if not np.isfinite(tight).all():
            return None  # a flow over infinite links only (rare): the solver's way
        fin = self._finite[links]
        beaten = links[fin & (np.repeat(tight, nh) < share)]  # links not locally minimal
        mark = self._mark
        mark[beaten] = True
        local = fin & ~mark[links]
        mark[beaten] = False
        capped = tight == maxr  # the private link is locally minimal
        if not (np.logical_or.reduceat(local, starts) | capped).all():
            return None
        return tight, bool(capped.all())

    def _dirty(self, gone: np.ndarray, new: int) -> tuple[np.ndarray, np.ndarray]:
        """The flows whose rates may have changed: those sharing a label with a departed
        flow (`gone`: their labels) or with a flow on a finite link of a new flow, and
        the `new` flows at the end of the table. A link's label is that of its flows (or
        a stale one once they left: then at worst a few more flows are re-solved). Also
        returns the labels that changed."""
        n = len(self._rem)
        labels = [gone]
        if new:
            tail = self._flat[len(self._flat) - int(self._nh[n - new :].sum()) :]
            labels.append(self._llab[tail[self._finite[tail]]])
        changed = np.unique(np.concatenate(labels))
        changed = changed[changed >= 0]
        if len(changed) == 1:
            dirty = self._flab == changed[0]
        elif len(changed):
            dirty = np.isin(self._flab, changed)
        else:
            dirty = np.zeros(n, bool)
        dirty[n - new :] = True
        return dirty, changed

    relabel_entries = 4096  # re-split up to this many entries into components, exactly

    def _relabel(self, idx: np.ndarray, links: np.ndarray) -> None:
        """New labels for the flows `idx` (a union of components; `links`: their entries)
        and their finite links: one per component, found by propagating the least flow
        number over shared links, when they are few; else one label for them all (still
        holding every component whole; the labels are re-split when a later change
        re-solves a part small enough)."""
        k, base = len(idx), self._labels
        fin = self._finite[links]
        lab = None
        if 1 < k and len(links) <= self.relabel_entries:
            cols = np.repeat(np.arange(k), self._nh[idx])[fin]
            uniq, inv = self._renumber(links[fin])
            lab = np.arange(k)
            for _ in range(64):
                on_link = np.full(len(uniq), k)
                np.minimum.at(on_link, inv, lab[cols])
                nxt = lab.copy()
                np.minimum.at(nxt, cols, on_link[inv])
                if np.array_equal(nxt, lab):
                    break
                lab = nxt
            else:
                lab = None
        if lab is None:  # one label
            self._flab[idx] = base
            self._llab[links[fin]] = base
            self._labels += 1
            return
        roots, flab = np.unique(lab, return_inverse=True)
        self._flab[idx] = base + flab.reshape(-1)
        self._llab[uniq] = base + np.searchsorted(roots, on_link)
        self._labels += len(roots)

    def _renumber(self, links: np.ndarray):
        """np.unique(links, return_inverse=True): the distinct links in order and each
        entry's index among them; by marking the links (no sort: 4-5x faster on the tens
        of thousands of entries of a big component) unless they are few."""
        if 8 * len(links) < len(self._mark):
            uniq, rows = np.unique(links, return_inverse=True)
            return uniq, rows.reshape(-1).astype(np.int64, copy=False)
        mark, pos = self._mark, self._pos
        mark[links] = True
        uniq = np.flatnonzero(mark)
        mark[uniq] = False
        pos[uniq] = np.arange(len(uniq))
        return uniq, pos[links]

    def _solve_flows(self, idx: np.ndarray) -> np.ndarray:
        """max_min_rates of the flows `idx` (a union of components) alone, over their own
        links renumbered (which changes no float)."""
        nh = self._nh[idx]
        links = self._flat[self._entries(idx)]
        maxr = self._maxr[idx]
        capped = np.flatnonzero(maxr < np.inf)
        if len(idx) == 1 and len(links) <= 8 and len(set(links.tolist())) == len(links):
            # one flow: every link's share is its capacity, so the rate is the least one
            caps = self.capacity[links]
            if len(capped):
                caps = np.append(caps, maxr[0])
            caps = caps[np.isfinite(caps)]
            return np.array([caps.min()]) if len(caps) else np.array([np.inf])
        uniq, rows = self._renumber(links)
        capacity = self.capacity[uniq]
        if len(capped):
            rows, ext = self._with_private_links(rows, nh, capped, len(uniq))
            capacity = np.concatenate([capacity, maxr[capped]])
        else:
            ext = nh
        cols = np.repeat(np.arange(len(idx)), ext)
        return max_min_rates(rows, cols, len(idx), capacity)

    @staticmethod
    def _with_private_links(flat, nh, capped, n):
        """The entries with each capped flow's private link (n, n+1, ...) after its path."""
        ext = nh.copy()
        ext[capped] += 1
        ends = np.cumsum(ext)  # the private link is the last entry of a capped flow
        rows = np.empty(int(ends[-1]) if len(ends) else 0, np.int64)
        mask = np.ones(len(rows), bool)
        mask[ends[capped] - 1] = False
        rows[mask] = flat
        rows[~mask] = n + np.arange(len(capped))
        return rows, ext

    def _update_loads(self, touched: np.ndarray) -> None:
        """Recompute the load of the links `touched` (the flows on each summed in table
        order, as link_loads sums them) and the peak utilisation: the other links carry
        the same flows at the same rates as at the last solve, so their load is unchanged
        and their utilisation already counted."""
        n_links, n_entries = len(self.links), len(self._flat)
        rate_e = np.repeat(self._rate, self._nh)
        if len(touched) == n_links or (4 * len(touched) > n_entries and n_links < 3 * n_entries):
            # many links: all of them at once is cheaper (the same sums for the others)
            self._load = np.bincount(self._flat, weights=rate_e, minlength=n_links)
        else:
            on = self._mark
            on[touched] = True
            sel = on[self._flat]
            on[touched] = False
            pos = self._pos
            pos[touched] = np.arange(len(touched))
            self._load[touched] = np.bincount(
                pos[self._flat[sel]], weights=rate_e[sel], minlength=len(touched)
            )
        self._busy = None
        if self._nan_util:
            return
        fin = touched[self._finite[touched]]
        if len(fin):
            util = float((self._load[fin] / self.capacity[fin]).max())
            self.max_utilisation = max(self.max_utilisation, util)

    def _check_against_full(self) -> None:
        rows, cols, capacity = self._incidence_fast()
        full = max_min_rates(rows, cols, len(self._rem), capacity)
        got = self._rate
        same = (full == got) | (np.isnan(full) & np.isnan(got))
        if not self.above_solves:
            assert same.all(), ("component solve differs from the whole table", full, got)
            return
        # once flows were solved above a level, rates agree with a whole solve to round-off
        with np.errstate(invalid="ignore"):
            close = same | (np.abs(full - got) <= self.ABOVE_CHECK_RTOL * np.abs(full))
        assert close.all(), ("solve above a level differs from the whole table", full, got)

    def _check_loads(self, peak: float) -> None:
        """The loads and the peak utilisation the whole-table update gives, bit for bit (to
        round-off once solves above a level booked loads)."""
        rows, cols, _ = self._incidence_fast()
        real = rows < len(self.links)
        load = link_loads(rows[real], cols[real], self._rate, len(self.links))
        with np.errstate(divide="ignore", invalid="ignore"):
            util = np.where(np.isfinite(self.capacity), load / self.capacity, 0.0)
        want = max(peak, float(util.max(initial=0.0)))
        if not self.above_solves:
            assert np.array_equal(load, self._load), "loads differ from the whole-table update"
            assert want == self.max_utilisation, (want, self.max_utilisation)
        else:  # loads booked by _after_above: round-off of the largest sum on the link
            # (on an infinite link only whether it is busy counts, and a departed flow far
            # faster than the rest leaves round-off that its current load does not scale)
            scale = np.maximum(
                np.maximum(load, self._load), np.where(self._finite, self.capacity, np.inf)
            )
            bad = np.abs(load - self._load) > self.ABOVE_CHECK_RTOL * scale
            assert not bad.any(), (
                "loads differ from the whole-table update",
                load[bad],
                self._load[bad],
            )
            assert (load > 0).sum() == (self._load > 0).sum(), "a link busy in one update only"
            assert abs(want - self.max_utilisation) <= self.ABOVE_CHECK_RTOL * want
        occ = np.bincount(self._flat, minlength=len(self.links))
        assert np.array_equal(occ, self._occ), "flows per link miscounted"
        # every flow labelled, and the flows on a finite link share its label
        fin = self._finite[self._flat]
        cols = np.repeat(np.arange(len(self._nh)), self._nh)
        assert (self._flab >= 0).all(), "a flow without a component label"
        assert np.array_equal(self._flab[cols[fin]], self._llab[self._flat[fin]]), "labels"

    def _busy_links(self) -> np.ndarray:
        if self._busy is None:
            self._busy = np.flatnonzero(self._load > 0)
        return self._busy

    def _incidence_fast(self):
        """As `_incidence`: the flat routes, each capped flow's private link after its path."""
        n, nh = len(self.links), self._nh
        capped = np.flatnonzero(self._maxr < np.inf)
        if not len(capped):
            return self._flat, np.repeat(np.arange(len(nh)), nh), self.capacity
        rows, ext = self._with_private_links(self._flat, nh, capped, n)
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
