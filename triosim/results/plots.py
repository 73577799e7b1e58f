"""Figures of one run: its timeline, per-GPU breakdown, memory over time, and all three in one
(`plot_overview`; the per-link figure is link_plots'). Every function takes plain DataFrames (as
a Result holds them, or as read back from a saved result folder) and writes a PNG; times on the
axes are milliseconds. Saved result folders: saved.py; sweeps and comparisons: sweep_plots.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from triosim.results.figures import COMM_COLOUR, OTHER_COMPUTE, PHASE_COLOURS, pyplot, save_figure
from triosim.results.link_plots import links_figure

# -- which GPUs a timeline shows -----------------------------------------------------------------


def sample_gpus(gpus: list, max_gpus: int = 16) -> tuple[list, str]:
    """At most `max_gpus` GPUs and a note saying which: all of them, or the first two, the
    last two and every k-th in between ("16 of 84 GPUs shown: ...")."""
    n = len(gpus)
    if n <= max_gpus:
        return list(gpus), "the one GPU" if n == 1 else f"all {n} GPUs"
    ends = 2
    k = math.ceil((n - 2 * ends) / max(max_gpus - 2 * ends, 1))
    middle = list(range(ends, n - ends, k))[: max_gpus - 2 * ends]
    idx = sorted({*range(ends), *middle, *range(n - ends, n)})
    note = (
        f"{len(idx)} of {n} GPUs shown: the first {ends}, the last {ends} and every "
        f"{_ordinal(k)} in between"
    )
    return [gpus[i] for i in idx], note


def _ordinal(k: int) -> str:
    if k == 1:
        return "one"
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


# -- timeline --------------------------------------------------------------------------------------


def timeline_figure(timeline: pd.DataFrame, gpus: list, title: str, ax=None, max_gpus=16):
    """Draw the timeline: per shown GPU one band, one sub-row per stream (the compute
    stream first); compute coloured by phase, communication red. Returns the axes."""
    from matplotlib.patches import Patch

    plt = pyplot()
    shown, note = sample_gpus(list(gpus), max_gpus)
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(12, 1.6 + 0.55 * len(shown)))
    tl = timeline[timeline["kind"] != "wait"]
    by_gpu = dict(tuple(tl.groupby("gpu", sort=False)))
    other_compute = False
    for y, g in enumerate(reversed(shown)):  # GPU shown first at the top
        d = by_gpu.get(g, tl.iloc[:0])
        streams = sorted(d["stream"].unique(), key=lambda s: (s != "compute", str(s)))
        h = 0.8 / max(len(streams), 1)
        for k, s in enumerate(streams):
            rows = d[d["stream"] == s]
            colours = [
                COMM_COLOUR if kind == "comm" else PHASE_COLOURS.get(phase, OTHER_COMPUTE)
                for kind, phase in zip(rows["kind"], rows["phase"], strict=True)
            ]
            other_compute |= any(c == OTHER_COMPUTE for c in colours)
            spans = list(zip(rows["start"] * 1e3, (rows["end"] - rows["start"]) * 1e3, strict=True))
            base = y + 0.9 - (k + 1) * h  # the first stream on top of the band
            # an edge of its own colour keeps a task far shorter than a pixel visible
            ax.broken_barh(
                spans, (base, h * 0.9), facecolors=colours, edgecolors=colours, linewidth=0.6
            )
    ax.set_yticks([y + 0.5 for y in range(len(shown))], [f"GPU {g}" for g in reversed(shown)])
    ax.set_ylim(0, len(shown))
    ax.set_xlabel("simulated time (ms)")
    ax.set_xlim(left=0)
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLOURS.items()]
    if other_compute:
        handles.append(Patch(color=OTHER_COMPUTE, label="other compute"))
    handles.append(Patch(color=COMM_COLOUR, label="communication"))
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0, 1.0),
        ncol=len(handles),
        frameon=False,
        fontsize="small",
    )
    ax.set_title(
        f"{title}\n{note}; per GPU: compute stream on top, then communication",
        fontsize="medium",
        pad=22,
    )
    if fig is not None:
        fig.tight_layout()
    return ax


def plot_timeline(timeline, gpus, title, path, max_gpus=16) -> Path:
    ax = timeline_figure(timeline, gpus, title, max_gpus=max_gpus)
    return save_figure(ax.figure, path)


# -- breakdown -------------------------------------------------------------------------------------


def breakdown_figure(per_gpu: pd.DataFrame, iteration_time: float, title: str, ax=None):
    """Stacked bars per GPU: compute, exposed communication and idle (they add up to the
    iteration time); a black tick marks each GPU's total communication, overlapped or not."""
    plt = pyplot()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(6, min(14, 0.35 * len(per_gpu) + 3)) + 3, 4.5))
    x = np.arange(len(per_gpu))
    ms = per_gpu[["compute", "exposed_comm", "idle", "comm"]].astype(float) * 1e3
    bottom = np.zeros(len(per_gpu))
    for col, label, colour in (
        ("compute", "compute", "tab:blue"),
        ("exposed_comm", "exposed communication", COMM_COLOUR),
        ("idle", "idle", "lightgray"),
    ):
        ax.bar(x, ms[col], bottom=bottom, label=label, color=colour, width=0.8)
        bottom += ms[col].to_numpy()
    ax.scatter(
        x,
        ms["comm"],
        marker="_",
        s=120,
        color="black",
        zorder=3,
        label="communication (total, incl. overlapped)",
    )
    ax.axhline(
        iteration_time * 1e3,
        color="black",
        linestyle=":",
        linewidth=1,
        label=f"iteration {iteration_time * 1e3:.3f} ms",
    )
    step = max(1, math.ceil(len(x) / 32))
    ax.set_xticks(x[::step], [str(g) for g in list(per_gpu.index)[::step]])
    ax.set_xlabel("GPU")
    ax.set_ylabel("time in the iteration (ms)")
    ax.set_ylim(0, iteration_time * 1e3 * 1.05 or 1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ax.set_title(title, fontsize="medium")
    if fig is not None:
        fig.tight_layout()
    return ax


def plot_breakdown(per_gpu, iteration_time, title, path) -> Path:
    return save_figure(breakdown_figure(per_gpu, iteration_time, title).figure, path)


# -- one run, all three ------------------------------------------------------------------------------


def plot_overview(
    timeline,
    per_gpu,
    links,
    gpus,
    iteration_time,
    topology,
    title,
    path,
    max_gpus=16,
    timeline_gpus=None,
):
    """Timeline on top, breakdown and link utilisation below, in one PNG (`timeline_gpus`:
    the GPUs the timeline has rows of, where not every one: a symmetric run's
    representatives)."""
    plt = pyplot()
    drawn = list(gpus) if timeline_gpus is None else list(timeline_gpus)
    shown, _ = sample_gpus(drawn, max_gpus)
    fig = plt.figure(figsize=(15, 5.5 + 0.5 * len(shown)))
    top = 1.6 + 0.5 * len(shown)
    grid = fig.add_gridspec(2, 2, height_ratios=[top, 5.5], width_ratios=[1.1, 1])
    what = "timeline" if timeline_gpus is None else "timeline (representatives)"
    timeline_figure(
        timeline, drawn, f"{title}: {what}", ax=fig.add_subplot(grid[0, :]), max_gpus=max_gpus
    )
    breakdown_figure(per_gpu, iteration_time, "per-GPU breakdown", ax=fig.add_subplot(grid[1, 0]))
    links_figure(links, gpus, topology, "per-link utilisation", ax=fig.add_subplot(grid[1, 1]))
    fig.tight_layout()
    return save_figure(fig, path)


# -- memory over time ---------------------------------------------------------------------------------


def plot_memory(memory, gpus, peak_memory: dict, capacity, verdict: str, path, max_gpus=4) -> Path:
    """Stacked memory over time (`memory`: Result.memory) for the first `max_gpus` of
    `gpus`, the peak GPU among them; the usable capacity drawn where a GPU comes near it.
    Written straight to `path` (Result.save writes it beside and renames)."""
    plt = pyplot()
    from triosim.results.memory import CATEGORIES

    peak_gpu = max(peak_memory, key=peak_memory.get) if peak_memory else None
    gpus = list(dict.fromkeys([peak_gpu, *gpus[:max_gpus]]))[:max_gpus]
    fig, axes = plt.subplots(
        len(gpus), 1, figsize=(9, 1.2 + 1.8 * len(gpus)), sharex=True, squeeze=False
    )
    for ax, g in zip(axes[:, 0], gpus, strict=True):
        d = memory[memory["gpu"] == g]
        ax.stackplot(
            d["time"] * 1e3,
            *[d[c] / 1e9 for c in CATEGORIES],
            step="post",
            labels=[c.replace("_", " ") for c in CATEGORIES],
        )
        if capacity is not None and peak_memory.get(g, 0) > 0.5 * capacity:
            ax.axhline(capacity / 1e9, color="red", ls="--", lw=1, label="usable")
        ax.set_ylabel(f"GPU {g}\nGB")
    axes[0, 0].legend(loc="upper left", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("time (ms)")
    axes[0, 0].set_title(
        f"memory per GPU (peak {max(peak_memory.values(), default=0) / 1e9:.3f} GB; "
        f"fits: {verdict})",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
