"""The wheel carries every file of the packages (modules and their data: the learned model's
table, the Chakra schema), and the `triosim` command. Installing it in a fresh environment
and running the main job takes a minute, so that check is by hand: docs/development.md."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version

import pytest

from tests.conftest import ROOT

PACKAGES = ["triosim", "tracer", "extrapolators", "networks", "perfmodel"]


def _source(dst):
    """The files a wheel is built from, copied: a build in the checkout would reuse its
    build/lib, where a file removed from the tree can linger."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))


def test_wheel_holds_every_package_file(tmp_path):
    pytest.importorskip("build", reason="the dev extra: pip install -e '.[dev]'")
    src, out = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    _source(src)
    run = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (wheel,) = out.glob("triosim-*.whl")
    assert wheel.name.startswith(f"triosim-{version('triosim')}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    files = [
        p.relative_to(src).as_posix()
        for pkg in PACKAGES
        for p in (src / pkg).rglob("*")
        if p.is_file() and not p.name.endswith(".pyc")
    ]
    missing = sorted(set(files) - names)
    assert not missing, f"not in the wheel (add them to package-data in pyproject.toml): {missing}"
    assert "perfmodel/calibration/h100-learned.json" in names
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "triosim = triosim.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
