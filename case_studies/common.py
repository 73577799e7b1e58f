"""What the case-study scripts share: finding the best shipped trace for a model and a GPU,
an output folder, a table written as CSV, and grouped bar charts."""

from __future__ import annotations

import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_FALLBACK = {
    "cnn": "traces/cpu/resnet18-b8.trace.json.gz",
    "transformer": "traces/cpu/gpt2-small-b8.trace.json.gz",
}


def find_trace(model: str, gpu: str, kind: str = "cnn") -> tuple[str, str]:
    """(path, where its times come from) for `model` on `gpu`: a modelled trace for that
    GPU when the project ships one (traces/modelled/<gpu>/), else a real CPU trace of a
    model of the same kind, named as such so that no figure passes it off as a GPU."""
    folder = ROOT / "traces" / "modelled"
    for sub in sorted(folder.glob("*")) if folder.exists() else []:
        if sub.name.lower().startswith(gpu.lower().split("-")[0]):
            hits = sorted(sub.glob(f"{model}*.trace.json.gz")) or sorted(sub.glob(f"{model}*"))
            if hits:
                return str(hits[0]), f"{gpu} times modelled ({hits[0].name})"
    path = ROOT / CPU_FALLBACK[kind]
    return str(path), f"CPU times of {path.name} (no modelled {model} trace for {gpu} shipped)"


def out_dir(path) -> Path:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def grouped_bars(
    path: Path,
    groups: list[str],
    series: dict[str, list[float]],
    ylabel: str,
    title: str,
    note: str = "",
    baseline: float | None = None,
) -> Path:
    """One group of bars per entry of `groups`, one bar per series; `note` under the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(groups))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(groups) + 2), 4))
    for k, (name, values) in enumerate(series.items()):
        ax.bar(x + (k - (len(series) - 1) / 2) * width, values, width, label=name)
    if baseline is not None:
        ax.axhline(baseline, color="grey", lw=0.8, ls="--")
        low = min(min(v) for v in series.values())
        ax.set_ylim(min(low, baseline) - 0.05 * abs(baseline), None)  # show the differences
    ax.set_xticks(x, groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def share_bars(
    path: Path,
    labels: list[str],
    compute: list[float],
    comm: list[float],
    title: str,
    ylabel: str = "share of the iteration",
    above=None,
    compute_label: str = "compute",
) -> Path:
    """Stacked compute and exposed-communication shares per bar; `above`: a text per bar
    (e.g. the iteration time), written over it, with the legend then beside the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(labels)), 4.2))
    ax.bar(labels, compute, label=compute_label, color="tab:blue")
    ax.bar(labels, comm, bottom=compute, label="exposed communication", color="tab:red")
    if above is not None:
        for x, text in enumerate(above):
            ax.text(x, 1.01, text, ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, 1.12)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    else:
        ax.legend(loc="lower right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
