"""What every figure shares: the colours, matplotlib (imported only when a figure is drawn,
with the Agg backend) and writing a PNG whole (or the old one stays)."""

from __future__ import annotations

from pathlib import Path

# compute colours by phase; every communication task is red
PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
OTHER_COMPUTE = "tab:gray"
COMM_COLOUR = "tab:red"
# topologies whose GPUs have a natural drawing: links coloured on that drawing
CIRCLE_KINDS = ("ring", "ring_chord", "double_ring")
GRID_KINDS = ("mesh2d", "torus2d")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> Path:
    from triosim.common.outputs import replacing

    path = Path(path)
    try:
        with replacing(path) as tmp:  # whole, or the old figure stays
            fig.savefig(tmp, dpi=100)
    finally:
        pyplot().close(fig)
    return path
