"""Runs task streams as SimPy processes: one process per (GPU, stream), tasks in order.

Streams are iterators, pulled one task at a time as the simulation unfolds, so N GPUs
never hold N copies of the trace. Compute takes its modelled duration; collectives
meet at a rendezvous and then the communication model (extrapolators.communication)
runs them through the Network; Send/Recv
and Signal/Wait connect streams. Consecutive compute tasks of a stream run as one event at
the end of the run, at the time per-task events would reach (the same sequential float
sums), so long streams cost one SimPy event per run, not per task. When the events run out, `check_finished` names
every stream still waiting (a deadlock) instead of returning a short iteration.
"""

from __future__ import annotations

from heapq import heappush

import simpy
from simpy.core import NORMAL

from extrapolators.tasks import Collective, Compute, Iteration, Recv, Send, Signal, Wait, WaitSome
from triosim.errors import DeadlockError, SimulationError

COLUMNS = ("gpu", "stream", "kind", "name", "layer", "phase", "start", "end", "nbytes", "key",
           "iteration", "op_id", "microbatch")  # fmt: skip


class Runtime:
    def __init__(self, env: simpy.Environment, network, comm, compute_scale: dict | None = None):
        self.env = env
        self.network = network
        self.comm = comm  # a CommModel: runs every collective
        self.compute_scale = compute_scale or {}  # GPU -> slow-down of its compute
        self.rows: list[tuple] = []
        self._events: dict[str, simpy.Event] = {}
        self._meet: dict[str, dict] = {}
        self._waiting: dict[tuple, object] = {}  # (gpu, stream) -> task in progress
        self._procs: dict[tuple, simpy.Process] = {}
        self.tasks_started = 0
        self.tasks_finished = 0
        self.collective_bytes: dict[str, float] = {}

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
        env, rows = self.env, self.rows
        gpu, stream, it = who
        scale = self.compute_scale.get(gpu, 1.0)
        for key in after:
            self._waiting[who] = Wait(key)
            yield self.event(key)
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
            start = env.now
            if type(task) is Compute:
                # the run of computes that follows, up to the next other task
                run = [task]
                for nxt in tasks:
                    if type(nxt) is not Compute:
                        pending = nxt
                        break
                    run.append(nxt)
                self.tasks_started += len(run) - 1
                t, ends = start, []
                for c in run:
                    if c.duration:
                        d = c.duration * scale if scale != 1.0 else c.duration
                        if d < 0:
                            raise ValueError(f"Negative delay {d}")  # as simpy's timeout
                        t = t + d
                    ends.append(t)
                if t != start:
                    yield self._at(t)
                t0 = start
                for c, t1 in zip(run, ends, strict=True):
                    rows.append((gpu, stream, "compute", c.name, c.layer, c.phase,
                                 t0, t1, 0.0, None, it, c.op_id, c.mb))  # fmt: skip
                    t0 = t1
                self.tasks_finished += len(run) - 1
            elif type(task) is Collective:
                begin = yield from self._collective(gpu, task)
                if begin > start:
                    rows.append((gpu, stream, "wait", f"wait {task.op}", task.layer, task.phase,
                                 start, begin, 0.0, task.key, it, -1, -1))  # fmt: skip
                rows.append((gpu, stream, "comm", task.op, task.layer, task.phase, begin,
                             env.now, task.nbytes, task.key, it, -1, -1))  # fmt: skip
            elif type(task) is Send:
                yield self.network.transfer(gpu, task.dst, task.nbytes, tag=task.key)
                self.event("p2p:" + task.key).succeed()
                rows.append((gpu, stream, "comm", f"send to {task.dst}", task.layer, task.phase,
                             start, env.now, task.nbytes, task.key, it, -1, -1))  # fmt: skip
            elif type(task) is Recv:
                yield self.event("p2p:" + task.key)
                rows.append((gpu, stream, "wait", f"recv from {task.src}", task.layer, task.phase,
                             start, env.now, 0.0, task.key, it, -1, -1))  # fmt: skip
            elif type(task) is Signal:
                ev = self.event(task.key)
                if ev.triggered:
                    raise SimulationError(f"GPU {gpu} {stream}: signal {task.key!r} fired twice")
                ev.succeed()
            elif type(task) is Wait:
                yield self.event(task.key)
                if env.now > start:
                    rows.append(
                        (
                            gpu,
                            stream,
                            "wait",
                            "wait",
                            "",
                            "",
                            start,
                            env.now,
                            0.0,
                            task.key,
                            it,
                            -1,
                            -1,
                        )
                    )
            elif type(task) is WaitSome:
                events = [self.event(k) for k in task.keys]
                if sum(e.triggered for e in events) < task.count:
                    n = task.count
                    yield simpy.events.Condition(env, lambda _evs, done, n=n: done >= n, events)
                if env.now > start:
                    rows.append((gpu, stream, "wait", f"wait {task.count} of {len(events)}",
                                 task.layer, task.phase, start, env.now, 0.0,
                                 ",".join(task.keys), it, -1, -1))  # fmt: skip
            elif type(task) is Iteration:
                it = task.k
            else:
                raise SimulationError(f"GPU {gpu} {stream}: unknown task {task!r}")
            self.tasks_finished += 1
        self._waiting.pop(who, None)
        self.event(self.done_key(gpu, stream, it)).succeed()

    def _at(self, t: float) -> simpy.Event:
        """An event that fires at absolute time `t` (> now): what a chain of timeouts would
        reach, without the round-off of `timeout(t - now)`. Uses SimPy 4's event queue."""
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None
        heappush(self.env._queue, (t, NORMAL, next(self.env._eid), ev))
        return ev

    def _collective(self, gpu, task: Collective):
        """Meet the other members; the last to arrive runs the algorithm. Returns its start."""
        meet = self._meet.get(task.key)
        if meet is None:
            if gpu not in task.group:
                raise SimulationError(f"GPU {gpu} posted collective {task.key!r} of group "
                                      f"{task.group} it is not in")  # fmt: skip
            meet = self._meet[task.key] = {"left": set(task.group), "done": self.env.event(),
                                           "begin": None, "task": task}  # fmt: skip
        elif meet["task"].group != task.group or meet["task"].op != task.op:
            raise SimulationError(f"collective {task.key!r} posted with different groups or ops")
        if gpu not in meet["left"]:
            raise SimulationError(f"GPU {gpu} posted collective {task.key!r} twice")
        meet["left"].discard(gpu)
        if not meet["left"]:
            meet["begin"] = self.env.now
            self.env.process(self._run_collective(task, meet["done"]))
        yield meet["done"]
        return meet["begin"]

    def _run_collective(self, task: Collective, done):
        yield from self.comm.run(task.op, task.group, task.nbytes, tag=task.key,
                                 root=task.root, algorithm=task.algorithm)  # fmt: skip
        self.collective_bytes[task.op] = self.collective_bytes.get(task.op, 0.0) + task.nbytes
        del self._meet[task.key]
        done.succeed()

    # -- accounting -----------------------------------------------------------------------
    def check_finished(self) -> None:
        """Raise DeadlockError naming every stream that still has work."""
        stuck = []
        for who, task in sorted(self._waiting.items(), key=lambda kv: repr(kv[0])):
            what = _describe(task)
            if isinstance(task, Collective) and task.key in self._meet:
                what += f" (missing GPUs {sorted(self._meet[task.key]['left'], key=repr)})"
            stuck.append((_name(who), what))
        for who, proc in self._procs.items():
            if not proc.triggered and who not in self._waiting:
                stuck.append((_name(who), "unfinished"))
        if stuck:
            raise DeadlockError(stuck)


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
