"""Many runs: a grid over config fields, in this process, on a local Dask cluster or on an
existing one, with a progress bar, one tidy table, and resume.

A grid file (`triosim sweep GRID.yaml`):

    base: ../examples/ddp.yaml          # a config file (relative to this file), or a mapping
    grid:                                # the cartesian product of these lists
      num_gpus: [2, 4, 8]
      parallelism.mode: [dp, ddp]
    zip:                                 # lists of one length, varied together
      topology.bandwidth: [25 GB/s, 100 GB/s]
      topology.latency: [2 us, 1 us]

is 3 x 2 x 2 = 12 points. From Python:

    df = sweep({"trace": "traces/cpu/resnet18-b8.trace.json.gz", ...},
               {"num_gpus": [2, 4, 8], "parallelism.mode": ["dp", "ddp"]})

The table has one row per point: `point` (its number), `point_id` (a hash of its resolved
config), its parameters, the run's summary fields (flattened: `collective_bytes.allreduce`)
and, for a failed point, `error_type` and `error` (any exception: the library's own or
not). Every point is validated before anything runs (a field the schema rejects is an
error naming it), and every path is made absolute before a config leaves this process, so
relative paths mean the same on any worker. Where a grid changes a part (say
`parallelism.mode` from ddp to dp), base fields of the base's part that the new part does
not have (`bucket_size`) are left out of those points and listed in `Point.dropped`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from triosim.common.errors import ConfigError, InputError
from triosim.config.loading import Config, read_yaml, set_field
from triosim.config.overrides import SELECTORS, with_overrides

TABLE = "sweep"  # DIR/sweep.csv and DIR/sweep.parquet
ERRORS = ("error_type", "error")
GRID_KEYS = ("base", "grid", "zip")


@dataclass
class Point:
    index: int
    params: dict  # field -> value, as the grid gives it
    config: Config  # validated; every path absolute
    id: str  # a hash of the resolved config: what resume matches on
    dropped: tuple = ()  # base fields left out (of a part this point does not select)


@dataclass
class GridSpec:
    """A grid file, read: the base config mapping and where its relative paths start, the
    grid and zip lists and where theirs start."""

    base: dict
    base_dir: Path
    grid: dict = field(default_factory=dict)
    zipped: dict = field(default_factory=dict)
    grid_dir: Path = Path(".")
    source: str = "grid"
    base_file: Path | None = None  # the base config's file, when the grid names one


# -- the grid --------------------------------------------------------------------------------------


def read_grid(path, sets=()) -> GridSpec:
    """Read a grid file; `sets` are (field, value) overrides of the base config."""
    path = Path(path)
    data = read_yaml(path, "grid file")
    unknown = sorted(set(data) - set(GRID_KEYS))
    if unknown:
        raise InputError(
            f"grid file {path}: unknown key {unknown[0]!r} (a grid file has "
            f"{', '.join(GRID_KEYS)}; config fields go under base:)"
        )
    if "base" not in data:
        raise InputError(
            f"grid file {path}: no base: (a config file's path, or a mapping of config fields)"
        )
    base, base_dir, base_file = data["base"], path.parent, None
    if isinstance(base, str):
        base_file = path.parent / base
        base, base_dir = read_yaml(base_file), base_file.parent
    elif not isinstance(base, dict):
        raise ConfigError("base", base, "a config file's path or a mapping of config fields")
    if not data.get("grid") and not data.get("zip"):
        raise InputError(
            f"grid file {path}: nothing to vary (give grid: and/or zip:, "
            "mappings of field -> list of values)"
        )
    base = copy.deepcopy(base)
    grid, zipped = _lists(data.get("grid"), "grid"), _lists(data.get("zip"), "zip")
    for key, value in sets:
        _check_set(key, grid, zipped)
        set_field(base, key, value)
    return GridSpec(base, base_dir, grid, zipped, path.parent, str(path), base_file)


def _check_set(key: str, grid: dict, zipped: dict) -> None:
    """--set of a field the grid varies (or of a section holding one, or of a field inside
    one): one would silently override the other, so it is refused naming both."""
    for name, section in (("grid", grid), ("zip", zipped)):
        for varied in section:
            if key == varied or key.startswith(f"{varied}.") or varied.startswith(f"{key}."):
                raise InputError(
                    f"--set {key}: the grid file varies {varied} (under "
                    f"{name}:), and one would silently override the other; change "
                    f"{varied} in the grid file, or drop the --set"
                )


def count(grid: dict, zipped: dict | None = None) -> int:
    """How many points a grid has, without building them."""
    grid, zipped = _lists(grid, "grid"), _lists(zipped, "zip")
    _check_zip(grid, zipped)
    n = math.prod(len(v) for v in grid.values())
    return n * (len(next(iter(zipped.values()))) if zipped else 1)


def _check_zip(grid: dict, zipped: dict) -> None:
    both = sorted(set(grid) & set(zipped))
    if both:
        raise ConfigError(f"zip.{both[0]}", zipped[both[0]], "a field not also in grid")
    lengths = {len(v) for v in zipped.values()}
    if len(lengths) > 1:
        sizes = ", ".join(f"{k}: {len(v)}" for k, v in zipped.items())
        raise ConfigError("zip", sizes, "lists of one length (they vary together)")


def _lists(section, name) -> dict:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(name, section, "a mapping of field -> non-empty list of values")
    for k, v in section.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"{name}.{k}", v, "a non-empty list of values")
    return dict(section)


def expand(grid: dict, zipped: dict | None = None) -> list[dict]:
    """Every point's parameters: the product of the grid's lists, and for each, every row
    of the zipped lists (which vary together)."""
    grid, zipped = _lists(grid, "grid"), _lists(zipped, "zip")
    _check_zip(grid, zipped)
    rows = [dict(zip(zipped, r, strict=True)) for r in zip(*zipped.values(), strict=True)]
    out = []
    for combo in itertools.product(*grid.values()):
        for row in rows or [{}]:
            out.append({**dict(zip(grid, combo, strict=True)), **row})
    return out


def points(
    base: dict,
    grid: dict,
    zipped: dict | None = None,
    base_dir=".",
    grid_dir=None,
    progress: bool = False,
) -> list[Point]:
    """Validate every point of the grid (a ConfigError names the point and the field) and
    resolve its paths: the base's relative to `base_dir`, the grid's relative to
    `grid_dir` (default: base_dir). `progress`: a bar of points checked (on a terminal)."""
    if not isinstance(base, dict):
        raise TypeError(_base_wanted(base))
    from triosim.common.bars import bar

    base_dir = Path(base_dir)
    grid_dir = Path(grid_dir) if grid_dir is not None else base_dir
    out = []
    todo = expand(grid, zipped)
    for index, params in enumerate(
        bar(todo, desc="checking points", unit="point", enabled=bool(progress), leave=False)
    ):
        try:
            cfg, dropped = _config(base, params, base_dir, grid_dir)
        except ConfigError as e:
            where = ", ".join(f"{k}={v}" for k, v in params.items())
            raise InputError(f"grid point {index} ({where}): {e}") from None
        out.append(Point(index, params, cfg, config_id(cfg), dropped))
    return out


def _base_wanted(base) -> str:
    return (
        f"the base config must be a mapping of config fields (as YAML gives it), got "
        f"{type(base).__name__} {base!r}; for a config file pass "
        "triosim.config.loading.read_yaml(path) and base_dir=its folder"
    )


def _config(base, params, base_dir: Path, grid_dir: Path) -> tuple[Config, tuple]:
    cfg, dropped = with_overrides(base, params, base_dir)
    if grid_dir.resolve() != base_dir.resolve():  # the grid's own paths start at the grid
        moved = {k: _move(v, grid_dir) for k, v in params.items() if k in _path_fields(cfg)}
        if moved:
            cfg, dropped = with_overrides(base, {**params, **moved}, base_dir)
    return absolute(cfg), tuple(dropped)


def _path_fields(cfg: Config) -> set[str]:
    out = {"trace"}
    for section in SELECTORS:
        opts = getattr(cfg, section).options
        if opts is not None:
            out |= {
                f"{section}.{f.name}" for f in dataclasses.fields(opts) if f.metadata.get("path")
            }
    return out


def _move(value, folder: Path):
    one = lambda p: str((folder / p).resolve()) if isinstance(p, str) else p  # noqa: E731
    return [one(p) for p in value] if isinstance(value, list) else one(value)


def absolute(cfg: Config) -> Config:
    """A copy whose every path (the trace, options marked as paths) is absolute, so that it
    means the same in any process, on any machine that sees the same files."""
    one = lambda p: str(cfg.resolve(p).resolve())  # noqa: E731
    changes = {"trace": one(cfg.trace)}
    for section in SELECTORS:
        sec = getattr(cfg, section)
        opts = sec.options
        if opts is None:
            continue
        moved = {}
        for f in dataclasses.fields(opts):
            if f.metadata.get("path"):
                v = getattr(opts, f.name)
                moved[f.name] = [one(p) for p in v] if isinstance(v, list) else one(v)
        if moved:
            changes[section] = dataclasses.replace(sec, options=dataclasses.replace(opts, **moved))
    return dataclasses.replace(cfg, **changes)


def config_id(cfg: Config) -> str:
    text = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- running ----------------------------------------------------------------------------------------


def run_point(config: Config) -> dict:
    """One point's row of results: the summary, flattened, or the error of any exception."""
    try:
        from triosim.simulation.wiring import Simulation

        summary = Simulation(config).run().summary_dict()
    except Exception as e:  # a point's failure is its result, whatever it is
        return {"error_type": type(e).__name__, "error": str(e) or repr(e)}
    return {**flatten(summary), "error_type": None, "error": None}


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v, default=str)
        else:
            out[key] = v
    return out


