"""Runs task streams as SimPy processes: one process per (GPU, stream), tasks in order.

Streams are iterators, pulled one task at a time as the simulation unfolds, so N GPUs
never hold N copies of the trace. Compute takes its modelled duration; collectives
meet at a rendezvous and then the communication model (extrapolators.communication)
runs them through the Network; Send/Recv
and Signal/Wait connect streams. When the events run out, `check_finished` names
every stream still waiting (a deadlock) instead of returning a short iteration.
"""

from __future__ import annotations

import simpy

from extrapolators.tasks import Collective, Compute, Recv, Send, Signal, Wait
from triosim.errors import DeadlockError, SimulationError

COLUMNS = ("gpu", "stream", "kind", "name", "layer", "phase", "start", "end", "nbytes", "key")


class Runtime:
    def __init__(self, env: simpy.Environment, network, comm):
        self.env = env
        self.network = network
        self.comm = comm  # a CommModel: runs every collective
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

    def start(self, gpu, stream: str, tasks) -> None:
        self._procs[(gpu, stream)] = self.env.process(self._run(gpu, stream, iter(tasks)))

    # -- execution ------------------------------------------------------------------------
    def _run(self, gpu, stream, tasks):
        env, rows = self.env, self.rows
        for task in tasks:
            self.tasks_started += 1
            self._waiting[(gpu, stream)] = task
            start = env.now
            if type(task) is Compute:
                if task.duration:
                    yield env.timeout(task.duration)
                rows.append((gpu, stream, "compute", task.name, task.layer, task.phase,
                             start, env.now, 0.0, None))  # fmt: skip
            elif type(task) is Collective:
                begin = yield from self._collective(gpu, task)
                if begin > start:
                    rows.append((gpu, stream, "wait", f"wait {task.op}", task.layer, task.phase,
                                 start, begin, 0.0, task.key))  # fmt: skip
                rows.append((gpu, stream, "comm", task.op, task.layer, task.phase, begin,
                             env.now, task.nbytes, task.key))  # fmt: skip
            elif type(task) is Send:
                yield self.network.transfer(gpu, task.dst, task.nbytes, tag=task.key)
                self.event("p2p:" + task.key).succeed()
                rows.append((gpu, stream, "comm", f"send to {task.dst}", task.layer, task.phase,
                             start, env.now, task.nbytes, task.key))  # fmt: skip
            elif type(task) is Recv:
                yield self.event("p2p:" + task.key)
                rows.append((gpu, stream, "wait", f"recv from {task.src}", task.layer, task.phase,
                             start, env.now, 0.0, task.key))  # fmt: skip
            elif type(task) is Signal:
                ev = self.event(task.key)
                if ev.triggered:
                    raise SimulationError(f"GPU {gpu} {stream}: signal {task.key!r} fired twice")
                ev.succeed()
            elif type(task) is Wait:
                yield self.event(task.key)
                if env.now > start:
                    rows.append(
                        (gpu, stream, "wait", "wait", "", "", start, env.now, 0.0, task.key)
                    )
            else:
                raise SimulationError(f"GPU {gpu} {stream}: unknown task {task!r}")
            self.tasks_finished += 1
        self._waiting.pop((gpu, stream), None)

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
        for (gpu, stream), task in sorted(self._waiting.items(), key=lambda kv: repr(kv[0])):
            what = _describe(task)
            if isinstance(task, Collective) and task.key in self._meet:
                what += f" (missing GPUs {sorted(self._meet[task.key]['left'], key=repr)})"
            stuck.append((f"GPU {gpu} {stream} stream", what))
        for (gpu, stream), proc in self._procs.items():
            if not proc.triggered and (gpu, stream) not in self._waiting:
                stuck.append((f"GPU {gpu} {stream} stream", "unfinished"))
        if stuck:
            raise DeadlockError(stuck)


def _describe(task) -> str:
    if isinstance(task, Recv):
        return f"recv {task.key!r} from GPU {task.src} (no matching send arrived)"
    if isinstance(task, Wait):
        return f"wait for signal {task.key!r} (never fired)"
    if isinstance(task, Collective):
        return f"{task.op} {task.key!r} over GPUs {list(task.group)}"
    if isinstance(task, Send):
        return f"send {task.key!r} to GPU {task.dst}"
    return repr(task)
