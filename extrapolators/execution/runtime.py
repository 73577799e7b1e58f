"""Runs task streams as SimPy processes: one process per (GPU, stream), tasks in order.

Streams are iterators, pulled one task at a time as the simulation unfolds, so N GPUs
never hold N copies of the trace. Compute takes its modelled duration; collectives
meet at a rendezvous (meetings.py) and then the communication model
(extrapolators.communication.base) runs them through the Network; Send/Recv
and Signal/Wait connect streams. Consecutive compute tasks of a stream run as one event at
the end of the run, at the time per-task events would reach (the same sequential float
sums), so long streams cost one SimPy event per run, not per task. A mode may emit a
ComputeRun (the computes between two other tasks, built once and shared by every GPU): it
is timed by one cumsum and logged as one block (extrapolators.execution.timeline_log: the timeline is
built from the log when asked for, without a tuple per task). With a `contention`
(extrapolators.execution.contention) a run's end moves while its GPU communicates, and
its instants are mapped through the time it kept before they are logged. When the events
run out, `check_finished` names every stream still waiting (a deadlock) instead of
returning a short iteration.
"""

from __future__ import annotations

import math
from heapq import heappush

import numpy as np
import simpy
from simpy.core import NORMAL

from extrapolators.execution.contention import Contention
from extrapolators.execution.meetings import Meetings
from extrapolators.execution.symmetry import SymmetryBroken, Twins
from extrapolators.execution.tasks import (
    Collective,
    Compute,
    ComputeRun,
    Iteration,
    Recv,
    Send,
    Signal,
    Wait,
    WaitSome,
)
from extrapolators.execution.timeline_log import COLUMNS, Block, TimelineLog
from triosim.common.errors import DeadlockError, SimulationError

__all__ = ["COLUMNS", "Runtime"]


