"""Figures of one run (timeline, per-GPU breakdown, per-link utilisation) and of a sweep.

Every function takes plain DataFrames (as a Result holds them, or as read back from a saved
result folder) and writes a PNG; matplotlib is imported only here, and only when a figure
is drawn. Times on the axes are milliseconds.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

# compute colours by phase; every communication task is red
PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
OTHER_COMPUTE = "tab:gray"
COMM_COLOUR = "tab:red"
# topologies whose GPUs have a natural drawing: links coloured on that drawing
CIRCLE_KINDS = ("ring", "ring_chord", "double_ring")
GRID_KINDS = ("mesh2d", "torus2d")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    from triosim.common.outputs import replacing

    path = Path(path)
    try:
        with replacing(path) as tmp:  # whole, or the old figure stays
            fig.savefig(tmp, dpi=100)
    finally:
        _pyplot().close(fig)
    return path


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

    plt = _pyplot()
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
    return _save(ax.figure, path)


# -- breakdown -------------------------------------------------------------------------------------


def breakdown_figure(per_gpu: pd.DataFrame, iteration_time: float, title: str, ax=None):
    """Stacked bars per GPU: compute, exposed communication and idle (they add up to the
    iteration time); a black tick marks each GPU's total communication, overlapped or not."""
    plt = _pyplot()
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
    return _save(breakdown_figure(per_gpu, iteration_time, title).figure, path)


# -- per-link utilisation -----------------------------------------------------------------------


def grid_shape(n: int, rows=None, cols=None) -> tuple[int, int]:
    """The rows x cols of a mesh2d/torus2d of n GPUs, as the topology builds it."""
    if rows is None and cols is None:
        rows = next(r for r in range(math.isqrt(n), 0, -1) if n % r == 0)
    rows = rows or n // cols
    cols = cols or n // rows
    return int(rows), int(cols)


