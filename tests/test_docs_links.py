"""The README and docs/*.md link to each other (session 50 moved most of the README into docs/): every relative link
must name a file that exists, and every `#anchor` a heading of that file (anchors as GitHub makes them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target): images too


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of `page`'s headings (lines opening with '#' outside code blocks)."""
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#+ ", line):
            found.add(github_anchor(line.lstrip("#")))
    return found


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_anchors_are_githubs():
    assert github_anchor(" EAGLE-3.1's norms vs EAGLE-3: stories260K (2 CPU threads; session 42)") == (
        "eagle-31s-norms-vs-eagle-3-stories260k-2-cpu-threads-session-42")
    assert github_anchor("Tools in a `ChatSession`") == "tools-in-a-chatsession"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_relative_links_resolve(page):
    assert relative_links(ROOT / "README.md"), "the link pattern finds nothing: the test would pass vacuously"
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)
