"""The project's own exception types: every bad input ends in one of these."""

from __future__ import annotations


class TrioSimError(Exception):
    """Base class of every error triosim raises on purpose.

    `args` holds the constructor's arguments so that `type(e)(*e.args)` rebuilds the same
    error (SimPy does this when a process fails); `str(e)` is the message.
    """

    def __str__(self) -> str:
        return getattr(self, "message", super().__str__())


class TraceError(TrioSimError, ValueError):
    """A trace file is malformed; names the file, the row and the field."""

    def __init__(self, message: str, file=None, row=None, field=None):
        where = []
        if file is not None:
            where.append(f"file {file}")
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field '{field}'")
        self.file, self.row, self.field = file, row, field
        self.message = f"{', '.join(where)}: {message}" if where else message
        super().__init__(message, file, row, field)


class ConfigError(TrioSimError, ValueError):
    """A configuration value is not allowed; names the field, the value and what is allowed."""

    def __init__(self, field: str, value, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        shown = repr(value)
        if len(shown) > 200:  # a 400-digit number or a pasted list: its start says enough
            shown = f"{shown[:80]}... ({len(shown)} characters)"
        # a command-line flag (`--measured`) is named as the user typed it, not as a field
        what = f"{field} {shown}" if field.startswith("-") else f"config field '{field}' = {shown}"
        self.message = f"{what} is not allowed: {allowed}"
        super().__init__(field, value, allowed)


class InputError(TrioSimError, ValueError):
    """A file, folder or command-line value the user gave cannot be used: a missing or
    unreadable file, a folder where a file is expected, text that is not UTF-8 or not YAML,
    or an output that would overwrite something."""


class NetworkError(TrioSimError, ValueError):
    """A topology or a transfer request is invalid."""


class SimulationError(TrioSimError, RuntimeError):
    """The simulation broke an invariant (work left over, bytes lost, overlapping tasks)."""


class QuotientBroken(SimulationError):
    """A symmetric run's network cannot move its flows by orbits (networks.packet.quotient):
    the run is repeated moving every copy's flows."""


class DeadlockError(SimulationError):
    """Events ran out while tasks were still waiting; names the stuck GPUs and tasks."""

    def __init__(self, stuck: list[tuple[str, str]]):
        self.stuck = stuck
        lines = "\n".join(f"  {who}: waiting on {what}" for who, what in stuck[:20])
        more = f"\n  ... and {len(stuck) - 20} more" if len(stuck) > 20 else ""
        self.message = (
            f"simulation stalled with {len(stuck)} stream(s) unfinished "
            f"(no events left to run):\n{lines}{more}"
        )
        super().__init__(stuck)


class TracerError(TrioSimError, ValueError):
    """Tracing a model failed: not a module, no parameters, the model raised, or an
    Execution Trace schema this tracer does not read."""
