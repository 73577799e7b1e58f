"""MkDocs hooks (mkdocs.yml): the home page is README.md, the reference pages are rendered
from the code and the architecture figure is redrawn, at every build, so none can go stale."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS))

import gen_reference  # noqa: E402  (docs/ is not a package)


def readme_as_home() -> str:
    """README.md with its links made relative to docs/ (the site's root)."""
    text = (ROOT / "README.md").read_text()
    text = text.replace("](docs/)", "](index.md)")
    return re.sub(r"\]\(docs/", "](", text)


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=readme_as_home()))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri in gen_reference.PAGES:
        return gen_reference.render(page.file.src_uri)
    return markdown


def on_post_build(config):
    sys.path.insert(0, str(DOCS))
    import architecture_figure

    with contextlib.redirect_stdout(io.StringIO()):  # its "wrote ..." line: not in a build's log
        architecture_figure.draw(Path(config["site_dir"]) / "img" / "architecture.png")
