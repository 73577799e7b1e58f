"""The tasks an extrapolator yields for a GPU stream; the runtime executes them in order.

`Compute` (an operator for a duration; `ComputeRun` a shared block of them), `Collective`
(every member posts the same key, it runs once all have), `Send` / `Recv` (point to
point), `Signal` / `Wait` (an event between streams of one GPU or of several),
`WaitSome` (m of n events: Hop's backup workers) and `Iteration` (for modes that run their
iterations themselves). The runtime (runtime.py) runs them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class Compute:
    name: str
    layer: str
    phase: str
    duration: float  # seconds, from the performance model
    op_id: int | None = None
    mb: int = 0  # micro-batch (pipelines): the activations of each are separate tensors
    host: float = 0.0  # seconds the GPU's host spends issuing it (perfmodel.host; 0: no host)
    sync: bool = False  # the host waits for its GPU work to end (item, a copy to the host)


class ComputeRun:
    """Consecutive Compute tasks as one task, built once and shared by every GPU whose
    stream has them: the runtime times them with one event and logs them as one block, so
    a run costs O(1) Python per GPU instead of O(operators). Column lists are kept for the
    timeline; `durations` (seconds) for the sequential sums; `hosts` (seconds to issue
    each) and `syncs` (positions where the host waits for the GPU) when any task has a host
    time, else None (the runtime's host-free path). Every column is read only: runs made
    by `at_mb` share all but `mbs` with the run they copy, and make their `tasks` when
    asked."""

    __slots__ = (
        "_tasks",
        "_base",
        "durations",
        "names",
        "layers",
        "phases",
        "op_ids",
        "mbs",
        "hosts",
        "syncs",
        "low",
    )

    def __init__(self, tasks):
        import numpy as np

        self._tasks = tasks = tuple(tasks)
        self._base = None
        self.durations = np.array([c.duration for c in tasks], dtype=float)
        self.low = float(self.durations.min()) if tasks else 0.0  # (a negative one: refused)
        self.names = [c.name for c in tasks]
        self.layers = [c.layer for c in tasks]
        self.phases = [c.phase for c in tasks]
        self.op_ids = [c.op_id for c in tasks]
        self.mbs = [c.mb for c in tasks]
        hosts = [c.host for c in tasks]
        self.hosts = np.array(hosts, dtype=float) if any(hosts) else None
        self.syncs = [i for i, c in enumerate(tasks) if c.sync] if self.hosts is not None else []

    @classmethod
    def at_mb(cls, run: ComputeRun, mb: int) -> ComputeRun:
        """`run`'s computes, every one at micro-batch `mb` (a pipeline's next micro-batch
        runs the same operators): its columns shared, not copied."""
        new = object.__new__(cls)
        new._tasks, new._base = None, run
        new.durations, new.names, new.layers = run.durations, run.names, run.layers
        new.phases, new.op_ids, new.hosts, new.syncs = run.phases, run.op_ids, run.hosts, run.syncs
        new.low = run.low
        new.mbs = [mb] * len(run.names)
        return new

    @property
    def tasks(self) -> tuple:
        if self._tasks is None:
            mb = self.mbs[0] if self.mbs else 0
            self._tasks = tuple(dataclasses.replace(c, mb=mb) for c in self._base.tasks)
        return self._tasks

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"ComputeRun({len(self.names)} computes)"


@dataclass(slots=True)
class Collective:
    """Every GPU of `group` posts the same key; it runs once all have arrived."""

    op: str  # extrapolators.communication.base.OPS: allreduce, reduce_scatter, all_gather, ...
    group: tuple
    nbytes: float  # bytes per GPU (the buffer each member holds; see communication/base.py)
    key: str
    layer: str = ""
    phase: str = ""
    algorithm: str | None = None  # None: the communication model chooses
    root: object = None
    # all_to_all only: bytes from each member to each (rows: senders, columns: receivers,
    # both in group order; the diagonal stays on its GPU), the same tuple for every member;
    # None: nbytes / N to each (the uniform all-to-all)
    sizes: tuple | None = None


@dataclass(slots=True)
class Send:
    dst: object
    nbytes: float
    key: str
    layer: str = ""
    phase: str = ""


@dataclass(slots=True)
class Recv:
    src: object
    key: str
    layer: str = ""
    phase: str = ""


@dataclass(slots=True)
class Signal:
    """Fire the named event (e.g. 'bucket 3 is ready') for another stream to wait on."""

    key: str


@dataclass(slots=True)
class Wait:
    """Wait for the named event. `gpu`: the event is that GPU's Signal, its key
    f"{gpu}:..." (another GPU's: a symmetric run whose copies move that GPU's index waits
    for the same key of its representative, fired at the same instant; the key after the
    prefix must be the same on every copy)."""

    key: str
    gpu: object = None


@dataclass(slots=True)
class WaitSome:
    """Wait until `count` of the named events have fired (e.g. all but b of a worker's
    in-neighbours' updates: Hop's backup workers)."""

    keys: tuple
    count: int
    layer: str = ""
    phase: str = ""


@dataclass(slots=True)
class Iteration:
    """The tasks that follow belong to training iteration `k` (for streams that run many
    iterations themselves, such as decentralized training)."""

    k: int


def prefixed(tasks, prefix: str):
    """Rename every meeting key (collectives, sends, signals) so that copies of a plan,
    such as replicas or iterations, never meet by accident."""
    for t in tasks:
        if isinstance(t, (Collective, Send, Recv, Signal, Wait)):
            t = dataclasses.replace(t, key=prefix + t.key)
        elif isinstance(t, WaitSome):
            t = dataclasses.replace(t, keys=tuple(prefix + k for k in t.keys))
        yield t