def run(
    todo: list[Point], workers: int = 1, scheduler=None, progress: bool = True, on_row=None
) -> dict:
    """Run the points: `scheduler` (an address or a dask.distributed Client) on that
    cluster, else `workers` > 1 on a local Dask cluster of that many processes (local
    processes without Dask), else here. Returns point id -> row; `on_row(point, row)` is
    called as each finishes. A point whose worker dies gets that exception as its error."""
    from triosim.common.bars import bar as progress_bar

    todo = list({p.id: p for p in todo}.values())  # points of one config run once
    rows: dict = {}
    bar = progress_bar(total=len(todo), desc="sweep", unit="point", enabled=bool(progress))

    def done(p: Point, row: dict) -> None:
        rows[p.id] = row
        bar.update(1)
        if on_row is not None:
            on_row(p, row)

    try:
        if not todo:
            return rows
        if scheduler is None and workers <= 1:
            for p in todo:
                done(p, run_point(p.config))
        elif scheduler is not None or _have_dask():
            _run_dask(todo, workers, scheduler, done)
        else:
            _run_processes(todo, workers, done)
    finally:
        bar.close()
    return rows


def _have_dask() -> bool:
    try:
        import dask.distributed  # noqa: F401
    except ImportError:
        return False
    return True


def _failed(e: BaseException) -> dict:
    return {"error_type": type(e).__name__, "error": str(e) or repr(e)}


