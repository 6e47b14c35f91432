"""Our indexer prefill launcher (``model.upstream.indexer_tiles``) with a 3090's tile
gives upstream's scores: both launchers run upstream's kernel under Triton's interpreter and are
compared with a torch reference of the score (sum over index heads of relu(k . q))."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT, pythonpath_with


def test_a_smaller_tile_computes_upstreams_scores():
    done = subprocess.run(
        [sys.executable, "-m", "tests.upstream.indexer_tile_child"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath_with(ROOT)},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    print(found)
    assert found["tile"] == 16
    assert found["upstream_vs_ref"] < 1e-3 and found["ours_vs_ref"] < 1e-3
    assert found["ours_vs_upstream"] < 1e-4
