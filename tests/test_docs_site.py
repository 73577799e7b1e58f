"""The manual builds (`mkdocs build --strict`: every link and anchor resolves), its generated
reference pages are those the code gives now, and the architecture figure counts the tree."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from triosim.common.schema import option

sys.path.append(str(ROOT / "docs"))  # last: docs/ holds scripts, not packages

import gen_reference  # noqa: E402  (docs/ is not a package)


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    home = (site / "index.html").read_text()
    assert "Run the main job" in home and "h100_node_ddp.yaml" in home  # the README
    assert 'href="reference/configuration/"' in home  # its docs/ links point into the site
    config = (site / "reference" / "configuration" / "index.html").read_text()
    assert "inter_bandwidth" in config and "dp_shard" in config
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "Simulation" in api and "load_any_trace" in api
    assert (site / "img" / "architecture.png").stat().st_size > 10_000  # redrawn by the hook


@pytest.mark.parametrize("page", sorted(gen_reference.PAGES))
def test_reference_page_is_current(page):
    committed = (ROOT / "docs" / page).read_text()
    assert committed == gen_reference.render(page), (
        f"docs/{page} is stale: run python docs/gen_reference.py"
    )


def test_every_config_field_is_in_the_reference():
    from triosim.common import schema
    from triosim.config.loading import TopLevel, _sections

    page = gen_reference.configuration_page()
    parts = [TopLevel]
    for cls, _, registry in _sections().values():
        parts.append(cls)
        parts += [getattr(p, "Options", schema.NoOptions) for _, p in registry.items()]
    for cls in parts:
        for name in schema.field_names(cls):
            assert f".{name}`" in page or f"`{name}`" in page, (cls.__name__, name)


def test_a_new_field_changes_the_reference(monkeypatch):
    """What the staleness test relies on: a field added to an Options class shows."""
    from networks.topology import SwitchOptions

    @dataclasses.dataclass(frozen=True)
    class Wider(SwitchOptions):
        ports: int = option(64, ge=1, help="ports per switch")

    before = gen_reference.configuration_page()
    from networks.topology import TOPOLOGIES

    monkeypatch.setattr(TOPOLOGIES.get("switch"), "Options", Wider, raising=False)
    after = gen_reference.configuration_page()
    assert "`topology.ports`" in after and "`topology.ports`" not in before


def test_cli_reference_lists_every_command():
    from triosim.cli.main import build_parser

    page = gen_reference.cli_page()
    for name, sub, _ in gen_reference._subcommands(build_parser()):
        assert f"## triosim {name}\n" in page
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page, (name, flag)


def test_architecture_figure_counts_the_tree():
    """The committed figure's line counts (its PNG metadata) are within 25 % of the tree's
    and name the same folders: a figure left far behind the code fails (the site's copy is
    redrawn at every build). Redraw: python docs/architecture_figure.py"""
    import architecture_figure
    from PIL import Image

    drawn = json.loads(Image.open(ROOT / "docs" / "img" / "architecture.png").text["Description"])
    now = {
        m: architecture_figure.lines_of(m) for _, mods in architecture_figure.floors() for m in mods
    }
    assert drawn.keys() == now.keys()
    far = {m: (drawn[m], now[m]) for m in now if abs(drawn[m] - now[m]) > 0.25 * now[m]}
    assert not far, f"docs/img/architecture.png is stale (drawn, now): {far}"


def test_the_reference_lists_the_shipped_gpus_only():
    """A GPU a config defined earlier in the same process (`gpus:`, entered in the
    catalogue) is not in the reference: the page depends on the code, not on what ran."""
    from triosim.hardware import catalogue
    from triosim.hardware.custom import GPUSpec, define

    define(GPUSpec(name="doc-test-gpu", base="H100-SXM"))
    try:
        page = gen_reference.render("reference/configuration.md")
    finally:
        del catalogue.GPUS["doc-test-gpu"]
    assert "doc-test-gpu" not in page and "`H100-SXM`" in page
    assert page == (ROOT / "docs" / "reference" / "configuration.md").read_text()
