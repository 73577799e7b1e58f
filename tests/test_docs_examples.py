"""The examples in README.md and docs/*.md run, and print what the page says they print.

A fenced block right after a `<!-- doctest -->` line is run, in page order, in a scratch
folder that sees the checkout's traces/ and examples/ (so paths read as in a checkout):

- ```yaml title="NAME"```: written to NAME, for the commands after it;
- ```console```: each `$ triosim ...` line is run (in this process: no interpreter start)
  and its stdout must be the lines below it, up to the next `$`;
- ```python```: run; what it prints must be the next block marked `<!-- doctest: output -->`.

Expected output is compared line by line, numbers included, so a change that moves a number
fails here until the page follows. `...` stands for any text within a line (a wall time), and
a line of only `...` for any lines. Unmarked blocks are prose (slow runs, illustrations).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

RUN = "<!-- doctest -->"
OUTPUT = "<!-- doctest: output -->"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass
class Block:
    mark: str  # RUN or OUTPUT
    lang: str
    title: str | None
    text: str
    line: int  # of the opening fence, 1-based


def blocks(path: Path) -> list[Block]:
    """The marked fenced blocks of a page, in order."""
    lines = path.read_text().split("\n")
    out = []
    i = 0
    while i < len(lines):
        mark = lines[i].strip()
        if mark not in (RUN, OUTPUT):
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        m = re.match(r"^```(\w+)(.*)$", lines[j]) if j < len(lines) else None
        assert m, f"{path.name}:{i + 1}: {mark} must be followed by a fenced block"
        title = re.search(r'title="([^"]+)"', m.group(2))
        end = lines.index("```", j + 1)
        body = "\n".join(lines[j + 1 : end])
        out.append(Block(mark, m.group(1), title and title.group(1), body, j + 1))
        i = end + 1
    return out


def matches(expected: str, actual: str) -> bool:
    """`actual` is `expected`, trailing spaces and blank lines aside; `...` is a wildcard."""
    parts = []
    for line in expected.rstrip("\n").split("\n"):
        line = line.rstrip()
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(r"[^\n]*?".join(map(re.escape, line.split("..."))) + r"\n")
    text = "\n".join(x.rstrip() for x in actual.rstrip("\n").split("\n")) + "\n"
    return re.fullmatch("".join(parts), text, flags=re.DOTALL) is not None


def _check(where: str, expected: str, actual: str) -> None:
    if not matches(expected, actual):
        diff = "\n".join(
            difflib.unified_diff(
                expected.split("\n"),
                actual.rstrip("\n").split("\n"),
                "the page",
                "the run",
                lineterm="",
            )
        )
        pytest.fail(f"{where}: the output differs from the page\n{diff}", pytrace=False)


def _triosim(argv: list[str]) -> str:
    from triosim.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    assert code in (0, None), f"triosim {' '.join(argv)} exited with {code}"
    return buf.getvalue()


def _console(where: str, text: str) -> None:
    commands: list[tuple[str, list[str]]] = []
    for line in text.split("\n"):
        if line.startswith("$ "):
            commands.append((line[2:], []))
        else:
            assert commands, f"{where}: a console block starts with a `$ ` command"
            commands[-1][1].append(line)
    for command, expected in commands:
        argv = shlex.split(command, comments=True)
        assert argv[0] == "triosim", f"{where}: only triosim commands are run ({command})"
        _check(f"{where}: $ {command}", "\n".join(expected), _triosim(argv[1:]))


def _python(code: str) -> str:
    import sys
    import types

    # a module of its own, as a script's: dataclasses look their class's module up
    module = types.ModuleType("__doc_example__")
    sys.modules[module.__name__] = module
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "<doc example>", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return buf.getvalue()


def run_page(path: Path, folder: Path) -> int:
    """Run a page's marked blocks in `folder` (the current directory); how many ran."""
    for name in ("traces", "examples"):
        (folder / name).symlink_to(ROOT / name, target_is_directory=True)
    page = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    pending = None  # a Python block's output, waiting for its OUTPUT block
    done = 0
    for b in blocks(path):
        where = f"{page}:{b.line}"
        if b.mark == OUTPUT:
            assert pending is not None, f"{where}: an output block follows no Python block"
            _check(where, b.text, pending)
            pending = None
        elif b.lang == "yaml" and b.title:
            (folder / b.title).write_text(b.text + "\n")
        elif b.lang == "console":
            _console(where, b.text)
        elif b.lang == "python":
            pending = _python(b.text) or None  # one that prints nothing needs no output block
        else:
            pytest.fail(f"{where}: a ```{b.lang} block cannot be run (mark yaml with a title)")
        done += 1
    assert pending is None, f"{page}: a Python block's output has no output block"
    return done


