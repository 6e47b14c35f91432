"""Shared fixtures: generated checkpoints (built once per machine and reused) and vLLM settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = Path(os.environ.get("QWEN4EXP_TEST_CHECKPOINTS", ROOT / "checkpoints"))

# Small KV-cache and a private compile cache for every vLLM engine the tests start.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))


def ensure_checkpoint(preset: str) -> Path:
    """Generate ``checkpoints/<preset>`` if missing (deterministic, a minute or two)."""
    path = CHECKPOINTS / preset
    if not (path / "model.safetensors").exists():
        subprocess.run(
            [sys.executable, "-m", "model.checkpoints", "--preset", preset, "--out", str(path)],
            check=True,
            cwd=ROOT,
        )
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    return ensure_checkpoint("tiny")


@pytest.fixture(scope="session")
def wide_checkpoint() -> Path:
    return ensure_checkpoint("wide")
