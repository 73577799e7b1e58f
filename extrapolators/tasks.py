"""The tasks an extrapolator yields for a GPU stream; the runtime executes them in order."""

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


@dataclass(slots=True)
class Collective:
    """Every GPU of `group` posts the same key; it runs once all have arrived."""

    op: str  # extrapolators.communication.OPS: allreduce, reduce_scatter, all_gather, ...
    group: tuple
    nbytes: float  # bytes per GPU (the buffer each member holds; see communication.py)
    key: str
    layer: str = ""
    phase: str = ""
    algorithm: str | None = None  # None: the communication model chooses
    root: object = None


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
    key: str


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
