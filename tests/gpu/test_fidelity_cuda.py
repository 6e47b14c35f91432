"""Teacher-forced fidelity of every CUDA path against transformers in float32 (GPU judge).

Runs ``tests.gpu.fidelity_run`` (one engine per implementation and mode, the 3090's paths forced
with ``QWEN4EXP_FORCE_SM86=1``) on the hold-out shape, two drawn shapes and the real model's shape
cut to 4 layers, prompts up to 16k tokens, and requires each path's pooled mean |delta| of the actual
next token's log-prob to be within ``tests.fidelity.measure.tolerance`` of transformers' own bf16
error on the same prompts. ``FIDELITY_OUT`` keeps the JSON and markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, pythonpath_with
from tests.fidelity import measure

pytestmark = pytest.mark.vllm_cuda

EVERY_PATH = "upstream:eager,upstream:graphs,ours:eager"
CASES = {
    "holdout": ("4,600,2500,6000,16000", EVERY_PATH),
    "drawn-1": ("4,600,2500,6000,16000", EVERY_PATH),
    "drawn-8": ("4,600,2500,16000", "upstream:eager,ours:eager"),
    "real-4layer": ("4,600,2500,6000,16000", EVERY_PATH),
}


@pytest.mark.parametrize("shape", sorted(CASES))
def test_every_cuda_path_is_as_close_to_float32_as_transformers_bf16(shape, tmp_path):
    lengths, runs = CASES[shape]
    out = Path(os.environ.get("FIDELITY_OUT", tmp_path)) / shape
    subprocess.run(
        [sys.executable, "-m", "tests.gpu.fidelity_run", "--out", str(out), "--shapes", shape,
         "--lengths", lengths, "--runs", runs],
        check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": pythonpath_with(ROOT)},
    )  # fmt: skip
    print((out / "fidelity.md").read_text())
    entry = json.loads((out / "fidelity.json").read_text())["shapes"][shape]
    yardstick = measure.Fidelity(**entry["transformers-bf16"]["all"])
    for run, result in entry["runs"].items():
        assert "error" not in result, (run, result)
        got = measure.Fidelity(**result["all"])
        assert got.mean_abs <= measure.tolerance(yardstick), (run, got, yardstick)
        assert got.decisive == 0 or got.top1_agreement >= 0.99, (run, got)
