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