MARKED = [p for p in PAGES if any(b.mark == RUN for b in blocks(p))]


@pytest.mark.parametrize("path", MARKED, ids=[str(p.relative_to(ROOT)) for p in MARKED])
def test_page_examples(path, tmp_path, monkeypatch, scratch_registries):
    # (a page may register a part of its own, docs/extending.md a network: gone after it)
    monkeypatch.chdir(tmp_path)
    assert run_page(path, tmp_path) > 0


def test_pages_with_examples():
    # the README and the tutorial are the pages a new user runs first
    names = {str(p.relative_to(ROOT)) for p in MARKED}
    assert {"README.md", "docs/tutorial.md"} <= names


def test_matching():
    assert matches("a 1.5 ms\nsimulated in ... s wall", "a 1.5 ms  \nsimulated in 0.02 s wall\n")
    assert not matches("a 1.5 ms", "a 1.6 ms")
    assert matches("head\n...\ntail", "head\nx\ny\ntail")
    assert not matches("head\ntail", "head\nx\ntail")
    # an in-line `...` stays on its line (it spanned lines under DOTALL)
    assert not matches("iteration ... ms", "iteration 1 ms\nextra line\nanother 2 ms")


def test_a_changed_number_fails(tmp_path, monkeypatch):
    """A page whose printed number is off by one digit fails, naming the line."""
    page = ROOT / "README.md"
    text = page.read_text()
    assert "iteration time                71.6475 ms" in text
    bad = tmp_path / "README.md"
    bad.write_text(text.replace("71.6475 ms", "71.6476 ms"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)README.md:\d+: .*71\.6476 ms"):
        run_page(bad, work)


def all_yaml_blocks():
    """(where, text) of every ```yaml block in the pages, marked or not."""
    out = []
    for path in PAGES:
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            if re.match(r"^\s*```yaml\b", line):
                indent = len(line) - len(line.lstrip())
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                body = "\n".join(x[indent:] for x in lines[i + 1 : end])
                out.append((f"{path.relative_to(ROOT)}:{i + 1}", body))
    return out


YAML_BLOCKS = all_yaml_blocks()


class _NoDuplicates(__import__("yaml").SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (YAML keeps the last)."""


def _mapping(loader, node, deep=False):
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    dup = {k for k in keys if keys.count(k) > 1}
    assert not dup, f"line {node.start_mark.line + 1}: {sorted(dup)} given twice"
    return loader.construct_mapping(node, deep)


_NoDuplicates.add_constructor(
    __import__("yaml").resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping
)


@pytest.mark.parametrize("where, text", YAML_BLOCKS, ids=[w for w, _ in YAML_BLOCKS])
def test_every_yaml_example_is_a_valid_config(where, text, tmp_path):
    """Every YAML example in the docs, run or not, is what the loader takes: a whole config
    or a part of one (its sections checked field by field, units and bounds included, on a
    config with a placeholder trace), or a sweep's grid file (its base and every point);
    no key given twice (YAML would keep the last without a word)."""
    import yaml

    from triosim.config.loading import from_dict

    data = yaml.load(text, Loader=_NoDuplicates)  # noqa: S506 (a safe loader's subclass)
    assert isinstance(data, dict), f"{where}: a mapping of config fields"
    if "grid" in data or "zip" in data:  # a sweep's grid file, where the examples' are
        from triosim.studies.sweep import points, read_grid

        (tmp_path / "sweeps").mkdir()
        for f in (ROOT / "examples").glob("*.yaml"):
            (tmp_path / f.name).write_text(f.read_text().replace("../traces", str(ROOT / "traces")))
        grid = tmp_path / "sweeps" / "grid.yaml"
        grid.write_text(text)
        spec = read_grid(grid)
        assert points(spec.base, spec.grid, spec.zipped, spec.base_dir, spec.grid_dir)
        return
    mode = (data.get("parallelism") or {}).get("mode")
    cfg = data if mode == "chakra" else {"trace": "placeholder.trace.json", **data}
    try:
        from_dict(cfg, base_dir=ROOT / "examples")
    except Exception as e:  # the message names the field
        pytest.fail(f"{where}: {e}", pytrace=False)
