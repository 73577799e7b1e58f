"""Read any trace a user names: a triosim trace file, or the original TrioSim CSV pair."""

from __future__ import annotations

from pathlib import Path

from triosim.importers import import_triosim_csv
from triosim.trace import Trace, load


def load_any_trace(path, progress: bool = False) -> Trace:
    """A triosim trace file, or a folder holding the original TrioSim trace.csv + tensor.csv."""
    path = Path(path)
    if path.is_dir() and (path / "trace.csv").exists():
        return import_triosim_csv(path)
    if path.suffix == ".csv":
        return import_triosim_csv(path)
    return load(path, progress=progress)
