"""The documentation stays true to the code and to itself.

- docs/configuration.md's reference table is exactly what ``dtrain config --reference`` prints, and the page
  names every file in configs/;
- every relative Markdown link in README.md, CONTRIBUTING.md and docs/*.md resolves to a file of the
  repository, and its ``#anchor``, if any, to a heading of the Markdown file it names;
- every page under docs/ is reachable from the README and the docs index;
- the repository is self-contained: no tracked text file points at a design note kept outside it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dtrain.config.load import reference_markdown

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS.glob("*.md")])
# Spelled in two halves so that this file does not name them itself.
OUTSIDE_REFERENCES = ("shared" + "/", "DESIGN" + ".md")
# [text](target) or [text](target "title"); images (![alt](src)) included.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(markdown: str) -> str:
    """The Markdown without fenced code blocks (where ``[x](y)`` and ``#`` mean nothing); inline code stays, as
    headings keep their code text (:func:`links` drops it)."""
    return FENCE.sub("", markdown)


def anchors(markdown: str) -> set[str]:
    """The ``#anchor`` of every heading, as GitHub makes them: lower case, punctuation dropped (code spans keep
    their text), spaces as hyphens, a repeated anchor suffixed ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for title in HEADING.findall(prose(markdown)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    """The targets of every Markdown link on ``page`` outside code."""
    return LINK.findall(INLINE_CODE.sub("", prose(page.read_text())))


def broken_link(page: Path, target: str) -> str | None:
    """Why ``target`` (a link on ``page``) does not resolve, or None if it does (or is not relative)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{path}: no such file"
    if ROOT not in dest.parents and dest != ROOT:
        return f"{path}: outside the repository"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
        return f"#{anchor}: no such heading in {dest.relative_to(ROOT)}"
    return None


def tracked_text_files() -> dict[Path, str]:
    """The repository's text files as git sees them, tracked or new but not ignored (outside a git checkout:
    every file but build outputs), with their text."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout
        files = [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "runs", "build", "dist", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
        files = [p for p in ROOT.rglob("*") if p.is_file() and not (skip & set(p.relative_to(ROOT).parts))
                 and not any(part.startswith(".venv") for part in p.relative_to(ROOT).parts)]
    texts = {}
    for path in files:
        try:
            texts[path] = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
    return texts


def test_config_reference_matches_the_dataclasses():
    page = (DOCS / "configuration.md").read_text()
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    table = page[page.index(start) + len(start):page.index(end)].strip()
    assert table == reference_markdown(), "regenerate with: dtrain config --config tiny --reference"


def test_configuration_names_every_config_file():
    page = (DOCS / "configuration.md").read_text()
    for path in sorted((ROOT / "configs").glob("*.toml")):
        assert f"`{path.stem}`" in page, f"configs/{path.name} is not mentioned in docs/configuration.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    found = links(page)
    broken = [f"{target}: {why}" for target in found if (why := broken_link(page, target))]
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme_and_the_index():
    for index in (ROOT / "README.md", DOCS / "README.md"):
        targets = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
        missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in targets and p.resolve() != index]
        assert not missing, f"{index.relative_to(ROOT)} does not link to {missing}"


def test_the_link_checker_finds_a_broken_link_and_a_broken_anchor(tmp_path):
    """The checker itself: a missing file, a missing heading, a code span and a fence are told apart."""
    page = DOCS / "architecture.md"
    assert broken_link(page, "no-such-page.md") is not None
    assert broken_link(page, "cli.md#no-such-heading") is not None
    assert broken_link(page, "cli.md#live-dashboard") is None
    assert broken_link(page, "benchmarks.md#convergence-benchmarksconvergencepy") is None
    assert broken_link(page, "https://example.com/x") is None
    md = tmp_path / "x.md"
    md.write_text("# A `b` c\n\n## A `b` c\n\n```\n# not a heading [x](nowhere.md)\n```\n`[y](nowhere.md)`\n")
    assert anchors(md.read_text()) == {"a-b-c", "a-b-c-1"}
    assert links(md) == []


def test_nothing_points_outside_the_repository():
    """The design as built is described in docs/architecture.md; no file refers to a note kept elsewhere."""
    hits = [f"{path.relative_to(ROOT)}: {needle}" for path, text in tracked_text_files().items()
            for needle in OUTSIDE_REFERENCES if needle in text]
    assert not hits, "\n".join(hits)
