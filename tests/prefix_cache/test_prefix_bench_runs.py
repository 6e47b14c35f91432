"""``bench/bench_prefix_cache.py`` runs end to end on vLLM's CPU build, with several rounds.

The bench decides the prefix-cache target on a GPU, where a broken option wastes a whole GPU run.
This runs it small (tiny checkpoint, 512-token prefix, two
rounds) and checks what its table must hold: every round's second request hit the cache, the medians
and the per-round ratios are printed, and the verdict line is there. No assertion on speed.
"""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT, ensure_checkpoint


def test_bench_runs_rounds_and_reports_hits():
    path = ensure_checkpoint("tiny")
    run = subprocess.run(
        [sys.executable, "bench/bench_prefix_cache.py", "--model", str(path), "--prefix-len", "512"]
        + ["--rounds", "2", "--no-control"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    print(out[-1500:])
    row = re.search(r"^\| on \| [\d.]+ \| [\d.]+ \| (\d+) \| [\d.]+x \|", out, re.MULTILINE)
    assert row, out
    assert int(row.group(1)) >= 256, "the second request of every round should have hit the cache"
    assert re.search(r"^per round, caching on: [\d.]+x, [\d.]+x$", out, re.MULTILINE), out
    assert re.search(
        r"^prefix caching: second request [\d.]+x faster \(\d+ cached tokens\)", out, re.MULTILINE
    )
    assert "2 round(s) per row" in out
