"""Every reference from README.md and docs/*.md to another page resolves.

Three forms are checked:

- markdown links with a relative target, ``[text](docs/results.md#some-heading)`` or
  ``[text](dashboard_overview.png)``: the file exists (relative to the page) and the ``#anchor``,
  if any, is the GitHub slug of one of the target page's headings;
- a page named in the text, ``docs/results.md``: the file exists;
- a section cited by name, ``docs/results.md, "The tuner's noise gate"`` (or ``gateway.md,
  "Figures"`` from a page in docs/): the named page has a heading, or a paragraph whose bold
  lead, starts with that text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_NAMED_PAGE = re.compile(r"(?<![\w/.-])docs/([\w-]+\.md)\b")
_CITED_SECTION = re.compile(r"(?<![\w/.-])(?:docs/)?([\w-]+\.md)[,:]? \"([^\"]+)\"")
_FENCE = re.compile(r"^(```|~~~)")


def prose(path: Path) -> str:
    """The page without its fenced code blocks (commands and output are not references)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def headings(path: Path) -> list[str]:
    return [m.group(2).strip() for m in re.finditer(r"^(#{1,6})\s+(.+?)\s*#*\s*$", prose(path), re.M)]


def sections(path: Path) -> list[str]:
    """Headings, and the bold lead of a paragraph (``**Several gateways** share ...``), which the
    pages use as run-in headings."""
    return headings(path) + re.findall(r"^\*\*([^*]+)\*\*", prose(path), re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (hyphens and
    underscores kept), each space a hyphen."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug, with GitHub's ``-1``, ``-2`` suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for h in headings(path):
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def broken_references(page: Path, root: Path = REPO) -> list[str]:
    """What in ``page`` does not resolve, one line each (``root``: the repository)."""
    text = prose(page)
    rel = page.relative_to(root)
    problems = []
    for m in _LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            where = dest.relative_to(root) if dest.is_relative_to(root) else dest
            problems.append(f"{rel}: link to {target}: no file {where}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{rel}: link to {target}: {dest.name} has no heading #{anchor}")
    for m in _NAMED_PAGE.finditer(text):
        if not (root / "docs" / m.group(1)).exists():
            problems.append(f"{rel}: names docs/{m.group(1)}, which does not exist")
    for m in _CITED_SECTION.finditer(text):
        name, section = m.group(1), " ".join(m.group(2).split())  # a citation may wrap a line
        dest = root / "docs" / name
        if not dest.exists():
            problems.append(f"{rel}: cites {name}, \"{section}\": no such page in docs/")
        elif not any(h.startswith(section) for h in sections(dest)):
            problems.append(f"{rel}: cites {name}, \"{section}\": no heading of {name} starts so")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_cited_section_resolves(page):
    assert broken_references(page) == []


def test_the_checker_finds_a_missing_file_a_missing_anchor_and_a_missing_section(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A page\n\n## The `racer` section (one)\n\n## Twice\n\n## Twice\n")
    page = docs / "b.md"
    page.write_text("[ok](a.md#the-racer-section-one) [ok2](a.md#twice-1) [gone](a.md#nope) [nofile](c.md)\n"
                    "![pic](pic.png) [web](https://example.org/x.md#y)\n"
                    "See docs/a.md, \"The `racer` section\" and a.md, \"Gone section\"; docs/z.md too.\n"
                    "```\n[in code](nowhere.md)\n```\n")
    got = broken_references(page, root=tmp_path)
    assert got == ["docs/b.md: link to a.md#nope: a.md has no heading #nope",
                   "docs/b.md: link to c.md: no file docs/c.md",
                   "docs/b.md: link to pic.png: no file docs/pic.png",
                   "docs/b.md: names docs/z.md, which does not exist",
                   "docs/b.md: cites a.md, \"Gone section\": no heading of a.md starts so"]
