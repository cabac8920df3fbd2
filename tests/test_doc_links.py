"""Every relative link in the project's Markdown files leads somewhere: the file exists, and a `#fragment`
names a heading of the linked page (GitHub's anchor for it). The README's sections moved to pages under
docs/; a link left pointing at a section that moved, or at a page renamed later, fails here."""

import re
from pathlib import Path

from helpers import REPO, tracked

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(text) for text in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8")))}


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` (outside code blocks) whose file or heading does not exist."""
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
    return broken


def test_every_relative_link_in_the_docs_resolves():
    pages = [p for p in tracked("*.md") if "bench/results" not in p.as_posix()]
    assert any(p.relative_to(REPO).as_posix() == "docs/cli.md" for p in pages)
    wrong = {str(p.relative_to(REPO)): links for p in pages if (links := broken_links(p))}
    assert not wrong, wrong


def test_a_moved_section_or_missing_page_is_caught(tmp_path):
    page = "# A page\n\n## Editing images (Edit, Edit-2511)\n\n```\n# not a heading\n```\n"
    (tmp_path / "page.md").write_text(page)
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](page.md#editing-images-edit-edit-2511) [gone](page.md#step-cache) [code](page.md#not-a-heading)"
        " [missing](other.md) [web](https://example.com/x)"
    )
    assert broken_links(doc) == [
        "page.md#step-cache: no heading with that anchor",
        "page.md#not-a-heading: no heading with that anchor",
        "other.md: no such file",
    ]
