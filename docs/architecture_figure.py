"""Draw docs/img/architecture.png: the floors as pyproject.toml's import contracts give them,
each folder with its lines of code, and the path a config takes to a timeline.

    python docs/architecture_figure.py [OUT.png]

The floors are read from the contracts (one per floor, lowest first), so the figure cannot
drift from what `lint-imports` holds.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib
import tomllib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# What a config meets on its way to a timeline, top to bottom, and the folder doing it
FLOW = [
    ("triosim.cli", "triosim simulate CONFIG (or Python)"),
    ("triosim.config", "load the config, check every field"),
    ("triosim.trace", "read the one-GPU trace"),
    ("triosim.simulation", "wire one SimPy environment"),
    ("extrapolators.modes", "trace + plan -> per-GPU task streams"),
    ("extrapolators.execution", "run each GPU's tasks, log them"),
    ("perfmodel", "an operator's seconds on the target GPU"),
    ("extrapolators.communication", "a collective -> transfers"),
    ("networks", "move the bytes (max-min fair flows)"),
    ("triosim.results", "iteration time, timelines, memory"),
]


def floors() -> list[tuple[str, list[str]]]:
    """(name, folders) per floor, lowest first, from the 'Floor k, NAME (...)' contracts."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    out = {}
    for c in contracts["contracts"]:
        m = re.match(r"Floor (\d+), ([^(:]+)", c["name"])
        if m and c["type"] == "forbidden":
            out[int(m.group(1))] = (m.group(2).strip(), list(c["source_modules"]))
    # the top floor has no contract of its own: it is what the floor below may not import
    top = max(out)
    last = next(c for c in contracts["contracts"] if c["name"].startswith(f"Floor {top},"))
    out[top + 1] = ("command line", list(last["forbidden_modules"]))
    return [out[k] for k in sorted(out)]


def lines_of(module: str) -> int:
    path = ROOT / module.replace(".", "/")
    files = path.rglob("*.py") if path.is_dir() else [path.with_suffix(".py")]
    return sum(len(f.read_text().splitlines()) for f in files)


def draw(out: Path) -> None:
    fl = floors()
    fig, ax = plt.subplots(figsize=(13, 0.9 * len(fl) + 1.2))
    ax.set_xlim(0, 13)
    ax.set_ylim(-0.3, len(fl) + 0.2)
    ax.axis("off")
    centre, w_of = {}, {}
    for i, (name, mods) in enumerate(fl):
        y = i
        ax.add_patch(
            FancyBboxPatch(
                (0.05, y + 0.05), 8.4, 0.8, boxstyle="round,pad=0.02", fc="#eef2f7", ec="#7a8ca5"
            )
        )
        ax.text(0.2, y + 0.45, f"{i + 1}  {name}", va="center", fontsize=10, weight="bold")
        w = 5.6 / len(mods)
        for j, m in enumerate(mods):
            x = 2.7 + j * w
            ax.add_patch(
                FancyBboxPatch(
                    (x + 0.05, y + 0.15),
                    w - 0.1,
                    0.6,
                    boxstyle="round,pad=0.02",
                    fc="white",
                    ec="#4c6a92",
                )
            )
            label = m.replace(".", "/") + "/"
            ax.text(
                x + w / 2,
                y + 0.52,
                label,
                ha="center",
                va="center",
                fontsize=8.5,
                family="monospace",
            )
            ax.text(
                x + w / 2,
                y + 0.3,
                f"{lines_of(m):,} lines",
                ha="center",
                va="center",
                fontsize=7,
                color="#555",
            )
            centre[m] = (x + w / 2, y + 0.45)
            w_of[m] = w
    # the flow, as numbered steps on the right and arrows between the folders they use
    ax.text(8.8, len(fl) - 0.1, "how a config becomes a timeline", fontsize=10, weight="bold")
    for k, (m, what) in enumerate(FLOW):
        ax.text(
            8.8,
            len(fl) - 0.5 - k * (len(fl) - 0.6) / len(FLOW),
            f"{k + 1:2d}. {what}",
            fontsize=8.5,
            va="center",
        )
        cx, cy = centre[m]
        ax.text(
            cx - w_of[m] / 2 + 0.2,
            cy + 0.3,
            f"{k + 1}",
            fontsize=9,
            color="white",
            ha="center",
            va="center",
            weight="bold",
            bbox={"boxstyle": "circle,pad=0.2", "fc": "#b03030", "ec": "none"},
        )
    ax.text(
        0.05,
        -0.2,
        "A folder imports only from its own floor and the floors below "
        "(pyproject.toml, checked by lint-imports).",
        fontsize=8,
        color="#444",
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    # the counts drawn, in the PNG's metadata: tests/test_docs_site.py compares them with
    # the tree's, so a committed figure far from the code fails
    counts = {m: lines_of(m) for _, mods in fl for m in mods}
    fig.savefig(out, dpi=110, metadata={"Description": json.dumps(counts, sort_keys=True)})
    print(f"wrote {out}")


if __name__ == "__main__":
    draw(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/img/architecture.png")