class Runtime:
    """Runs the streams (`start`), one SimPy process each (`_run`); collectives meet
    through meetings.Meetings; the timeline and the deadlock check come from what ran."""

    def __init__(
        self,
        env: simpy.Environment,
        network,
        comm,
        compute_scale: dict | None = None,
        symmetry=None,
        host=None,
        noise: dict | None = None,
        contention: Contention | None = None,
    ):
        self.env = env
        # extrapolators.execution.contention.Contention: compute slowed while its GPU
        # communicates, or None (overlap is free)
        self.contention = contention
        if contention is not None:
            contention.at = self._at
        # GPU -> n -> n factors on its next n computes (heterogeneity.op_cv), or None
        self.noise = noise
        # perfmodel.host.HostModel (launch_latency, comm_cost) or None: each GPU's host
        # issues its operators in order, `_clock[gpu]` the instant it finished the last
        self.host = host
        self._clock: dict = {}
        self.network = network
        self.comm = comm  # a CommModel: runs every collective
        self.compute_scale = compute_scale or {}  # GPU -> slow-down of its compute
        self._log: list = []  # timeline rows (tuples) and Blocks, in the order they ended
        self._events: dict[str, simpy.Event] = {}
        self._waiting: dict[tuple, object] = {}  # (gpu, stream) -> task in progress
        self._procs: dict[tuple, simpy.Process] = {}
        self._last_acc: dict[int, tuple] = {}  # id(ComputeRun) -> its last timing (reuse)
        self._sends: dict[tuple, object] = {}  # (src, dst, bytes) -> Network.batch of it
        # with symmetry: (src, dst, bytes) -> (Network.batch of it and its images, copies)
        self._send_groups: dict[tuple, tuple] = {}
        self._pairs: dict[tuple, int] = {}  # sends to and receives from images, counted
        self.tasks_started = 0
        self.tasks_finished = 0
        self.collective_bytes: dict[str, float] = {}
        # extrapolators.execution.symmetry.Symmetry: only its representatives' streams are started;
        # their collectives and sends also run for every image (see that module)
        self.symmetry = symmetry
        self.open_images = 0  # image operations started and not yet ended
        self.symmetry_skew = 0.0  # largest relative gap between an image's end and its rep's
        self._meetings = Meetings(self)  # where each collective's members meet

    def event(self, key: str) -> simpy.Event:
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = self.env.event()
        return ev

    def start(self, gpu, stream: str, tasks, iteration: int = 0, after=()) -> None:
        """Run `tasks` on (gpu, stream) as part of `iteration`, once the events named in
        `after` (see `done_key`) have fired; `done_key(...)` fires when they are done."""
        who = (gpu, stream, iteration)
        if who in self._procs:  # a second copy would hide the first from check_finished
            raise SimulationError(
                f"GPU {gpu} {stream} stream started twice (iteration {iteration})"
            )
        self._procs[who] = self.env.process(self._run(who, iter(tasks), tuple(after)))

    @staticmethod
    def done_key(gpu, stream: str, iteration: int) -> str:
        return f"done:{iteration}:{gpu}:{stream}"

    # -- execution ------------------------------------------------------------------------
    def _run(self, who, tasks, after):
        """One stream's process. Every task of every GPU passes through this loop: it stays
        one function with each kind of task inline (a generator per task would cost more
        than most tasks); what is rare or runs the network anyway is a call."""
        env, rows = self.env, self._log  # env._now: `now` without a property call per task
        gpu, stream, it = who
        here = who  # (gpu, stream, the current iteration): a block's `who`
        scale = self.compute_scale.get(gpu, 1.0)
        noise = self.noise.get(gpu) if self.noise else None
        contention = self.contention

        def log(kind, name, layer, phase, t0, t1, nbytes, key):  # one row of COLUMNS
            rows.append((gpu, stream, kind, name, layer, phase, t0, t1, nbytes, key, it, -1, -1))

        for key in after:
            self._waiting[who] = Wait(key)
            yield self.event(key)
        host = self.host
        if host is not None:  # an iteration starts with its host in step with its GPU
            self._clock[gpu] = max(self._clock.get(gpu, 0.0), env._now)
        pending = None  # a task pulled while collecting a run of computes
        while True:
            if pending is None:
                task = next(tasks, None)
                if task is None:
                    break
            else:
                task, pending = pending, None
            self.tasks_started += 1
            self._waiting[who] = task
            start = env._now
            if type(task) is Compute or type(task) is ComputeRun:
                run = [task]  # the computes that follow, up to the next other task
                for nxt in tasks:
                    if type(nxt) is not Compute and type(nxt) is not ComputeRun:
                        pending = nxt
                        break
                    run.append(nxt)
                if len(run) == 1 and type(task) is ComputeRun:  # most runs: inline (no
                    # generator per block; the same sums, events and rows as _compute_run)
                    count = len(task)
                    self.tasks_started += count - 1
                    if host is not None and task.hosts is not None:
                        acc, starts, t = self._hosted(gpu, task, start, scale, noise)
                    else:
                        (acc, t), starts = self._timed(task, start, scale, noise), None
                    if t != start:
                        if contention is None:
                            yield self._at(t)
                        else:
                            acc, starts = yield from self._slowed(gpu, acc, starts)
                    if here[2] != it:
                        here = (gpu, stream, it)
                    rows.append(Block(here, task, acc, starts))
                    self.tasks_finished += count
                    continue
                yield from self._computes((gpu, stream, it), run, scale, noise)
            elif type(task) is Collective:
                if host is not None:  # its launch costs the host (it does not wait for it)
                    self._clock[gpu] = self._clock.get(gpu, 0.0) + host.comm_cost
                if contention is not None:
                    contention.comm_started(gpu)
                meet = self._meetings.arrive(gpu, task)  # (a call, not a generator per collective)
                yield meet["done"]
                if contention is not None:
                    contention.comm_ended(gpu)
                begin, layer, phase = meet["begin"], task.layer, task.phase
                if begin > start:
                    log("wait", f"wait {task.op}", layer, phase, start, begin, 0.0, task.key)
                log("comm", task.op, layer, phase, begin, env._now, task.nbytes, task.key)
            elif type(task) is Send:
                if host is not None:
                    self._clock[gpu] = self._clock.get(gpu, 0.0) + host.comm_cost
                if contention is not None:
                    contention.comm_started(gpu)
                yield self._send(gpu, task)
                if contention is not None:
                    contention.comm_ended(gpu)
                self.event("p2p:" + task.key).succeed()
                if self.symmetry is not None and task.dst not in self.symmetry.orbits:
                    self.event(self._to_image(gpu, task.dst)).succeed()
                name, nbytes = f"send to {task.dst}", task.nbytes
                log("comm", name, task.layer, task.phase, start, env._now, nbytes, task.key)
            elif type(task) is Recv:
                if self.symmetry is not None and task.src not in self.symmetry.orbits:
                    yield self.event(self._from_image(task.src, gpu))
                else:
                    yield self.event("p2p:" + task.key)
                name = f"recv from {task.src}"
                log("wait", name, task.layer, task.phase, start, env._now, 0.0, task.key)
            elif type(task) is Signal:
                ev = self.event(task.key)
                if ev.triggered:
                    raise SimulationError(f"GPU {gpu} {stream}: signal {task.key!r} fired twice")
                ev.succeed()
            elif type(task) is Wait:
                if task.gpu is not None and self.symmetry is not None:
                    yield self.event(self._signal_of(task))
                else:
                    yield self.event(task.key)
                if env._now > start:
                    log("wait", "wait", "", "", start, env._now, 0.0, task.key)
            elif type(task) is WaitSome:  # (rare: a generator is cheap enough)
                yield from self._wait_some((gpu, stream, it), task, start)
            elif type(task) is Iteration:
                it = task.k
            else:
                raise SimulationError(f"GPU {gpu} {stream}: unknown task {task!r}")
            self.tasks_finished += 1
        self._waiting.pop(who, None)
        self.event(self.done_key(gpu, stream, it)).succeed()

    def _wait_some(self, who, task: WaitSome, start: float):
        """Until `task.count` of its events have fired; a row if that took time."""
        env = self.env
        events = [self.event(k) for k in task.keys]
        if sum(e.triggered for e in events) < task.count:
            n = task.count
            yield simpy.events.Condition(env, lambda _evs, done, n=n: done >= n, events)
        if env._now > start:
            gpu, stream, it = who
            name, keys = f"wait {task.count} of {len(events)}", ",".join(task.keys)
            self._log.append(
                (
                    gpu,
                    stream,
                    "wait",
                    name,
                    task.layer,
                    task.phase,
                    start,
                    env._now,
                    0.0,
                    keys,
                    it,
                    -1,
                    -1,
                )
            )

    def _computes(self, who, run, scale, noise=None):
        """A run of several pieces (Computes, ComputeRuns) that `_run` collected; counts
        them as tasks. Plain computes are timed one by one (the straightforward path, kept
        for streams that do not emit ComputeRuns): one event at the run's end, one row per
        task; a mix goes to `_compute_run`."""
        count, plain = _count(run)
        self.tasks_started += count - 1
        if self.host is not None and any(c.host for c in run if type(c) is Compute):
            plain = False  # timed with its host by _compute_run
        if not plain:
            yield from self._compute_run(who, run, scale, noise)
            self.tasks_finished += count - 1
            return
        gpu, stream, it = who
        start = self.env.now
        t, ends = start, []
        for c in run:
            if c.duration:
                d = c.duration * scale if scale != 1.0 else c.duration
                if noise is not None:
                    d = d * float(noise(1)[0])
                if d < 0:
                    raise ValueError(f"Negative delay {d}")  # as simpy's timeout
                t = t + d
            ends.append(t)
        if t != start:
            if self.contention is None:
                yield self._at(t)
            else:
                acc, _ = yield from self._slowed(gpu, np.array([start, *ends]), None)
                ends = acc[1:].tolist()
        t0 = start
        for c, t1 in zip(run, ends, strict=True):
            self._log.append(
                (
                    gpu,
                    stream,
                    "compute",
                    c.name,
                    c.layer,
                    c.phase,
                    t0,
                    t1,
                    0.0,
                    None,
                    it,
                    c.op_id,
                    c.mb,
                )
            )
            t0 = t1
        self.tasks_finished += count - 1

    def _compute_run(self, who, run, scale, noise=None):
        """Several pieces, ComputeRuns among them (rare: templates emit whole runs; a run
        of one ComputeRun is timed inline in `_run`): one ComputeRun for this GPU, with the
        same sequential sums as `_computes` (numpy's cumsum adds left to right; adding a
        zero duration leaves t as skipping it does), logged as one block."""
        start = self.env.now
        block = ComputeRun(
            c for piece in run for c in ((piece,) if type(piece) is Compute else piece.tasks)
        )
        if self.host is not None and block.hosts is not None:
            acc, starts, t = self._hosted(who[0], block, start, scale, noise)
        else:
            (acc, t), starts = _cumsum(block, start, scale, noise), None
        if t != start:
            if self.contention is None:
                yield self._at(t)
            else:
                acc, starts = yield from self._slowed(who[0], acc, starts)
        self._log.append(Block(who, block, acc, starts))

    def _slowed(self, gpu, acc, starts):
        """Wait out a run of computes timed as `acc` (its start, then every end) and
        `starts` (None: back to back) under contention; return its real (acc, starts):
        the timed arrays themselves where no change reached it."""
        if starts is not None:  # (operators that wait for their host)
            return (yield from self._hosted_slowed(gpu, acc, starts))
        entry = self.contention.compute(gpu, float(acc[0]), float(acc[-1]))
        yield entry[0]
        return (acc if entry[3] is None else entry[3].warp(acc)), None

    def _hosted_slowed(self, gpu, acc, starts):
        """A run whose host issued some operators late (`starts[i] > acc[i]`: the GPU
        waited for their launch), under contention: the waits are not work, so only the
        stretches that run back to back are slowed, each from its launch or its
        predecessor's real end, whichever is later (a slowed operator eats into the wait
        after it). Returns the real (acc, starts); the timed ones, to the bit, where no
        change reached the run. (The host's clock after a sync task stays the timed one.)"""
        n = len(starts)
        acc2, starts2 = acc.copy(), starts.copy()
        waits = np.flatnonzero(starts > acc[:-1])
        bounds = [0, *(int(i) for i in waits if i > 0), n]
        free = float(acc[0])  # the stream is free from here, in real time
        for a, b in zip(bounds, bounds[1:], strict=False):
            launch = float(starts[a])
            begin = max(free, launch)
            late = begin != launch  # (on time: the timed instants themselves, to the bit)
            end_u = begin + (float(acc[b]) - launch) if late else float(acc[b])
            span = None
            if end_u > begin:  # (a span may start later than now: at its launch)
                entry = self.contention.compute(gpu, begin, end_u)
                yield entry[0]
                span = entry[3]
            elif begin > self.env._now:
                yield self._at(begin)
            if span is None and not late:  # (as timed)
                free = float(acc[b])
                continue
            ends = begin + (acc[a + 1 : b + 1] - launch) if late else acc[a + 1 : b + 1]
            acc2[a + 1 : b + 1] = ends if span is None else span.warp(ends)
            starts2[a] = begin
            starts2[a + 1 : b] = acc2[a + 1 : b]
            free = float(acc2[b])
        return acc2, starts2

    def _timed(self, block: ComputeRun, start: float, scale: float, noise=None) -> tuple:
        """(instants, end) of `block` run from `start`. GPUs in lock step run a shared
        block from the same instant: the same sums, so the last result is reused (the
        array is shared, never written after); drawn durations (`noise`) never are."""
        if noise is not None:
            return _cumsum(block, start, scale, noise)
        last = self._last_acc.get(id(block))
        if last is not None and last[0] is block and last[1] == start and last[2] == scale:
            return last[3], last[4]
        acc, t = _cumsum(block, start, scale)
        self._last_acc[id(block)] = (block, start, scale, acc, t)
        return acc, t

    def _hosted(self, gpu, block: ComputeRun, start: float, scale: float, noise=None) -> tuple:
        """(ends, starts, end) of `block` on a stream free from `start` whose GPU's host
        issues its tasks from `_clock[gpu]` on (perfmodel.host): a task starts when the
        stream is free and the host has issued it plus the launch latency; the host waits
        at a sync task for its end. `starts` is None where the tasks run back to back (the
        Block then needs none). Lock-step GPUs reuse the last result, as `_timed` does."""
        clock = self._clock.get(gpu, 0.0)
        key = (id(block), start, scale, clock)
        last = self._last_acc.get(key[0])
        if noise is None and last is not None and last[0] is block and last[1] == key:
            acc, starts, t, self._clock[gpu] = last[2]
            return acc, starts, t
        d = _durations(block, scale, noise)
        latency = self.host.launch_latency
        if len(d) <= SMALL_HOST:  # (lists: no arrays made to be compared)
            acc, starts, clock = _host_small(
                d.tolist(), block.hosts.tolist(), block.syncs, start, clock, latency
            )
            t = acc[-1]
            starts = None if starts == acc[:-1] else np.array(starts, float)
            acc = np.array(acc)
        else:
            acc, starts, clock = _host_arrays(d, block.hosts, block.syncs, start, clock, latency)
            t = float(acc[-1])
            if np.array_equal(starts, acc[:-1]):
                starts = None
        self._last_acc[key[0]] = (block, key, (acc, starts, t, clock))
        self._clock[gpu] = clock
        return acc, starts, t

    def _at(self, t: float) -> simpy.Event:
        """An event that fires at absolute time `t` (> now): what a chain of timeouts would
        reach, without the round-off of `timeout(t - now)`. Uses SimPy 4's event queue."""
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None
        heappush(self.env._queue, (t, NORMAL, next(self.env._eid), ev))
        return ev

    def _send(self, gpu, task: Send) -> simpy.Event:
        """Start `task` from `gpu`; the event fires when it is delivered. Without symmetry
        a pipeline's sends repeat, so each (src, dst, bytes) is prepared once; with it the
        send and every copy's image of it start as one group of transfers (one flow-table
        update instead of one per copy: the same flows at the same instant; prepared once),
        and the event is the representative's. Images whose event is the representative's
        (by orbits: one kept flow) end at its instant: nothing to check."""
        if self.symmetry is None:
            pair = (gpu, task.dst, task.nbytes)
            batch = self._sends.get(pair)
            if batch is None:
                batch = self._sends[pair] = self.network.batch([pair])
            return self.network.transfer_all(batch, tag=task.key)
        pair = (gpu, task.dst, task.nbytes)
        made = self._send_groups.get(pair)
        if made is None:  # (made once: a pipeline's and a ring's sends repeat)
            group = self._send_group(gpu, task.dst, task.nbytes)
            made = self._send_groups[pair] = (self.network.batch(group), len(group))
        batch, n = made
        events = self.network.transfer_group(batch, tag=task.key)
        first = events[0]
        if n > 1 and any(e is not first for e in events):  # (one event: one instant)
            twins = Twins(self, f"send {task.key!r}")
            events[0].callbacks.append(lambda _e: twins.rep_done(self.env.now))
            self.open_images += n - 1
            for e in events[1:]:
                e.callbacks.append(lambda _e: twins.image_done(self.env.now))
        return events[0]

    def prepare_calls(self, collectives, sends) -> None:
        """Before a symmetric run: prepare the communication model's calls for the
        representatives' collectives (meetings.Meetings.prepare) and the network's transfer
        groups for their sends ((source, destination, bytes)) with every copy's image, as
        `_send` starts them (a network that moves flows by orbits checks them there)."""
        self._meetings.prepare(collectives)
        for gpu, dst, nb in sends:
            self.network.batch(self._send_group(gpu, dst, nb))

    # -- point-to-point with an image (a symmetric run whose copies move a group's ranks:
    # CP's ring sends to the next CP rank, an image of the sender's representative) ----------
    def _to_image(self, src, dst) -> str:
        """The event a representative's n-th send to image `dst` fires: by the symmetry
        its image under the inverse copy, image(src) -> dst's representative, ends at the
        same instant, and that representative's n-th receive from there waits for it
        (`_from_image`). Sends and receives of one pair are in the same order on both
        ends (each stream runs its layers and micro-batches in the schedule's order)."""
        return f"p2p-image:{src}>{dst}:{self._nth('sent', src, dst)}"

    def _from_image(self, src, gpu) -> str:
        """The event representative `gpu`'s next receive from image `src` waits for: the
        n-th send of src's representative to gpu's image in the inverse copy."""
        sym = self.symmetry
        rep, h = sym.where(src)
        dst = sym.image(gpu, sym.inverse(h))
        return f"p2p-image:{rep}>{dst}:{self._nth('recv', src, gpu)}"

    def _nth(self, side, src, dst) -> int:
        """0, 1, 2, ...: how many of this side's transfers of the pair came before."""
        n = self._pairs[side, src, dst] = self._pairs.get((side, src, dst), -1) + 1
        return n

    def _signal_of(self, task: Wait) -> str:
        """The event a Wait on GPU task.gpu's signal waits for: its representative's, when
        task.gpu is an image (the same key after the GPU's prefix, at the same instant)."""
        if task.gpu in self.symmetry.orbits:
            return task.key
        # (after iteration 0 the key carries the iteration's prefix "it1/", wiring.prefixed)
        head, sep, own = task.key.rpartition("/")
        prefix = f"{task.gpu}:"
        if not own.startswith(prefix):
            raise SimulationError(f"wait {task.key!r}: not GPU {task.gpu}'s signal")
        rep, _ = self.symmetry.where(task.gpu)
        return f"{head}{sep}{rep}:{own[len(prefix) :]}"

    def _send_group(self, gpu, dst, nb) -> list:
        """A send and every copy's image of it, as one transfer group."""
        return [(gpu, dst, nb), *((a, b, nb) for a, b in self.symmetry.send_images(gpu, dst))]

    def check_symmetry(self) -> None:
        """After the run: every image operation ended (at its representative's instant)."""
        if self.open_images:
            raise SymmetryBroken(f"{self.open_images} image operations never ended")

    # -- the timeline ------------------------------------------------------------------------
    def timeline(self) -> TimelineLog:
        """What ran, as the log the timeline is built from (extrapolators.execution.timeline_log)."""
        return TimelineLog(self._log)

    @property
    def rows(self) -> list[tuple]:
        """The timeline as one tuple per task (COLUMNS), blocks expanded."""
        return self.timeline().rows()

    def timeline_columns(self) -> dict:
        """The timeline as {column: array} (TimelineLog.columns)."""
        return self.timeline().columns()

    # -- accounting -----------------------------------------------------------------------
    def check_finished(self) -> None:
        """Raise DeadlockError naming every stream that still has work."""
        stuck = []
        for who, task in sorted(self._waiting.items(), key=lambda kv: repr(kv[0])):
            what = _describe(task)
            if isinstance(task, Collective) and task.key in self._meetings.open:
                what += f" (missing GPUs {sorted(self._meetings.open[task.key]['left'], key=repr)})"
            stuck.append((_name(who), what))
        for who, proc in self._procs.items():
            if not proc.triggered and who not in self._waiting:
                stuck.append((_name(who), "unfinished"))
        if stuck:
            raise DeadlockError(stuck)


