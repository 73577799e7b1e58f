"""What a run reads, for every command that writes: an input is never an output, with or
without --force.

`input_files(cfg, *files)`: `files` (the config file itself, a log) and every path the
config names: the trace and each option marked as a path (a calibration file, extra traces,
a Chakra workload). A path that names a folder stands for the files in it, and one that
names neither a file nor a folder for the files its name begins (a Chakra workload is given
as a folder or as a prefix: `chakra/ddp` or `chakra/ddp/workload`), so that a writer
compares file with file.

`config_inputs(path, data)`: the same for a config given as a YAML file and its (possibly
overridden) data, where it loads; else the config file and the trace it names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

SECTIONS = ("parallelism", "topology", "network", "communication", "perfmodel", "host")


def input_files(cfg, *files) -> list[Path]:
    """The files a run of `cfg` reads, with `files` (module docstring)."""
    from triosim.config.loading import IN_MEMORY

    named = [Path(f) for f in files if f is not None]
    if cfg.trace and cfg.trace != IN_MEMORY:
        named.append(cfg.trace_path())
    for section in SECTIONS:
        opts = getattr(getattr(cfg, section, None), "options", None)
        if opts is None or not dataclasses.is_dataclass(opts):
            continue
        for f in dataclasses.fields(opts):
            if f.metadata.get("path"):
                v = getattr(opts, f.name)
                named += [cfg.resolve(x) for x in (v if isinstance(v, list) else [v]) if x]
    out: list[Path] = []
    for p in named:
        out.append(p)
        out += _stands_for(p)
    return out


def config_inputs(path, data: dict) -> list[Path]:
    """`input_files` of a config file's data; where the data does not load as a config (a
    search's base, say), the config file and the trace it names."""
    from triosim.common.errors import TrioSimError
    from triosim.config.loading import from_dict

    path = Path(path)
    try:
        return input_files(from_dict(data, base_dir=path.parent), path)
    except TrioSimError:
        trace = data.get("trace") if isinstance(data, dict) else None
        out = [path]
        if isinstance(trace, str) and trace:
            out += [path.parent / trace, *_stands_for(path.parent / trace)]
        return out


def _stands_for(p: Path) -> list[Path]:
    """The files a folder holds, or those a prefix begins (module docstring)."""
    try:
        if p.is_dir():
            return [f for f in p.iterdir() if f.is_file()]
        if not p.exists() and p.parent.is_dir() and p.name:
            return [f for f in p.parent.iterdir() if f.is_file() and f.name.startswith(p.name)]
    except OSError:
        return []
    return []
