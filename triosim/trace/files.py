"""Reading what the user names: a text file, with one clear error for each way it can fail,
and any trace (a triosim trace file, or the original TrioSim CSV pair).

Imports no SimPy, so `triosim info` and the tracer machine can use it.
"""

from __future__ import annotations

from pathlib import Path

from triosim.common.errors import InputError
from triosim.trace.go_csv import import_triosim_csv
from triosim.trace.model import Trace, load


def read_text(path, what: str = "file", errors: str = "strict") -> str:
    """The UTF-8 text of the file at `path`, or an InputError naming it (`what` says which
    file it is, e.g. "config file") and why it cannot be read. errors="replace" takes bytes
    that are not UTF-8 as U+FFFD instead (logs that MPI wrappers prefix)."""
    where = f"{what} {path}"
    try:
        return Path(path).read_bytes().decode("utf-8", errors=errors)
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{where}: is a folder, expected a file") from None
    except PermissionError:
        raise InputError(f"{where}: permission denied") from None
    except OSError as e:
        raise InputError(f"{where}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None


def import_csv(path, batch_size: int | None = None, gpu: str | None = None) -> Trace:
    """`import_triosim_csv`, with an unreadable or non-UTF-8 CSV an InputError naming it."""
    path = Path(path)
    try:
        return import_triosim_csv(path, batch_size=batch_size, gpu=gpu)
    except (OSError, UnicodeDecodeError):
        # the importer names the file only when it is missing: read each to say which and why
        trace_csv = path / "trace.csv" if path.is_dir() else path
        for f in (trace_csv, trace_csv.with_name("tensor.csv")):
            read_text(f, "trace file")
        raise


def load_any_trace(path, progress: bool = False) -> Trace:
    """A triosim trace file, or a folder holding the original TrioSim trace.csv + tensor.csv;
    a Chakra file (<prefix>.<rank>.et) is an InputError saying how to run it."""
    path = Path(path)
    if (path.is_dir() and (path / "trace.csv").exists()) or path.suffix == ".csv":
        return import_csv(path)
    if path.name.endswith((".et", ".et.gz")) and path.is_file():
        raise InputError(
            f"{path} is a Chakra execution trace (one rank of a workload, as ASTRA-sim reads "
            "it), not a triosim trace: simulate the workload with `parallelism: {mode: "
            f"chakra, path: {path.parent}}}` and num_gpus its number of ranks (no `trace`)"
        )
    return load(path, progress=progress)
