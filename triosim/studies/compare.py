"""Runs side by side: each from a config file (simulated now) or a saved result folder
(its summary.json), with differences and ratios against the first, and a bar chart.

    runs = [load("examples/ddp.yaml"), load("out/dp")]
    print(format_table(runs))
    plot(runs, "compare.png")
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from triosim.common.errors import InputError

# (row label, summary field, scale to the shown unit); rows whose field no run has are left out
METRICS = (
    ("iteration time (ms)", "iteration_time_ms", 1.0),
    ("first iteration (ms)", "first_iteration_time_ms", 1.0),
    ("compute / GPU (ms)", "compute_ms_mean", 1.0),
    ("communication / GPU (ms)", "comm_ms_mean", 1.0),
    ("exposed communication (ms)", "exposed_comm_ms_mean", 1.0),
    ("idle / GPU (ms)", "idle_ms_mean", 1.0),
    ("bytes moved (MB)", "bytes_moved", 1e-6),
    ("peak memory / GPU (GB)", "peak_memory_gb_max", 1.0),  # the memory model's largest peak
)
CHART = (
    "iteration time (ms)",
    "compute / GPU (ms)",
    "communication / GPU (ms)",
    "exposed communication (ms)",
    "idle / GPU (ms)",
)


@dataclass
class Run:
    label: str
    source: str
    how: str  # "simulated now" or "saved result"
    summary: dict


def load(arg, progress: bool = True) -> Run:
    """A saved result folder (holding summary.json), or a config file to simulate now."""
    path = Path(arg)
    if path.is_dir():
        f = path / "summary.json"
        if not f.is_file():
            raise InputError(
                f"{path} is a folder without summary.json: not a saved result "
                "(give a result folder written by simulate, or a config file)"
            )
        try:
            summary = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise InputError(f"{f}: cannot read it as JSON ({e})") from None
        if not isinstance(summary, dict):
            raise InputError(f"{f}: expected a JSON object of summary fields")
        return Run(path.name or str(path), str(path), "saved result", summary)
    if not path.exists():
        raise InputError(f"{path} does not exist (give a config file or a result folder)")
    return Run(path.stem, str(path), "simulated now", simulate_file(path, progress).summary_dict())


def simulate_file(path, progress: bool = True):
    """Simulate the config file at `path`: a Result."""
    from triosim.config.loading import from_dict, read_yaml
    from triosim.simulation.progress import run_with_progress
    from triosim.simulation.wiring import Simulation

    path = Path(path)
    cfg = from_dict(read_yaml(path), base_dir=path.parent)
    sim = Simulation(cfg, progress=progress)
    return run_with_progress(sim, f"simulating {path.name}", enabled=None if progress else False)


def _value(summary: dict, key: str):
    v = summary.get(key)
    if isinstance(v, dict):  # per GPU: the largest
        v = max((x for x in v.values() if isinstance(x, (int, float))), default=None)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _labels(runs: list[Run]) -> list[str]:
    seen: dict = {}
    out = []
    for r in runs:
        n = seen[r.label] = seen.get(r.label, 0) + 1
        out.append(r.label if n == 1 else f"{r.label} ({n})")
    return out


def table(runs: list[Run]) -> pd.DataFrame:
    """Metric rows; one column per run (shown units), then per later run its difference
    from the first and its ratio to it."""
    labels = _labels(runs)
    rows = {}
    for name, key, scale in METRICS:
        vals = [_value(r.summary, key) for r in runs]
        if all(v is None for v in vals):
            continue
        if key == "first_iteration_time_ms" and all(
            (r.summary.get("iterations") or 1) == 1 for r in runs
        ):
            continue  # the same as the iteration time
        rows[name] = [None if v is None else v * scale for v in vals]
    df = pd.DataFrame.from_dict(rows, orient="index", columns=labels)
    first = labels[0]
    for lab in labels[1:]:
        df[f"{lab} - {first}"] = df[lab] - df[first]
        df[f"{lab} / {first}"] = [_ratio(a, b) for a, b in zip(df[lab], df[first], strict=True)]
    return df


def _ratio(a, b):
    if a is None or b is None or pd.isna(a) or pd.isna(b):
        return math.nan
    if b == 0:
        return 1.0 if a == 0 else math.nan
    return a / b


def format_table(runs: list[Run]) -> str:
    labels = _labels(runs)
    df = table(runs)
    lines = ["runs:"]
    w = max(len(x) for x in labels)
    sw = max(len(r.source) for r in runs)
    for lab, r in zip(labels, runs, strict=True):
        s = r.summary
        what = ", ".join(str(x) for x in (s.get("mode"), f"{s.get('num_gpus')} GPUs") if x)
        lines.append(f"  {lab:<{w}}  {r.source:<{sw}}  ({r.how}: {what})")
    lines.append("")

    def cell(col, v):
        if v is None or pd.isna(v):
            return "n/a"
        if " / " in col:
            return f"{v:.4f}x"
        if " - " in col:
            return f"{round(v, 4) + 0.0:+.4f}"  # no "-0.0000" for rounding noise
        return f"{v:.4f}"

    cols = list(df.columns)
    body = [[cell(c, df.at[m, c]) for c in cols] for m in df.index]
    mw = max(len(m) for m in df.index)
    widths = [max(len(c), *(len(r[k]) for r in body)) for k, c in enumerate(cols)]
    lines.append(
        " " * mw + "  " + "  ".join(f"{c:>{x}}" for c, x in zip(cols, widths, strict=True))
    )
    for m, r in zip(df.index, body, strict=True):
        lines.append(
            f"{m:<{mw}}  " + "  ".join(f"{v:>{x}}" for v, x in zip(r, widths, strict=True))
        )
    return "\n".join(lines)


def plot(runs: list[Run], path) -> Path:
    """Grouped bars of the time metrics (ms), one bar per run."""
    from triosim.results import sweep_plots

    labels = _labels(runs)
    df = table(runs)
    df = df.loc[[m for m in CHART if m in df.index], labels]
    df.index = [m.replace(" (ms)", "") for m in df.index]
    title = "  vs  ".join(labels)
    return sweep_plots.plot_compare(df, labels, path, title if len(title) < 90 else "comparison")