def _cumsum(block: ComputeRun, start: float, scale: float, noise=None) -> tuple:
    """The instants a block's tasks end at, from `start` (acc[0]), and its end."""
    d = _durations(block, scale, noise)
    acc = np.empty(len(d) + 1)
    acc[0] = start
    acc[1:] = d
    np.cumsum(acc, out=acc)
    return acc, float(acc[-1])


def _durations(block: ComputeRun, scale: float, noise=None) -> np.ndarray:
    """A block's durations on a GPU computing `scale` times slower (and x its next draws
    where `noise` is given), checked."""
    d = block.durations * scale if scale != 1.0 else block.durations
    if noise is not None:
        d = d * noise(len(d))
    elif scale > 0 and block.low >= 0:  # (checked once per run: a positive scale keeps signs)
        return d
    if len(d) and d.min() < 0:
        raise ValueError(f"Negative delay {d[d < 0][0]}")  # as simpy's timeout
    return d


def host_schedule(d, h, syncs, start: float, clock: float, latency: float) -> tuple:
    """The max-plus schedule of one stream's tasks (GPU durations `d`) issued by a host
    (seconds `h` each) from `clock`: task k is issued at issue_k = clock + h_0 + ... + h_k,
    starts at max(end_{k-1}, issue_k + latency) (end_{-1} = `start`, the stream free) and
    ends d_k later; at a position in `syncs` the host waits for that task's end.
    Returns (acc: `start` then every end, starts, the host's clock after the last issue).
    Vectorised: with D the running sum of d, end_k - D_k = max(end_{k-1} - D_{k-1},
    issue_k + latency - D_{k-1}), a running maximum."""
    if len(d) <= SMALL_HOST:
        acc, starts, clock = _host_small(d.tolist(), h.tolist(), syncs, start, clock, latency)
        return np.array(acc), np.array(starts, float), clock
    return _host_arrays(d, h, syncs, start, clock, latency)


