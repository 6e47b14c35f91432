"""Shared fixtures: generated checkpoints (built once per machine and reused) and vLLM settings."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = Path(os.environ.get("QWEN4EXP_TEST_CHECKPOINTS", ROOT / "checkpoints"))

# Small KV-cache and a private compile cache for every vLLM engine the tests start.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))


# Checkpoints pinned as test data. ``wide`` is not bit-reproducible across generations (tiny is), and
# greedy parity needs a fixed set of weights: a regenerated ``wide`` once diverged from the reference
# on one prompt at a 0.7-nat margin, which we suspect is an internal top-k near-tie (MoE routing or
# QSA block choice) rather than a bug, but have not proven.
PINNED = ROOT / "tests" / "data" / "checkpoints"


def pythonpath_with(root: Path) -> str:
    """``PYTHONPATH`` for a child process: ``root`` first, then whatever the parent had.

    Replacing the variable would hide a vLLM that comes through it (the carried stack that
    ``scripts/gpu-test.sh`` can run the suite with) instead of from the venv.
    """
    return os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))


def ensure_checkpoint(preset: str, train_steps: int | None = None) -> Path:
    """The pinned copy of a preset if there is one, else ``checkpoints/<preset>``, generated if missing.

    ``train_steps`` asks for the preset trained that many steps instead of the generator's default:
    ``checkpoints/<preset>-steps<n>``, generated once per machine like the default ones (training
    is what makes a checkpoint slow to build). Pinned copies hold the default, so they are not used.
    """
    if train_steps is None and (PINNED / preset / "model.safetensors").exists():
        return PINNED / preset
    path = CHECKPOINTS / (preset if train_steps is None else f"{preset}-steps{train_steps}")
    if not (path / "model.safetensors").exists():
        steps = [] if train_steps is None else ["--train-steps", str(train_steps)]
        subprocess.run(
            [sys.executable, "-m", "model.tools.checkpoints", "--preset", preset, "--out", str(path), *steps],
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


def write_api_keys(directory: Path, text: str, name: str = "api-keys") -> Path:
    """Write ``text`` as an API-keys file (``QWEN4EXP_API_KEYS_FILE``) and return its path.

    Raw text rather than a list of keys, so that a test can write what a broken secret mount leaves
    (empty, comments only). Fixtures wider than one test use this; tests use ``api_keys_file``.
    """
    path = directory / name
    path.write_text(text)
    return path


@pytest.fixture
def api_keys_file(tmp_path) -> Callable[[str], Path]:
    """``api_keys_file(text)``: the test's API-keys file (``tmp_path/api-keys``) with this text."""
    return functools.partial(write_api_keys, tmp_path)
