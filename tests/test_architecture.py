"""The floors hold every folder: pyproject.toml's contracts are consistent and complete.

lint-imports checks the imports against the contracts; these tests check the contracts
themselves, so that a new folder or a module dropped at a package's top cannot sit on no
floor (where no contract would hold it).
"""

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["triosim", "tracer", "extrapolators", "networks", "perfmodel"]


def _contracts():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _floors() -> dict[int, list[str]]:
    """Floor number -> its folders, from the 'Floor k, ...' contracts; the top floor is what
    the highest contract forbids and no contract holds."""
    floors, forbidden = {}, {}
    for c in _contracts():
        m = re.match(r"Floor (\d+),", c["name"])
        if m:
            assert c["type"] == "forbidden", c["name"]
            floors[int(m.group(1))] = list(c["source_modules"])
            forbidden[int(m.group(1))] = list(c["forbidden_modules"])
    top = max(floors)
    floors[top + 1] = [m for m in forbidden[top] if not any(m in f for f in floors.values())]
    return floors, forbidden


def test_floor_contracts_are_numbered_from_one_and_each_forbids_exactly_the_floors_above():
    floors, forbidden = _floors()
    assert sorted(floors) == list(range(1, len(floors) + 1))
    for k, banned in forbidden.items():
        above = [m for j in range(k + 1, len(floors) + 1) for m in floors[j]]
        assert sorted(banned) == sorted(above), f"floor {k} forbids {banned}, floors above: {above}"
    # no contract lists exceptions: a floor is held whole
    assert all("ignore_imports" not in c for c in _contracts())


def _folders() -> list[str]:
    """Every package folder that must sit on a floor: the top packages that hold modules, and
    the subpackages of the two that hold several floors."""
    out = []
    for pkg in PACKAGES:
        subs = sorted(p.parent for p in (ROOT / pkg).glob("*/__init__.py"))
        if pkg in ("triosim", "extrapolators"):
            out += [f"{pkg}.{s.name}" for s in subs]
        else:
            out.append(pkg)
    return out


def test_every_folder_sits_on_exactly_one_floor():
    floors, _ = _floors()
    placed = [m for mods in floors.values() for m in mods]
    assert len(placed) == len(set(placed)), placed
    for folder in _folders():
        homes = [m for m in placed if folder == m or folder.startswith(m + ".")]
        assert len(homes) == 1, f"{folder} sits on {homes or 'no floor'}"


@pytest.mark.parametrize("pkg", ["triosim", "extrapolators"])
def test_packages_spanning_floors_keep_no_module_of_their_own(pkg):
    """A module directly in triosim/ or extrapolators/ would be on no floor: it goes in the
    folder of its floor (docs/architecture.md says which)."""
    loose = sorted(p.name for p in (ROOT / pkg).glob("*.py") if p.name != "__init__.py")
    assert loose == []


def test_extrapolators_face_imports_nothing():
    """Importing the runtime must not load the modes above it (the face hands nothing on)."""
    text = (ROOT / "extrapolators" / "__init__.py").read_text()
    assert not re.search(r"^\s*(import|from)\s", text, re.M)
