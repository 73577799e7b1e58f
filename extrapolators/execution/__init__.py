"""Running task streams: the tasks a GPU executes (`tasks.py`), the SimPy runtime that runs
them and records the timeline (`runtime.py`, `timeline_log.py`; collectives meet in
`meetings.py`; compute slowed beside communication in `contention.py`), and the symmetry
that lets one GPU's stream stand for its class (`symmetry.py`)."""

from extrapolators.execution.runtime import Runtime

__all__ = ["Runtime"]
