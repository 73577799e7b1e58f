"""What the commands share: `--set` assignments, output folders (never over an input, never
over files of an earlier run without --force, only those files removed), and argument types."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from triosim.common.errors import InputError


def out_path(text: str) -> str:
    """argparse type of every output path (--out, --plot, import's OUT): a name. An empty
    one would be Path(''), the working folder, which is never what an empty value meant."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: a file or folder name (an empty one is none)")
    return text


def parse_assignment(text: str) -> tuple[str, object]:
    """`FIELD=VALUE` of a --set, as (field, value)."""
    from triosim.cli.collectives import assignment as parse

    return parse(text)


def apply_set(data: dict, text: str) -> None:
    """Apply one --set `FIELD=VALUE` to a config mapping."""
    from triosim.config.loading import set_field

    set_field(data, *parse_assignment(text))


def config_with_sets(path, sets) -> object:
    """The config file at `path` with its --set overrides, by the rule a sweep's points
    follow (triosim.config.overrides): a --set that selects another part (a mode, a
    topology kind) leaves out the file's fields the new part does not have, and says so."""
    from triosim.config.loading import read_yaml
    from triosim.config.overrides import with_overrides

    path = Path(path)
    overrides = dict(parse_assignment(s) for s in sets or [])
    cfg, dropped = with_overrides(read_yaml(path), overrides, path.parent)
    if dropped:
        print(f"--set: left out {', '.join(dropped)} (fields of the part the --set replaces)")
    return cfg


def taken(folder: Path) -> bool:
    """Whether `folder` holds files (a killed run's stale partial files removed first:
    triosim.common.outputs.stale_partials)."""
    from triosim.common.outputs import stale_partials

    if folder.is_dir():
        stale_partials(folder)
    return folder.exists() and (not folder.is_dir() or any(folder.iterdir()))


def out_folder(out, stem: str, force: bool) -> Path:
    """Where `simulate` writes: --out (refused if it holds files, unless --force), or
    out/<stem>/, else the first free out/<stem>-2/, -3/, ... Created and test-written now,
    before simulating, so that a finished run is never lost to an unwritable folder."""
    if out is not None:
        folder = Path(out)
        if folder.exists() and not folder.is_dir():
            raise InputError(f"--out {folder} is a file, expected a folder")
        if taken(folder) and not force:
            raise InputError(
                f"--out {folder} already holds files; pass --force to "
                "overwrite them, or name another folder"
            )
    else:
        folder, n = Path("out") / stem, 1
        while taken(folder) and not force:
            n += 1
            folder = Path("out") / f"{stem}-{n}"
    return writable(folder)


def writable(folder: Path) -> Path:
    from triosim.common.outputs import writable_folder

    return writable_folder(folder)


def plot_file(plot, force: bool, cfg, config_path) -> Path:
    """A command's `--plot` PNG for a run of `cfg` (read from `config_path`): a .png name,
    never one of the run's inputs, an existing one only with --force."""
    from triosim.common.outputs import check_output_file
    from triosim.config.inputs import input_files

    if not str(plot).lower().endswith(".png"):
        raise InputError(f"--plot {plot}: name a .png file")
    return check_output_file(plot, force, inputs=input_files(cfg, config_path), what="--plot")


def cv_arg(text: str) -> float:
    """argparse type of a variability's coefficient of variation (`--cv`, `--op-cv`,
    `--net-cv`)."""
    try:
        cv = float(text)
    except ValueError:
        cv = math.nan
    if not 0 <= cv < 1:
        raise argparse.ArgumentTypeError(f"a coefficient of variation in [0, 1), got {text!r}")
    return cv


def spare_inputs(folder: Path, names, inputs) -> None:
    """Refuse an output folder where one of the files a run writes (or removes, with
    --force) is one of its inputs: the run would destroy what it read."""
    from triosim.common.outputs import same_file

    for name in names:
        for i in inputs:
            if same_file(folder / name, i):
                raise InputError(
                    f"--out {folder}: its {name} is an input of this run ({i}); "
                    "name another folder (an input is never overwritten, not "
                    "even with --force)"
                )


def clear_earlier(folder: Path, own, kind: str) -> None:
    """--force: remove what an earlier run wrote into `folder` (its own files and the
    manifest's, nothing else), so that no stale output sits beside the new ones."""
    from triosim.common.outputs import remove_written

    removed = remove_written(folder, own, kind)
    extra = [n for n in removed if n not in own]  # not rewritten now: worth naming
    if removed:
        print(
            f"--force: removed the {len(removed)} file(s) an earlier run wrote in {folder}/"
            + (f" ({', '.join(extra)} among them)" if extra else "")
        )


def positive_int(text: str) -> int:
    from triosim.cli.collectives import positive_int

    return positive_int(text)


def nonnegative_int(text: str) -> int:
    from triosim.cli.collectives import nonnegative_int

    return nonnegative_int(text)


def device_name(text: str) -> str:
    """trace --device: cpu, cuda or cuda:N (what the tracer can time)."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def with_fields_help(parser) -> None:
    """`simulate --help` ends with every config field, from the schema itself (built only
    when help is asked for: listing the parts imports them all)."""
    plain = parser.format_help

    def format_help():
        from triosim.config.loading import fields_help

        return plain() + "\n" + fields_help() + "\n"

    parser.format_help = format_help
