"""A saved result folder read back (`read_result_folder`, every file checked whole) and drawn
(`plot_result`): what `triosim plot OUT` does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from triosim.results.link_plots import plot_links
from triosim.results.plots import plot_breakdown, plot_overview, plot_timeline

# -- a saved result folder -------------------------------------------------------------------------


@dataclass
class SavedResult:
    """What the figures need of a result folder written by Result.save."""

    timeline: pd.DataFrame
    per_gpu: pd.DataFrame
    links: pd.DataFrame
    gpus: list
    iteration_time: float
    topology: dict
    title: str
    # the GPUs the timeline has rows of where not every one (a symmetric run's folder holds
    # its representatives' rows: summary.json's represented_by), else None
    timeline_gpus: list | None = None


def read_result_folder(folder) -> SavedResult:
    import json

    import yaml

    from triosim.common.errors import InputError

    folder = Path(folder)

    def table(name, **kw):
        f = folder / name
        try:
            return pd.read_csv(f, **kw)
        except FileNotFoundError:
            raise InputError(f"{folder} has no {name}: not a complete result folder") from None
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise InputError(f"{f}: cannot read it ({e})") from None

    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        config = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8")) or {}
    except FileNotFoundError as e:
        raise InputError(
            f"{folder} has no {Path(e.filename).name}: not a complete result folder"
        ) from None
    except (OSError, ValueError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise InputError(f"{folder}: cannot read its summary or config ({e})") from None
    if not isinstance(summary, dict):
        raise InputError(f"{folder / 'summary.json'}: expected a JSON object of summary fields")
    timeline = table("timeline.csv", keep_default_na=False, na_values={"start": [""], "end": [""]})
    _whole(folder / "timeline.csv", timeline, summary, ("gpu", "stream", "kind", "start", "end"))
    for c in ("layer", "phase", "name", "stream", "kind"):
        if c in timeline:
            timeline[c] = timeline[c].astype(str)
    per_gpu = table("per_gpu.csv", index_col=0)
    _whole(folder / "per_gpu.csv", per_gpu, summary, ("compute", "comm", "exposed_comm", "idle"))
    links = table("links.csv")
    _whole(folder / "links.csv", links, summary, ())
    links = links.rename(columns={"bytes": "nbytes"})
    topo = config.get("topology") or {}
    topology = {"kind": topo.get("kind", ""), "rows": topo.get("rows"), "cols": topo.get("cols")}
    t = float(summary.get("iteration_time_ms", 0.0)) / 1e3
    title = f"{summary.get('mode', '')}, {len(per_gpu)} GPUs: iteration {t * 1e3:.3f} ms"
    rep_of = summary.get("represented_by")
    reps = list(dict.fromkeys(rep_of.values())) if isinstance(rep_of, dict) else None
    gpus = list(per_gpu.index)
    return SavedResult(timeline, per_gpu, links, gpus, t, topology, title, reps)


def _whole(path: Path, df: pd.DataFrame, summary: dict, required) -> None:
    """Refuse a table cut short or damaged since it was saved: fewer (or more) rows than
    summary.json recorded (`rows`, written by Result.save), a last line with fields
    missing, a required column missing or empty, or a file that does not end in a newline
    (every CSV pandas writes does)."""
    from triosim.common.errors import InputError

    why = None
    recorded = (summary.get("rows") or {}).get(path.name)
    missing = [c for c in required if c not in df.columns]
    if missing:
        why = f"no {', '.join(missing)} column"
    elif isinstance(recorded, int) and recorded != len(df):
        why = f"{len(df)} rows where summary.json records {recorded}"
    elif len(df) and df.iloc[-1].isna().any() and df.iloc[:-1].notna().all(axis=None):
        why = "its last line has fields missing"
    elif len(df) and any(df[c].isna().any() for c in required):
        bad = next(c for c in required if df[c].isna().any())
        why = f"an empty {bad} field on line {int(df[bad].isna().to_numpy().argmax()) + 2}"
    else:
        try:
            with open(path, "rb") as f:
                f.seek(-1, 2)
                ends = f.read(1) == b"\n"
        except OSError:
            ends = True
        if not ends:
            why = "it does not end with a complete line"
    if why:
        raise InputError(f"{path}: truncated or damaged ({why}); simulate again to rewrite it")


def plot_result(saved: SavedResult, kind: str, path, max_gpus: int = 16) -> Path:
    """One figure of a saved result: overview (all three), timeline, breakdown or links."""
    s = saved
    if kind == "timeline":
        title = s.title if s.timeline_gpus is None else f"{s.title} (representatives)"
        return plot_timeline(s.timeline, s.timeline_gpus or s.gpus, title, path, max_gpus)
    if kind == "breakdown":
        return plot_breakdown(s.per_gpu, s.iteration_time, s.title, path)
    if kind == "links":
        return plot_links(s.links, s.gpus, s.topology, s.title, path)
    return plot_overview(
        s.timeline,
        s.per_gpu,
        s.links,
        s.gpus,
        s.iteration_time,
        s.topology,
        s.title,
        path,
        max_gpus,
        s.timeline_gpus,
    )