def _positions(kind: str, gpus: list, rows=None, cols=None) -> dict | None:
    n = len(gpus)
    if kind in CIRCLE_KINDS:
        return {
            g: (math.sin(2 * math.pi * i / n), math.cos(2 * math.pi * i / n))
            for i, g in enumerate(gpus)
        }
    if kind in GRID_KINDS:
        rows, cols = grid_shape(n, rows, cols)
        if rows * cols != n:
            return None
        return {g: (i % cols, -(i // cols)) for i, g in enumerate(gpus)}
    return None


def links_figure(links: pd.DataFrame, gpus: list, topology: dict, title: str, ax=None):
    """Per-link-direction utilisation (busy share of the run). Rings are drawn as circles
    and meshes/tori as grids, each direction of a link a line of its own, coloured by its
    utilisation; other topologies get a bar chart of the busiest link directions."""
    plt = _pyplot()
    kind = topology.get("kind", "")
    pos = _positions(kind, list(gpus), topology.get("rows"), topology.get("cols"))
    keyed = {str(g): g for g in gpus}
    if pos is not None:  # a saved links.csv may hold GPU ids as text
        src = links["src"].map(lambda v: keyed.get(str(v), v))
        dst = links["dst"].map(lambda v: keyed.get(str(v), v))
        if not (src.isin(list(pos)).all() and dst.isin(list(pos)).all()):
            pos = None  # a switch or an edited topology: no drawing of it
    fig = None
    if pos is None:
        if ax is None:
            fig, ax = plt.subplots(figsize=(8, 6))
        note = _busiest_links(ax, links)
    else:
        if ax is None:
            xy = np.array(list(pos.values()), dtype=float)
            w, h = np.ptp(xy[:, 0]) + 1, np.ptp(xy[:, 1]) + 1
            scale = min(9 / w, 9 / h, 1.2)
            fig, ax = plt.subplots(figsize=(max(w * scale, 3) + 3, max(h * scale, 3) + 1.2))
        note = _drawn_links(ax, links, src, dst, pos, kind)
    ax.set_title(f"{title}\n" + textwrap.fill(note, 80), fontsize="medium")
    if fig is not None:
        fig.tight_layout()
    return ax


def _busiest_links(ax, links, top=30):
    d = links.sort_values("utilisation", ascending=False, kind="stable").head(top)
    labels = [f"{s} \u2192 {t}" for s, t in zip(d["src"], d["dst"], strict=True)][::-1]
    ax.barh(range(len(d)), d["utilisation"][::-1] * 100, color="tab:purple")
    ax.set_yticks(range(len(d)), labels, fontsize="small" if len(d) <= 20 else "x-small")
    ax.set_xlabel("utilisation (% of the run the link direction is busy)")
    ax.set_ylabel("link direction (src \u2192 dst)")
    return (
        f"all {len(d)} link directions"
        if len(d) == len(links)
        else f"the {len(d)} busiest of {len(links)} link directions"
    )


def _drawn_links(ax, links, src, dst, pos, kind):
    """Each link direction an arrow (a line past 128 GPUs) on the GPUs' drawing at `pos`,
    coloured by its utilisation; returns the note for the title."""
    from matplotlib.cm import ScalarMappable

    plt = _pyplot()
    xy = np.array(list(pos.values()), dtype=float)
    small = len(pos) <= 128
    unit = 1.0 if kind in GRID_KINDS else 2 * math.sin(math.pi / max(len(pos), 2))  # one hop
    segments, values, far = _link_segments(links, src, dst, pos, kind, unit)
    vmax = max(max(values, default=0.0), 1e-9)
    cmap, norm = plt.get_cmap("turbo"), plt.Normalize(0, vmax)
    # sizes from the room one hop gets on this axes, in points
    box = ax.get_position()
    w_in, h_in = box.width * ax.figure.get_figwidth(), box.height * ax.figure.get_figheight()
    extent = np.ptp(xy, axis=0) + 1.2 * unit
    hop = 72 * unit * min(w_in / extent[0], h_in / extent[1])
    marker = min(20.0, 0.42 * hop)  # diameter, points
    _draw_directions(ax, segments, values, far, small, cmap, norm, hop)
    ax.scatter(
        xy[:, 0],
        xy[:, 1],
        s=marker**2,
        color="white",
        edgecolors="black",
        linewidths=0.8 if marker > 6 else 0.4,
        zorder=3,
    )
    font = min(7.0, 0.4 * marker)
    if small and font >= 4:
        for g, (x, y) in pos.items():
            ax.text(x, y, str(g), ha="center", va="center", fontsize=font, zorder=4)
    ax.set_aspect("equal")
    ax.update_datalim(xy)
    if segments:
        ax.update_datalim(np.array(segments).reshape(-1, 2))
    ax.autoscale_view()
    ax.margins(0.06)
    ax.set_axis_off()
    cb = ax.figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.8)
    cb.set_label("utilisation (% of the run the link direction is busy)")
    where = (
        "GPUs on a circle in ring order"
        if kind in CIRCLE_KINDS
        else "GPU r*cols+c at row r, column c"
        + (", wrap-around links as stubs" if kind == "torus2d" else "")
    )
    return f"{where}; each direction of a link drawn to the right of its travel"


def _link_segments(links, src, dst, pos, kind, unit):
    """Per link direction: its segment (beside the other direction's, clear of the GPU
    markers), its utilisation in %, and whether it joins GPUs that are not neighbours."""
    offset = 0.07 * unit  # the two directions of a link side by side
    segments, values, far = [], [], []
    for s, t, u in zip(src, dst, links["utilisation"], strict=True):
        (x0, y0), (x1, y1) = pos[s], pos[t]
        dx, dy = x1 - x0, y1 - y0
        length = math.hypot(dx, dy)
        if kind == "torus2d" and length > 1.5 * unit:  # a wrap-around link: a stub outwards
            dx, dy = -np.sign(dx) * 0.45 * unit, -np.sign(dy) * 0.45 * unit
            x1, y1, length = x0 + dx, y0 + dy, 0.45 * unit
        if length == 0:
            continue
        far.append(length > 1.5 * unit)  # not a neighbour (a photonic circuit): drawn curved
        nx_, ny_ = dy / length * offset, -dx / length * offset  # to the right of s -> t
        a = min(0.2 * unit / length, 0.3)  # keep clear of the GPU markers
        b = a if length > 0.5 * unit else 0.0  # (a stub starts at its GPU and runs out)
        segments.append(
            [(x0 + dx * a + nx_, y0 + dy * a + ny_), (x1 - dx * b + nx_, y1 - dy * b + ny_)]
        )
        values.append(u * 100)
    return segments, values, far


def _draw_directions(ax, segments, values, far, small, cmap, norm, hop):
    """Arrows when the GPUs are few (each direction readable on its own), else one line
    collection; `hop` (points) sizes them."""
    from matplotlib.collections import LineCollection

    if small:
        for (p0, p1), v, curved in zip(segments, values, far, strict=True):
            ax.annotate(
                "",
                xy=p1,
                xytext=p0,
                annotation_clip=False,
                arrowprops={
                    "arrowstyle": "-|>",
                    "lw": min(2.0, max(0.6, 0.045 * hop)),
                    "color": cmap(norm(v)),
                    "shrinkA": 0,
                    "shrinkB": 0,
                    "mutation_scale": min(11.0, max(4.0, 0.2 * hop)),
                    "connectionstyle": f"arc3,rad={0.25 if curved else 0}",
                },
            )
    else:
        lc = LineCollection(
            segments, cmap=cmap, norm=norm, linewidths=min(1.6, max(0.5, 0.05 * hop))
        )
        lc.set_array(np.array(values))
        ax.add_collection(lc)


def plot_links(links, gpus, topology, title, path) -> Path:
    return _save(links_figure(links, gpus, topology, title).figure, path)


# -- one run, all three ------------------------------------------------------------------------------


def plot_overview(
    timeline, per_gpu, links, gpus, iteration_time, topology, title, path, max_gpus=16
):
    """Timeline on top, breakdown and link utilisation below, in one PNG."""
    plt = _pyplot()
    shown, _ = sample_gpus(list(gpus), max_gpus)
    fig = plt.figure(figsize=(15, 5.5 + 0.5 * len(shown)))
    top = 1.6 + 0.5 * len(shown)
    grid = fig.add_gridspec(2, 2, height_ratios=[top, 5.5], width_ratios=[1.1, 1])
    timeline_figure(
        timeline, gpus, f"{title}: timeline", ax=fig.add_subplot(grid[0, :]), max_gpus=max_gpus
    )
    breakdown_figure(per_gpu, iteration_time, "per-GPU breakdown", ax=fig.add_subplot(grid[1, 0]))
    links_figure(links, gpus, topology, "per-link utilisation", ax=fig.add_subplot(grid[1, 1]))
    fig.tight_layout()
    return _save(fig, path)


# -- memory over time ---------------------------------------------------------------------------------


def plot_memory(memory, gpus, peak_memory: dict, capacity, verdict: str, path, max_gpus=4) -> Path:
    """Stacked memory over time (`memory`: Result.memory) for the first `max_gpus` of
    `gpus`, the peak GPU among them; the usable capacity drawn where a GPU comes near it.
    Written straight to `path` (Result.save writes it beside and renames)."""
    plt = _pyplot()
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
    return SavedResult(timeline, per_gpu, links, list(per_gpu.index), t, topology, title)


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
        return plot_timeline(s.timeline, s.gpus, s.title, path, max_gpus)
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
    )


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
    plt = _pyplot()
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
    return _save(fig, path)


def plot_compare(table: pd.DataFrame, labels: list[str], path, title: str) -> Path:
    """Grouped bars: one group per metric (rows of `table`, ms), one bar per run."""
    plt = _pyplot()
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
    return _save(fig, path)