def _run_dask(todo, workers, scheduler, done) -> None:
    try:
        from dask.distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise InputError("--scheduler needs Dask: pip install 'triosim[cluster]'") from None
    cluster = client = None
    if isinstance(scheduler, Client):
        client = scheduler
    elif scheduler is not None:
        try:
            client = Client(scheduler, timeout="10s")
        except (OSError, TimeoutError, ValueError) as e:
            raise InputError(f"--scheduler {scheduler}: cannot connect ({e})") from None
    else:
        import logging

        try:
            cluster = LocalCluster(
                n_workers=workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
        except Exception as e:  # e.g. a __main__ that worker processes cannot re-import
            raise InputError(
                f"could not start a local Dask cluster of {workers} processes "
                f"({type(e).__name__}: {e}); run with workers=1 (--workers 1), or "
                "on a cluster (--scheduler)"
            ) from None
        client = Client(cluster)
        # like a remote worker, a local one runs elsewhere than here: a path that is only
        # right relative to this folder fails here too, not only on a cluster
        client.run(_leave_cwd)
    futures: dict = {}
    try:
        futures = {
            client.submit(run_point, p.config, key=f"triosim-point-{p.id}", pure=False): p
            for p in todo
        }
        for f in as_completed(list(futures)):
            p = futures[f]
            try:
                row = f.result()
            except Exception as e:  # a worker died, a cancelled task, ...
                row = _failed(e)
            done(p, row)
    except BaseException:  # Ctrl-C: the points not done are cancelled, not run to the end
        client.cancel(list(futures), force=True)
        raise
    finally:
        if client is not scheduler:
            client.close()
        if cluster is not None:
            cluster.close()


def _leave_cwd(dask_worker) -> None:
    os.chdir(dask_worker.local_directory)


def _run_processes(todo, workers, done) -> None:
    from concurrent.futures import ProcessPoolExecutor, as_completed

    pool = ProcessPoolExecutor(workers)
    try:
        futures = {pool.submit(run_point, p.config): p for p in todo}
        for f in as_completed(futures):
            try:
                row = f.result()
            except Exception as e:  # a crashed worker process
                row = _failed(e)
            done(futures[f], row)
    except BaseException:
        # Ctrl-C (or a failing callback): stop now, not after every queued point has run
        # (the executor's exit waits for them all); the rows done so far are saved
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


# -- the table --------------------------------------------------------------------------------------


def table(pts: list[Point], rows: dict) -> pd.DataFrame:
    """One row per point that ran (finished or failed), in grid order: point, point_id,
    parameters, results, errors. A point not run yet has no row."""
    records = []
    for p in pts:
        if p.id not in rows:
            continue
        row = rows[p.id]
        # a result named as a parameter is the parameter's echo, except symmetry: what ran
        # (auto may fall back) is kept beside what was asked, as symmetry_ran
        result = {
            (f"{k}_ran" if k == "symmetry" and k in p.params else k): v
            for k, v in row.items()
            if (k not in p.params or k == "symmetry") and k not in ("error_type", "error")
        }
        records.append(
            {
                "point": p.index,
                "point_id": p.id,
                **p.params,
                **result,
                "error_type": row.get("error_type"),
                "error": row.get("error"),
            }
        )
    df = pd.DataFrame(records)
    if not len(df):
        return df
    params = list(dict.fromkeys(k for p in pts for k in p.params))
    results = [c for c in df.columns if c not in ("point", "point_id", *params, *ERRORS)]
    results.sort(key=lambda c: c != "mode")  # results begin at `mode` (see parameters())
    return df[["point", "point_id", *params, *results, *ERRORS]]


def parameters(df: pd.DataFrame) -> list[str]:
    """A table's parameter columns: those between point_id and the results (which begin at
    `mode`) or the errors."""
    cols = list(df.columns)
    start = cols.index("point_id") + 1 if "point_id" in cols else 0
    end = next((i for i, c in enumerate(cols) if c in ("mode", *ERRORS)), len(cols))
    return cols[start:end]


def axes(df: pd.DataFrame, x=None, y=None, hue=None) -> tuple[str, str, list, list]:
    """Checked plot axes for a sweep table: x (default num_gpus if it varies, else the first
    parameter), y (default iteration_time_ms), and the hue columns: those asked for plus
    every other parameter that varies, so that no line silently mixes points. Returns
    (x, y, hue, notes)."""
    params = parameters(df)
    ok = df[~failed(df)]
    varying = [c for c in params if ok[c].astype(str).nunique() > 1] if len(ok) else []
    notes = []
    if x is None:
        x = "num_gpus" if "num_gpus" in varying else (varying or params or [None])[0]
        if x is None:
            raise InputError("the sweep table has no parameter columns to plot against")
    y = y or "iteration_time_ms"
    hue = list(hue or [])
    for what, col in [("--x", x), ("--y", y), *(("--hue", h) for h in hue)]:
        if col not in df.columns:
            listed = ", ".join(params) or "none"
            metrics = ", ".join(
                c
                for c in df.columns
                if c not in (*params, "point", "point_id", *ERRORS)
                and pd.api.types.is_numeric_dtype(df[c])
            )
            raise InputError(
                f"{what} {col!r} is not a column of the sweep table (parameters: "
                f"{listed}; metrics: {metrics})"
            )
    if not pd.api.types.is_numeric_dtype(df[y]):
        raise InputError(f"--y {y!r} is not a numeric column of the sweep table")
    for axis, col in (("x", x), ("y", y)):
        if col in hue:
            raise InputError(
                f"--hue {col!r} is the {axis} axis itself; name another parameter (or none)"
            )
    extra = [c for c in varying if c != x and c not in hue]
    tied = [c for c in extra if ok.groupby(ok[x].astype(str))[c].nunique().max() <= 1]
    if tied:  # zipped with x: it varies along x, not as lines of its own
        notes.append(
            f"{', '.join(tied)} {'varies' if len(tied) == 1 else 'vary'} with {x} "
            f"(one value per {x})"
        )
        extra = [c for c in extra if c not in tied]
    if extra and hue:
        notes.append(f"also split by {', '.join(extra)}, which vary too")
    hue += extra
    bad = int(failed(df).sum())
    if bad:
        notes.append(f"{bad} failed point(s) left out")
    if not len(ok):
        raise InputError("every point of the sweep failed: nothing to plot")
    return x, y, hue, notes


def failed(df: pd.DataFrame) -> pd.Series:
    if "error" not in df:
        return pd.Series(False, index=df.index)
    e = df["error"]
    return e.notna() & (e.astype(str) != "")


def read_table(path) -> pd.DataFrame:
    """A sweep table: a folder holding sweep.parquet (preferred) or sweep.csv, or the file."""
    path = Path(path)
    if path.is_dir():
        found = [path / f"{TABLE}.{ext}" for ext in ("parquet", "csv")]
        found = [f for f in found if f.exists()]
        if not found:
            raise InputError(f"{path} holds no sweep table ({TABLE}.parquet or {TABLE}.csv)")
        if found[0].suffix == ".parquet" and not _have_pyarrow():
            found = found[1:] or found
        path = found[0]
    if not path.exists():
        raise InputError(f"sweep table {path} does not exist")
    try:
        if path.suffix == ".parquet":
            return pd.read_parquet(path)
        if path.suffix == ".csv":
            with open(path, "rb") as f:  # every table written here ends with a whole line
                if f.seek(0, 2) and (f.seek(-1, 2), f.read(1))[1] != b"\n":
                    raise InputError(
                        f"sweep table {path}: truncated (its last line is cut "
                        "short); run the sweep again to rewrite it"
                    )
            return pd.read_csv(path)
    except InputError:
        raise
    except ImportError:
        raise InputError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    except (OSError, ValueError) as e:
        raise InputError(f"sweep table {path}: cannot read it ({e})") from None
    raise InputError(f"{path}: a sweep table is a .csv or .parquet file")


def _have_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _storable(df: pd.DataFrame) -> pd.DataFrame:
    """Columns of mixed Python values (a grid of "25 GB/s" and 5e10, of lists) as text, so
    that Parquet can hold them; missing values stay missing."""
    df = df.copy()
    for c in df.columns:
        if df[c].dtype != object:
            continue
        vals = df[c].dropna()
        kinds = {type(v) for v in vals}
        if len(kinds) > 1 or kinds & {list, dict, tuple}:
            df[c] = df[c].map(
                lambda v: (
                    v
                    if v is None or (isinstance(v, float) and math.isnan(v))
                    else v
                    if isinstance(v, str)
                    else json.dumps(v, default=str)
                )
            )
    return df


def write_table(df: pd.DataFrame, folder) -> list[Path]:
    """DIR/sweep.csv and, with pyarrow, DIR/sweep.parquet; each replaced whole (written
    beside, then renamed) so that an interrupted write never leaves half a table."""
    folder = Path(folder)
    written = []
    df = _storable(df)
    targets = [("csv", lambda p: df.to_csv(p, index=False))]
    if _have_pyarrow():
        targets.append(("parquet", lambda p: df.to_parquet(p, index=False)))
    for ext, write in targets:
        final = folder / f"{TABLE}.{ext}"
        tmp = folder / f".{TABLE}.{ext}.tmp"
        write(tmp)
        os.replace(tmp, final)
        written.append(final)
    return written


# -- a sweep into a folder, resumable ---------------------------------------------------------------


@dataclass
class Plan:
    """What a sweep into a folder will do: which points ran earlier and which to run."""

    points: list[Point]
    earlier: dict  # point id -> row from the folder's table, kept
    todo: list[Point]
    retried: int = 0  # failed points run again (retry_failed)
    failed_kept: int = 0  # failed points kept as they are


def plan(pts: list[Point], folder, retry_failed: bool = False, fresh: bool = False) -> Plan:
    """Read the folder's table (unless `fresh`): its finished points are kept, and so are
    its failed points unless `retry_failed`; a table holding points not in this grid is
    refused (another grid or another base config: it would mix two sweeps)."""
    folder = Path(folder)
    earlier: dict = {}
    if not fresh and any((folder / f"{TABLE}.{e}").exists() for e in ("parquet", "csv")):
        old = read_table(folder)
        if "point_id" not in old:
            raise InputError(f"{folder}: its {TABLE} table has no point_id column")
        ids = {p.id for p in pts}
        old_ids = old["point_id"].astype(str)
        stray = int((~old_ids.isin(ids)).sum())
        if stray:
            raise InputError(
                f"{folder} holds a sweep with {stray} point(s) not in this grid "
                "(another grid, or a changed base config or trace path); pass "
                "--force to start over there, or name another folder"
            )
        bad = failed(old)
        param_cols = {k for p in pts for k in p.params}
        for (_, r), is_bad, pid in zip(old.iterrows(), bad, old_ids, strict=True):
            row = {
                k: _plain(v)
                for k, v in r.items()
                if k not in ("point", "point_id") and k not in param_cols
            }
            earlier[pid] = (row, bool(is_bad))
    keep, todo, retried, failed_kept = {}, [], 0, 0
    for p in pts:
        if p.id in earlier:
            row, is_bad = earlier[p.id]
            if is_bad and retry_failed:
                retried += 1
            else:
                keep[p.id] = row
                failed_kept += is_bad
                continue
        todo.append(p)
    return Plan(pts, keep, todo, retried, failed_kept)


def _plain(v):
    if isinstance(v, float) and math.isnan(v):
        return None
    return v.item() if hasattr(v, "item") else v


def sweep_to(
    folder,
    pl: Plan,
    workers: int = 1,
    scheduler=None,
    progress: bool = True,
    checkpoint_s: float = 1.0,
) -> pd.DataFrame:
    """Run a plan's points, writing the table into `folder` as rows come in (at most once
    per `checkpoint_s`) and at the end, even when interrupted."""
    folder = Path(folder)
    rows = dict(pl.earlier)
    last = [time.monotonic()]

    def on_row(_p, row):
        rows[_p.id] = row
        if time.monotonic() - last[0] >= checkpoint_s:
            write_table(table(pl.points, rows), folder)
            last[0] = time.monotonic()

    try:
        run(pl.todo, workers, scheduler, progress, on_row)
    finally:
        df = table(pl.points, rows)
        if rows:
            write_table(df, folder)
    return df


def sweep(
    base: dict,
    grid: dict,
    base_dir=".",
    workers: int = 1,
    scheduler=None,
    progress: bool = True,
    zipped: dict | None = None,
) -> pd.DataFrame:
    """Run every point of the grid (see the module doc) and return the table."""
    pts = points(base, grid, zipped, base_dir)
    rows = run(pts, workers, scheduler, progress)
    return table(pts, rows)
