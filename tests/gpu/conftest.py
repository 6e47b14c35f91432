"""GPU judges: skipped, with the reason, where no CUDA device (or no CUDA build of vLLM) exists.

On a GPU machine: ``python -m pytest tests/gpu -v`` (see the README's GPU section for how the CUDA
stack gets onto a GPU host: docs/testing.md). The engine tests pin vLLM's V1 runner, Triton GDN prefill (the path
an RTX 3090 takes) and the plain sampler, as the README explains.
"""

from __future__ import annotations

import functools
import os

import pytest

# Set before any engine starts (children inherit them).
# These judges test our implementation unless a test picks upstream itself (test_upstream_cuda.py).
os.environ.setdefault("QWEN4EXP_CUDA_MODEL", "ours")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


@functools.cache
def cuda_skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: tests/gpu are the GPU judges (run them on a GPU machine, README 'GPU')"
    return None


@functools.cache
def vllm_cuda_skip_reason() -> str | None:
    reason = cuda_skip_reason()
    if reason:
        return reason
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"vLLM is not importable here ({type(exc).__name__}: {exc})"
    if not current_platform.is_cuda():
        return f"the installed vLLM build targets {current_platform.device_type!r}, not CUDA"
    return None


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("QWEN4EXP_GPU_DRY_RUN") == "1":
        return  # run the test code on vLLM's CPU build (device-specific assertions then fail)
    here = os.path.dirname(__file__)
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        reason = vllm_cuda_skip_reason() if item.get_closest_marker("vllm_cuda") else cuda_skip_reason()
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "vllm_cuda: needs vLLM's CUDA build as well as a CUDA device")
