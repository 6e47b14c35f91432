"""Every relative link in the tracked Markdown files points at a file or directory that exists.

Docs are moved and split; a link left behind sends a reader nowhere. Anchors (``#section``) are not
checked, only the path before them; absolute URLs are not fetched. Links inside code spans and
fenced code blocks are not links and are skipped.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", re.I)


def markdown_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "*.md"], cwd=ROOT, check=True, capture_output=True).stdout
    return [n for n in out.decode().split("\0") if n and (ROOT / n).is_file()]


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line number, target without its anchor) of every relative link outside code."""
    links, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            target = match.group(1)
            if not EXTERNAL.match(target):
                links.append((number, target.split("#", 1)[0]))
    return links


def test_link_finder():
    text = "see [a](docs/a.md#x), [b](https://x.org), [c](#top), `[d](no.md)`\n```\n[e](no.md)\n```\n![f](img.png)"
    assert relative_links(text) == [(1, "docs/a.md"), (5, "img.png")]


def test_every_relative_markdown_link_resolves():
    broken = []
    for name in markdown_files():
        path = ROOT / name
        for line, target in relative_links(path.read_text(encoding="utf-8")):
            if not (path.parent / target).exists():
                broken.append(f"{name}:{line}: {target}")
    assert not broken, "relative links to nothing:\n" + "\n".join(broken)
