"""Fixtures for the PLE storage tests: the tiny checkpoint converted to every table format."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.tools.ple_quantize import convert_checkpoint
from tests.conftest import ensure_checkpoint

QUANTIZED = ("fp8_e4m3", "nvfp4")


@pytest.fixture(scope="session")
def ple_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """``bf16`` (the tiny checkpoint), ``fp8_e4m3``, ``nvfp4`` and their ``<fmt>-deq`` references.

    ``<fmt>-deq`` is a bf16 checkpoint whose PLE tables hold the dequantized values of ``<fmt>``.
    """
    src = ensure_checkpoint("tiny")
    root = tmp_path_factory.mktemp("ple_checkpoints")
    out = {"bf16": src}
    for fmt in QUANTIZED:
        out[fmt] = convert_checkpoint(src, root / fmt, fmt)
        out[f"{fmt}-deq"] = convert_checkpoint(src, root / f"{fmt}-deq", fmt, dequantized=True)
    return out
