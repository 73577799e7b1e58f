"""Writing what the user asked for, the same way in every command: never over one of the
command's own inputs (not even with --force), never over an existing file without --force,
never half a file (each file is written beside its final name, then renamed over it), and
with --force in an output folder, only the files an earlier run of triosim wrote there
removed (listed in the folder's MANIFEST), never anything else.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

from triosim.common.errors import InputError

MANIFEST = ".triosim-files"  # in an output folder: the files triosim wrote there, one a line


def same_file(a, b) -> bool:
    """Whether two paths name one file (links and relative spellings included)."""
    a, b = Path(a), Path(b)
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return a.resolve() == b.resolve()


def refuse_inputs(path, inputs, what: str = "--out") -> None:
    """An output is never one of its run's `inputs` (the one rule of every writer)."""
    for i in inputs:
        if i is not None and same_file(path, i):
            raise InputError(
                f"{what} {path} is the input {i}; name another file (an input "
                "is never overwritten, not even with --force)"
            )


def check_output_file(path, force: bool, inputs=(), what: str = "--out") -> Path:
    """Refuse an output file that is one of `inputs` (always), a folder, or an existing
    file without `force`; make sure its folder can be written. Call it before the work."""
    path = Path(path)
    refuse_inputs(path, inputs, what)
    if path.is_dir():
        raise InputError(f"{what} {path} is a folder; name a file")
    if path.exists() and not force:
        raise InputError(f"{what} {path} exists; pass --force to overwrite it")
    writable_folder(path.parent, what=f"{what} {path}: its folder")
    return path


def writable_folder(folder, what: str = "output folder") -> Path:
    """Create `folder` if needed and test-write a file in it: an InputError if it cannot be
    written, before any work is done."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".triosim-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise InputError(f"{what} {folder}: cannot write there ({e.strerror or e})") from None
    return folder


def partial_name(path) -> Path:
    """Where `path` is written before it is renamed into place: beside it, hidden, with the
    same suffix (so that writers that go by the suffix, .gz or .png, still do)."""
    path = Path(path)
    return path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def stale_partials(folder) -> list[Path]:
    """Partial files (`partial_name`) in `folder` whose writer is gone (killed while
    writing, before it could clean up): removed here, so that one never blocks a run or
    outlives --force. Returns those removed."""
    out = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return out
    for f in entries:
        m = _PARTIAL.match(f.name)
        if m and f.is_file() and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            f.unlink(missing_ok=True)
            out.append(f)
    return out


_PARTIAL = re.compile(r"^\..+\.partial-(\d+)(\.[^.]*)?$")


@contextmanager
def replacing(path):
    """`with replacing(path) as tmp: write(tmp)`: `path` is replaced whole once the block
    ends, or left as it was if the block raises (or is interrupted)."""
    path = Path(path)
    tmp = partial_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path, text: str) -> Path:
    """Write text (UTF-8) to `path` whole: a reader sees the old file or the new one."""
    path = Path(path)
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def written_before(folder, kind: str | None = None) -> list[str]:
    """The names an earlier run of triosim wrote into `folder` (its MANIFEST), if the
    folder holds outputs of `kind` ("simulate": a result folder, "sweep": a sweep folder;
    None: any)."""
    try:
        lines = (Path(folder) / MANIFEST).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    head = lines[0] if lines else ""
    if kind is not None and head != _header(kind):
        return []
    # plain names only: a hand-edited manifest cannot reach outside the folder
    return [n for n in lines[1:] if n and "/" not in n and "\\" not in n and n not in (".", "..")]


def _header(kind: str) -> str:
    return f"# files triosim wrote here for a {kind} folder"


def note_written(folder, names, kind: str) -> None:
    """Add `names` (files in `folder`) to its MANIFEST; `kind` says what the folder holds
    ("simulate" or "sweep"), so that one command's --force never removes another's."""
    folder = Path(folder)
    known = written_before(folder, kind)
    new = [n for n in names if n not in known]
    if new or not (folder / MANIFEST).exists():
        write_text(folder / MANIFEST, "".join(f"{n}\n" for n in [_header(kind), *known, *new]))


def remove_written(folder, own=(), kind: str | None = None) -> list[str]:
    """Remove what triosim wrote into `folder` earlier: `own` (the names the command always
    writes) and the files its MANIFEST lists for `kind`; files only, a user's other files
    stay. Returns the names removed."""
    folder = Path(folder)
    removed = [f.name for f in stale_partials(folder)]
    listed = written_before(folder, kind)
    for name in dict.fromkeys([*own, *listed]):
        f = folder / name
        if f.is_file() or f.is_symlink():
            f.unlink()
            removed.append(name)
    if listed or kind is None:
        (folder / MANIFEST).unlink(missing_ok=True)
    return removed
