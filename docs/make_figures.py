"""Redraw the run figures in docs/img/ with the library's own plots, from the shipped
examples (the tutorial and the README show them beside the commands that make them):

    python docs/make_figures.py

gpipe-timeline.png and gpipe-breakdown.png (examples/gpipe.yaml), compare.png (dp, ddp and
gpipe), sweep.png (examples/sweeps/dp_vs_ddp.yaml, in this process) and wafer-links.png
(examples/photonic_wafer.yaml). docs/architecture_figure.py draws architecture.png.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

IMG = ROOT / "docs" / "img"


def triosim(*argv: str) -> None:
    from triosim.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    if code:
        raise SystemExit(f"triosim {' '.join(argv)} exited with {code}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        out = Path("out")  # relative: the plots' titles name it as the tutorial does
        ex = ROOT / "examples"
        triosim("simulate", str(ex / "gpipe.yaml"), "--out", str(out / "gpipe"))
        shutil.copy(out / "gpipe" / "timeline.png", IMG / "gpipe-timeline.png")
        triosim(
            "plot",
            str(out / "gpipe"),
            "--kind",
            "breakdown",
            "--out",
            str(IMG / "gpipe-breakdown.png"),
            "--force",
        )
        triosim(
            "compare",
            str(ex / "dp.yaml"),
            str(ex / "ddp.yaml"),
            str(out / "gpipe"),
            "--out",
            str(IMG / "compare.png"),
            "--force",
        )
        triosim(
            "sweep",
            str(ex / "sweeps" / "dp_vs_ddp.yaml"),
            "--workers",
            "1",
            "--out",
            str(out / "dp_vs_ddp"),
        )
        triosim(
            "plot",
            str(out / "dp_vs_ddp"),
            "--y",
            "exposed_comm_ms_mean",
            "--hue",
            "parallelism.mode",
            "--out",
            str(IMG / "sweep.png"),
            "--force",
        )
        triosim("simulate", str(ex / "photonic_wafer.yaml"), "--out", str(out / "wafer"))
        triosim(
            "plot",
            str(out / "wafer"),
            "--kind",
            "links",
            "--out",
            str(IMG / "wafer-links.png"),
            "--force",
        )
    print(f"redrew {IMG}: gpipe-timeline, gpipe-breakdown, compare, sweep, wafer-links")


if __name__ == "__main__":
    main()