def _host_arrays(d, h, syncs, start: float, clock: float, latency: float) -> tuple:
    """host_schedule in numpy (its docstring)."""
    n = len(d)
    acc = np.empty(n + 1)
    acc[0] = start
    starts = np.empty(n)
    t, a = start, 0
    for b in [*(s + 1 for s in syncs), n]:
        if b <= a:
            continue
        seg_d = d[a:b]
        issue = clock + np.cumsum(h[a:b])
        dsum = np.cumsum(seg_d)
        before = dsum - seg_d
        e = np.maximum.accumulate(np.maximum(issue + latency - before, t))
        acc[a + 1 : b + 1] = dsum + e
        # start_k = max(end_{k-1}, issue_k + latency) >= end_{k-1}; (D_k - d_k) + e_k can
        # round an ulp below D_{k-1} + e_{k-1} (0.3, 0.6: 0.29999999999999993 < 0.3), and a
        # task starting before the last one ends would hold both's tensors at once in the
        # memory model (GPT-2's twin: +167 MB at its peak)
        starts[a:b] = np.maximum(before + e, acc[a:b])
        t = float(acc[b])
        clock = float(issue[-1])
        if b - 1 in syncs:  # (syncs is short: the few item/copy-to-host tasks)
            clock = max(clock, t)
        a = b
    return acc, starts, clock


