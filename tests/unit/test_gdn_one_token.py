"""Our Gated DeltaNet layer on one-token prefills, through whichever CPU conv path this host takes.

vLLM's CPU build picks its C++ causal-conv kernel on CPUs with AVX512-BF16 and a torch conv
elsewhere; a one-token prefill used to crash the C++ kernel (see ``model/ours/gdn.py``).
These tests run the real layer (``_gdn_harness``) and check, on every host:
- the conv path that actually ran is the one this host's CPU flags select (named in the failure);
- the tensor handed to the conv has the row stride the C++ kernel requires, for 1 and 5 tokens,
  so the torch-path hosts guard the C++-path contract too;
- the outputs equal transformers' reference module, and a 1-token prefill equals the first row
  of a 5-token prefill (causality).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, pythonpath_with
from tests.net import free_port

HOST_PATH = "cpp" if torch.cpu._is_avx512_bf16_supported() else "torch"
HOST_FLAGS = "avx512_bf16" if HOST_PATH == "cpp" else "no avx512_bf16"


@pytest.fixture(scope="module")
def runs(tiny_checkpoint) -> dict:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit._gdn_harness", str(tiny_checkpoint), f"tcp://127.0.0.1:{port}"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath_with(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["avx512_bf16"] == (HOST_PATH == "cpp")
    return result["runs"]


@pytest.mark.parametrize("tokens", ["1", "5"])
def test_prefill_runs_and_takes_this_hosts_conv_path(runs, tokens):
    run = runs[tokens]
    assert run["ok"], (
        f"{tokens}-token prefill failed on the {HOST_PATH!r} conv path ({HOST_FLAGS}): {run['error']}"
    )
    assert run["paths"] == [HOST_PATH], (
        f"this host ({HOST_FLAGS}) should run vLLM's {HOST_PATH!r} conv path once; ran {run['paths']}"
    )


@pytest.mark.parametrize("tokens", ["1", "5"])
def test_conv_input_meets_the_cpp_kernels_stride_contract(runs, tokens):
    (handed,) = runs[tokens]["handed"]
    rows, width = handed["shape"]
    assert rows == int(tokens)
    # causal_conv1d_fwd_cpu takes x = mixed_qkv.T and requires x.stride(-1) == x.size(-2).
    assert handed["stride"] == [width, 1], f"row stride {handed['stride'][0]} != width {width}"


def test_outputs_equal_the_reference_and_are_causal(runs):
    for tokens in ("1", "5"):
        run = runs[tokens]
        assert run["max_abs_diff"] <= 0.02 * run["ref_scale"] + 1e-3, (
            tokens,
            run["max_abs_diff"],
            run["ref_scale"],
        )
    one, five = torch.tensor(runs["1"]["out"]), torch.tensor(runs["5"]["out"])
    torch.testing.assert_close(one[0], five[0], rtol=0.02, atol=2e-3)
