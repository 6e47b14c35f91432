"""Quantized checkpoints of the test presets (and their dequantized-bf16 twins), built once per session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from model.tools.quantize import convert_checkpoint
from tests.conftest import ROOT, ensure_checkpoint

# name -> (preset, format, scope). Scales are powers of two, so every dequantized value is exact
# in bf16 and the twin holds exactly what the quantized kernels compute with.
CASES = {
    "tiny-w4a16": ("tiny", "w4a16", "experts"),
    "tiny-fp8": ("tiny", "fp8-block", "experts"),
    "tiny-w4a16-dense": ("tiny", "w4a16", "dense"),
    "tiny-gptq-dense": ("tiny", "gptq", "dense"),
    "tiny-awq-dense": ("tiny", "awq", "dense"),
    "wide-w4a16": ("wide", "w4a16", "all"),
    "wide-fp8": ("wide", "fp8-block", "experts"),
}

# The cases in compressed-tensors formats (the GPTQ/AWQ layouts have their own decoder test,
# tests/quant/test_gptq_awq_layout.py).
COMPRESSED_TENSORS_CASES = sorted(n for n, (_, fmt, _) in CASES.items() if fmt in ("w4a16", "fp8-block"))

# int4 dense linears in the three layouts a user brings: compressed-tensors, AutoGPTQ, AutoAWQ.
DENSE_INT4_CASES = ("tiny-w4a16-dense", "tiny-gptq-dense", "tiny-awq-dense")


def cpu_library_has(op: str) -> bool:
    """Whether the vLLM CPU library this host loads registers ``op`` (in a child, so that this
    process does not import vLLM's kernels)."""
    code = (
        "import torch, vllm.platforms as p; p.current_platform.import_kernels(); "
        f"print(hasattr(torch.ops._C, {op!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip().endswith("True")


@pytest.fixture(scope="session")
def quant_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """``<case>`` (quantized) and ``<case>-deq`` (its bf16 twin) for every case, plus the sources."""
    root = tmp_path_factory.mktemp("quant_checkpoints")
    out: dict[str, Path] = {}
    for name, (preset, fmt, scope) in CASES.items():
        src = ensure_checkpoint(preset)
        out[preset] = src
        for deq in (False, True):
            key = f"{name}-deq" if deq else name
            out[key] = convert_checkpoint(src, root / key, fmt, scope=scope, scales="pow2", dequantized=deq)
    return out