SMALL_HOST = 32  # host_schedule of up to this many tasks in Python floats (tests: -1); the
# numpy path's set-up costs ~10 us, the Python one ~0.2 us a task


def _host_small(d: list, h: list, syncs, start: float, clock: float, latency: float) -> tuple:
    """host_schedule of a few tasks, element by element: the same float operations in the
    same order (each running sum from its first term, each maximum of the same values).
    Lists: (acc, starts, clock)."""
    acc, starts = [start], []
    t, a = start, 0
    for b in [*(s + 1 for s in syncs), len(d)]:
        if b <= a:
            continue
        cs = ds = 0.0
        e = -math.inf
        for k in range(a, b):
            cs += h[k]
            ds += d[k]
            before = ds - d[k]
            x = clock + cs + latency - before
            x = x if x >= t else t
            e = x if x >= e else e
            s0, prev = before + e, acc[k]
            starts.append(s0 if s0 >= prev else prev)
            acc.append(ds + e)
        t = acc[b]
        clock = clock + cs
        if b - 1 in syncs:
            clock = max(clock, t)
        a = b
    return acc, starts, clock


def _count(run) -> tuple[int, bool]:
    """(tasks in a run of computes, whether all are plain Computes): a loop, cheaper than
    sum() and all() over generators."""
    count = plain = 0
    for c in run:
        if type(c) is Compute:
            count += 1
            plain += 1
        else:
            count += len(c)
    return count, plain == len(run)


def _name(who) -> str:
    gpu, stream, it = who
    return f"GPU {gpu} {stream} stream" + (f" (iteration {it})" if it else "")


def _describe(task) -> str:
    if isinstance(task, Recv):
        return f"recv {task.key!r} from GPU {task.src} (no matching send arrived)"
    if isinstance(task, Wait):
        return f"wait for signal {task.key!r} (never fired)"
    if isinstance(task, WaitSome):
        return f"wait for {task.count} of {list(task.keys)} (too few fired)"
    if isinstance(task, Collective):
        return f"{task.op} {task.key!r} over GPUs {list(task.group)}"
    if isinstance(task, Send):
        return f"send {task.key!r} to GPU {task.dst}"
    return repr(task)
