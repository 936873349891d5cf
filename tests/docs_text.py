"""Reading the README and docs/ as the docs tests need them: pages, fenced blocks, prose lines, commands.

Shared by tests/test_docs_references.py (paths, commands, line lengths, links), tests/test_docs_examples.py
(the examples' flags through the doctor's prediction, the README's Python run as written) and
tests/test_docs_render.py (the doctor figures against their saved runs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
#: A block preceded by this comment is a record (what ran), not an example to copy; the reason is required.
NOT_AN_EXAMPLE = re.compile(r"<!-- not-an-example: (?P<why>[^>]{10,}) -->\s*$")
#: A block the render script fills from a saved log (``<!-- log:FILE:SELECT -->``) is a record too.
LOG_QUOTE = re.compile(r"<!-- log:[^ ]+ -->\s*$")


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def rel(path: Path, root: Path = ROOT) -> str:
    return str(path.relative_to(root))


@dataclass
class Block:
    """A fenced code block: its page, language, first line number (1-based, the fence's), text."""

    page: Path
    lang: str
    line: int
    text: str
    exempt: str | None = None  # the not-an-example reason, when the block is a record

    @property
    def where(self) -> str:
        return f"{rel(self.page)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a markdown page."""
    out: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        why = NOT_AN_EXAMPLE.search(prev)
        if why is None and LOG_QUOTE.search(prev):  # a saved log quoted by the render script: what ran
            why = {"why": "a quoted log of a run (scripts/render_docs.py)"}
        out.append(Block(page, lang, start + 1, "\n".join(body), why["why"] if why else None))
        i += 1
    return out


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced blocks, marker comments removed (what a reader reads)."""
    text = page.read_text()
    out, inside, fence = [], False, ""
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and not inside:
            inside, fence = True, m.group(2)
            continue
        if inside:
            if line.strip().startswith(fence):
                inside = False
            continue
        out.append((n, line))
    return out


def inline_code(line: str) -> list[str]:
    """The `inline code` spans of one prose line (marker comments removed first)."""
    return re.findall(r"`([^`]+)`", COMMENT.sub("", line))


def commands(text: str) -> list[str]:
    """Shell commands of a code block: continuation lines joined, comments dropped, one per line."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            out.append(line)
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page (duplicates numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page):
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        k = seen.get(slug, 0)
        out.add(slug if k == 0 else f"{slug}-{k}")
        seen[slug] = k + 1
    return out
