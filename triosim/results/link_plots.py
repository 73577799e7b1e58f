"""The per-link utilisation figure: links coloured on the topology's own drawing (rings as
circles, meshes and tori as grids), else the busiest links as bars."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from triosim.results.figures import CIRCLE_KINDS, GRID_KINDS, pyplot, save_figure

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
    plt = pyplot()
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

    plt = pyplot()
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
    return save_figure(links_figure(links, gpus, topology, title).figure, path)
