"""Tracked files state facts, not the story of how they were found.

Run ordinals ("the seventh H200 run"), words about borrowed machines and their sessions, issue
numbers and calendar dates age the moment they are written and send a reader after history instead
of the code. Dated history belongs to ``CHANGELOG.md``, the one file this test skips. The patterns
are narrow on purpose: "silent", "talent" or "a first run compiles kernels" must not match.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
SKIPPED = {"CHANGELOG.md", THIS}
BINARY_SUFFIXES = {".safetensors", ".png", ".jpg", ".gz", ".tar", ".bin", ".pt", ".whl", ".ico"}

_ORDINALS = (
    "second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|[0-9]*(?:[02-9]nd|[2-9]rd|[4-9]th|1[0-9]th)"
)
_HARDWARE = r"(?:H200|GPU|CUDA|CPU|CI|device|sm_?86|3090)"
PATTERNS: dict[str, re.Pattern[str]] = {
    "run ordinal": re.compile(rf"\b(?:{_ORDINALS})[ -]+(?:{_HARDWARE}[ -]+)?(?:run|session)s?\b", re.I),
    "first hardware run": re.compile(rf"\bfirst[ -]+{_HARDWARE}[ -]+(?:run|session)s?\b", re.I),
    "lent machine": re.compile(r"\blent\b", re.I),
    "GPU session": re.compile(r"\bnext[ -]+(?:GPU|device|H200)[ -]+session\b", re.I),
    "issue number": re.compile(r"\bissues?[ -]+#?[0-9]+\b", re.I),
    "device time": re.compile(r"\bdevice[ -]+time\b", re.I),
    "work session": re.compile(r"\bwork[ -]+sessions?\b", re.I),
    "date": re.compile(r"\b20[0-9]{2}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])\b"),
}


def tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    names = [n for n in out.decode().split("\0") if n]
    return [n for n in names if n not in SKIPPED and Path(n).suffix not in BINARY_SUFFIXES]


def diary_hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, matched text) for every diary phrase in ``text``."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in PATTERNS.items():
            hits += [(number, name, m.group(0)) for m in pattern.finditer(line)]
    return hits


def test_patterns_match_diary_phrases_and_spare_ordinary_words():
    diary = [
        "the seventh H200 run",
        "Twelfth run",
        "the 11th GPU run",
        "the first H200 run",
        "on the lent GPU",
        "Next GPU session",
        "see issue 13",
        "30 min of device time",
        "a work session",
        "measured 2026-12-01",
    ]
    ordinary = [
        "a silent failure",
        "talent",
        "a first run compiles ~100 kernels",
        "the second request hits the cache",
        "@pytest.fixture(scope='session')",
        "the issue's target",
        "device memory",
        "run the third test",
    ]
    assert all(diary_hits(text) for text in diary), [t for t in diary if not diary_hits(t)]
    assert not any(diary_hits(text) for text in ordinary), [diary_hits(t) for t in ordinary]


def test_tracked_files_carry_no_diary_words():
    problems = []
    for name in tracked_text_files():
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        problems += [f"{name}:{line}: {kind}: {found!r}" for line, kind, found in diary_hits(text)]
    assert not problems, "diary words (move history to CHANGELOG.md):\n" + "\n".join(problems)
