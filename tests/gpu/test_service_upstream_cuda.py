"""The product's default on CUDA as a user runs it: ``python -m service`` serving ``qsa512`` with
``QWEN4EXP_CUDA_MODEL`` and ``VLLM_USE_V2_MODEL_RUNNER`` unset, i.e. vLLM's own Qwen4-Exp through
our subclass on the V2 runner the service picks, answering the official openai client.

Three starts (``qsa512``: the smallest preset upstream's top-k kernels take):

1. defaults (CUDA graphs, PLE tables pinned in host memory): a streamed chat with usage, greedy
   token ids of the parity prompts (and one past the QSA budget) equal to transformers', and on
   ``/metrics`` ``model_impl="upstream"`` and our PLE gauges reporting pinned tables;
2. ``VLLM_PLE_CPU_OFFLOAD=0`` (the service passes it to upstream as ``--engram-config``), eager,
   collecting FP8 calibration absmax: the same tokens as (1), tables in GPU memory;
3. the FP8 QSA KV cache with the sidecar merged from (2)'s dumps and the clip counter on, with
   graphs: the scale gauges equal the sidecar, clip counters are exported, and the first token of
   every prompt (at most one exception) equals the BF16 cache's.
"""

from __future__ import annotations

import pytest

from tests.parity.test_generation_parity import MAX_NEW_TOKENS, assert_same

from .test_engine_parity import REF_DEVICE, reference_greedy
from .test_service_cuda import DEVICE, serve_three_ways
from .test_upstream_cuda import qsa512_prompts

pytestmark = pytest.mark.vllm_cuda

# The service chooses both itself; gpu_tests.sh and tests/gpu/conftest.py pin them for ours.
DEFAULTS = ("QWEN4EXP_CUDA_MODEL", "VLLM_USE_V2_MODEL_RUNNER")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("service_upstream")
    path, prompts = qsa512_prompts()

    def answer(svc):
        return {n: svc.greedy_ids(ids, MAX_NEW_TOKENS) for n, ids in prompts.items()}

    out = serve_three_ways(tmp, "qsa512", answer, DEFAULTS, QWEN4EXP_MAX_MODEL_LEN="4096")
    out["prompts"] = prompts
    out["reference"] = reference_greedy(path, prompts, REF_DEVICE)
    return out


def test_default_is_upstream_on_v2_and_streams_with_usage(runs):
    info = runs["service_info"]
    assert info and info[0].labels["model_impl"] == "upstream" and info[0].labels["device"] == DEVICE, info
    chunks = runs["stream"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text and len(usage) == 1 and usage[0].completion_tokens == 16, (text, usage)
    assert runs["default_rc"] == 0, runs["default_rc"]


def test_default_service_matches_transformers(runs):
    same = sum(runs["default"][n] == runs["reference"][n][0] for n in runs["prompts"])
    print(
        f"service (upstream, graphs): {same}/{len(runs['prompts'])} prompts token-identical to transformers"
    )
    assert_same(runs["default"], runs["reference"])


def test_ple_storage_follows_the_variable(runs):
    def by_mode(samples):
        return {s.labels["mode"] for s in samples if s.name == "qwen4exp_ple_storage_info"}

    pinned = [s for s in runs["default_ple"] if s.name == "qwen4exp_ple_pinned_bytes"]
    assert by_mode(runs["default_ple"]) == {"pinned"} and pinned and all(s.value > 0 for s in pinned)
    assert by_mode(runs["device_ple"]) == {"device"}
    assert all(s.value == 0 for s in runs["device_ple"] if s.name == "qwen4exp_ple_pinned_bytes")
    assert runs["device"] == runs["default"], "GPU-memory tables changed the tokens"
    assert runs["device_rc"] == 0


def test_fp8_cache_serves_with_sidecar_scales_and_clip_counters(runs):
    sidecar = runs["sidecar"]
    assert sidecar, "calibration produced no scales"
    metrics = runs["fp8_metrics"]
    scales = {
        (s.labels["layer"], s.labels["tensor"]): s.value for s in metrics if s.name == "qwen4exp_qsa_kv_scale"
    }
    for layer, entry in sidecar.items():
        assert scales.get((layer, "k")) == pytest.approx(entry["k_scale"]), (layer, scales)
        assert scales.get((layer, "v")) == pytest.approx(entry["v_scale"]), (layer, scales)
    clipped = {
        (s.labels["layer"], s.labels["tensor"]) for s in metrics if s.name == "qwen4exp_qsa_kv_clipped_total"
    }
    assert clipped >= {(layer, t) for layer in sidecar for t in ("k", "v")}, metrics
    first = sum(runs["fp8"][n][:1] == runs["default"][n][:1] for n in runs["prompts"])
    same = sum(runs["fp8"][n] == runs["default"][n] for n in runs["prompts"])
    print(f"service FP8 KV: {same}/{len(runs['prompts'])} equal to BF16's; first token {first}")
    assert first >= len(runs["prompts"]) - 1
    assert runs["fp8_rc"] == 0
