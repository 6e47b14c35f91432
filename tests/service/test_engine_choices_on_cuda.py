"""What the service decides for a CUDA engine before vLLM starts (facts injected; runs on CPU):
the GDN prefill kernel and the implementation ``QWEN4EXP_CUDA_MODEL=auto`` serves."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

from service import engine

TRITON_GDN = ["--additional-config", json.dumps({"gdn_prefill_backend": "triton"})]


def test_gdn_prefill_is_triton_where_the_cute_dsl_is_missing_or_a_3090_is_emulated(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.delenv("QWEN4EXP_FORCE_SM86", raising=False)
    assert engine.gdn_prefill_args("cpu") == []
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real_find_spec(name, *a)
    )
    assert engine.gdn_prefill_args("cuda") == TRITON_GDN  # vLLM's Hopper pick would import cutlass
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "cutlass" else real_find_spec(name, *a),
    )
    assert engine.gdn_prefill_args("cuda") == []  # vLLM decides
    monkeypatch.setenv("QWEN4EXP_FORCE_SM86", "1")
    assert engine.gdn_prefill_args("cuda") == TRITON_GDN


@pytest.mark.parametrize(
    ("budget", "impl"),
    [(2048, "upstream"), (1024, "ours")],  # 512 blocks at ratio 4 serve on upstream; 256 do not
)
def test_auto_is_decided_from_config_json_and_exported(tmp_path, monkeypatch, budget, impl):
    from transformers import Qwen4ExpTextConfig
    from vllm.platforms import current_platform

    from model.tools.checkpoints import preset_spec

    spec = {**preset_spec("real-4layer"), "indexer_budget": budget}
    Qwen4ExpTextConfig(**spec, eos_token_id=2, pad_token_id=0).save_pretrained(tmp_path)
    monkeypatch.setenv("QWEN4EXP_CUDA_MODEL", "auto")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # tests/gpu/conftest sets it to 0
    monkeypatch.delenv("QWEN4EXP_FORCE_SM86", raising=False)
    monkeypatch.setattr(
        current_platform, "get_device_capability", lambda *a, **k: SimpleNamespace(major=8, minor=6)
    )
    settings = SimpleNamespace(model=tmp_path, kv_cache_dtype="auto")
    reasons = engine.resolve_auto_implementation(settings, "cuda")
    assert __import__("os").environ["QWEN4EXP_CUDA_MODEL"] == impl
    assert (reasons == []) is (impl == "upstream")
    if reasons:
        assert any("k = 256 blocks" in r for r in reasons), reasons
    # ours or upstream named explicitly, or the CPU build: nothing to decide
    assert engine.resolve_auto_implementation(settings, "cpu") == []
