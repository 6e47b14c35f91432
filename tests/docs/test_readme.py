"""The README is for users: short, and free of the references that only history explains.

Commit hashes belong to ``docs/validation.md`` (the commit a result ran at) and ``CHANGELOG.md``;
run ordinals and dates are caught for every file by ``test_no_diary_words.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
MAX_LINES = 250
# A short commit hash: 7-40 hex digits with at least one digit and one letter (not a plain number).
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def test_readme_is_at_most_250_lines():
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_readme_cites_no_commit_hashes():
    assert COMMIT.findall("at 3dd66c9 and 9c8f2b1") == ["3dd66c9", "9c8f2b1"]
    assert not COMMIT.findall("1234567 decade 0.32.0 sm_86")
    assert not COMMIT.findall(README.read_text())
