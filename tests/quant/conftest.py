"""Quantized checkpoints of the test presets (and their dequantized-bf16 twins), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.quantize import convert_checkpoint
from tests.conftest import ensure_checkpoint

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
