"""Figures over many runs: a sweep's metric against a field (`plot_sweep`) and runs side by
side (`plot_compare`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from triosim.results.figures import pyplot, save_figure

# -- sweeps -------------------------------------------------------------------------------------------


def metric_label(y: str) -> str:
    """ "exposed_comm_ms_mean" -> "exposed comm (ms, mean over GPUs)"."""
    for suffix, unit in (("_ms_mean", "ms, mean over GPUs"), ("_ms", "ms"), ("_s", "s")):
        if y.endswith(suffix):
            return f"{y[: -len(suffix)].replace('_', ' ')} ({unit})"
    return y.replace("_", " ")


def plot_sweep(table: pd.DataFrame, x: str, y: str, hue: list[str], path, title: str) -> Path:
    """`y` against `x`: one line per value of the `hue` columns together (numeric x), or
    bars grouped by x with one bar per hue value present there (other x)."""
    plt = pyplot()
    d = table.copy()
    d["_label"] = d[hue].astype(str).agg(", ".join, axis=1) if hue else ""
    groups = list(dict.fromkeys(d["_label"]))
    cmap = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    colour = {g: cmap(k % cmap.N) for k, g in enumerate(groups)}
    fig, ax = plt.subplots(figsize=(10 if hue else 8, 5))
    if pd.api.types.is_numeric_dtype(d[x]):
        markers, styles = "osD^vP*X", ("-", "--", "-.", ":")
        for k, g in enumerate(groups):
            s = d[d["_label"] == g].sort_values(x)
            ax.plot(
                s[x],
                s[y],
                marker=markers[k % len(markers)],
                color=colour[g],
                linestyle=styles[(k // len(markers)) % len(styles)],
                label=g or None,
            )
        xs = sorted(d[x].unique())
        if len(xs) <= 12:
            ax.set_xticks(xs, [f"{v:g}" for v in xs])
    else:
        cats = list(dict.fromkeys(d[x].astype(str)))
        present = {
            c: [g for g in groups if ((d[x].astype(str) == c) & (d["_label"] == g)).any()]
            for c in cats
        }
        width = 0.8 / max(max(len(v) for v in present.values()), 1)
        shown = set()
        for i, c in enumerate(cats):
            for k, g in enumerate(present[c]):
                v = d[(d[x].astype(str) == c) & (d["_label"] == g)][y].mean()
                ax.bar(
                    i + (k - (len(present[c]) - 1) / 2) * width,
                    v,
                    width * 0.95,
                    color=colour[g],
                    label=None if g in shown or not g else g,
                )
                shown.add(g)
        ax.set_xticks(range(len(cats)), cats)
    ax.set_xlabel(x)
    ax.set_ylabel(metric_label(y))
    ax.set_ylim(bottom=0)
    if hue:
        head = ", ".join(hue) if len(", ".join(hue)) <= 30 else ",\n".join(hue)
        ax.legend(
            title=head,
            fontsize="small",
            title_fontsize="small",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
        )
    ax.set_title(title, fontsize="medium")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_compare(table: pd.DataFrame, labels: list[str], path, title: str) -> Path:
    """Grouped bars: one group per metric (rows of `table`, ms), one bar per run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(table) * max(1, len(labels) / 2)), 4.8))
    width = 0.8 / len(labels)
    x = np.arange(len(table))
    for k, label in enumerate(labels):
        vals = table[label].astype(float).to_numpy()
        bars = ax.bar(x + (k - (len(labels) - 1) / 2) * width, vals, width, label=label)
        ax.bar_label(bars, [f"{v:.3g}" for v in vals], fontsize="x-small", padding=2)
    ax.set_xticks(x, [textwrap.fill(m, 14) for m in table.index])
    ax.set_ylabel("ms (iteration: the run's; the rest: mean per GPU)")
    ax.set_ylim(0, float(np.nanmax(table[labels].to_numpy(dtype=float))) * 1.15 or 1)
    ax.legend(fontsize="small")
    ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    return save_figure(fig, path)
