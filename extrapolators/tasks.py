"""The tasks an extrapolator yields for a GPU stream; the runtime executes them in order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Compute:
    name: str
    layer: str
    phase: str
    duration: float  # seconds, from the performance model
    op_id: int | None = None


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
