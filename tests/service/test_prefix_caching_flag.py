"""QWEN4EXP_PREFIX_CACHING: unset means on, with vLLM's CPU build and on CUDA (token parity of cache
hits is tested on both: tests/prefix_cache, tests/gpu); true/false force it. vLLM's own configuration
then runs our hybrid cache in its align Mamba mode, which needs chunked prefill."""

from __future__ import annotations

import pytest

from service import engine
from service.settings import ServiceSettings
from tests.conftest import ROOT

TINY = ROOT / "checkpoints" / "tiny"


def settings(monkeypatch, value: str | None) -> ServiceSettings:
    monkeypatch.setenv("QWEN4EXP_MODEL", str(TINY))
    if value is None:
        monkeypatch.delenv("QWEN4EXP_PREFIX_CACHING", raising=False)
    else:
        monkeypatch.setenv("QWEN4EXP_PREFIX_CACHING", value)
    return ServiceSettings()  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("value", "device", "on"),
    [(None, "cpu", True), (None, "cuda", True), ("false", "cpu", False), ("false", "cuda", False)],
)
def test_flag(monkeypatch, value, device, on) -> None:
    argv = engine.cli_args(settings(monkeypatch, value), device)
    assert ("--enable-prefix-caching" in argv) is on
    assert ("--no-enable-prefix-caching" in argv) is not on


def test_default_engine_config_is_align_mode(monkeypatch) -> None:
    if not (TINY / "config.json").exists():
        pytest.skip("checkpoints/tiny missing")
    config = engine.engine_config(engine.parse_args(engine.cli_args(settings(monkeypatch, None), "cpu")))
    cache = config.cache_config
    assert cache.enable_prefix_caching and cache.mamba_cache_mode == "align"
    assert config.scheduler_config.enable_chunked_prefill


@pytest.mark.parametrize(
    ("choice", "offload", "cpu_build", "device", "flag"),
    [
        # auto = upstream on CUDA, tables in GPU memory
        ("auto", "0", False, "cuda", ["--engram-config", '{"cpu_offload": false}']),
        ("upstream", "0", False, "cuda", ["--engram-config", '{"cpu_offload": false}']),
        ("auto", None, False, "cuda", []),  # pinned: vLLM's default already
        ("ours", "0", False, "cuda", []),  # ours reads VLLM_PLE_CPU_OFFLOAD itself
        ("auto", "0", True, "cpu", []),
    ],
)
def test_ple_storage_reaches_upstreams_engram_config(monkeypatch, choice, offload, cpu_build, device, flag):
    from model.runtime import cuda_model_choice

    monkeypatch.setattr(cuda_model_choice, "vllm_is_cpu_build", lambda: cpu_build)
    monkeypatch.setenv("QWEN4EXP_CUDA_MODEL", choice)
    if offload is None:
        monkeypatch.delenv("VLLM_PLE_CPU_OFFLOAD", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLE_CPU_OFFLOAD", offload)
    argv = engine.cli_args(settings(monkeypatch, None), device)
    if flag:
        at = argv.index("--engram-config")
        assert argv[at : at + 2] == flag
    else:
        assert "--engram-config" not in argv
    if flag:  # vLLM's own parser takes it
        assert engine.parse_args(argv).engram_config.cpu_offload is False
