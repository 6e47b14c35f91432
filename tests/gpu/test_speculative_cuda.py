"""Speculative decoding on the served path (GPU judge): ``python -m service`` as shipped, upstream
through our subclass with the 3090's choices forced, CUDA graphs, prefix caching on.

Four starts side by side on the trained ``qsa512`` checkpoint: n-gram drafts (``QWEN4EXP_SPECULATIVE=ngram``,
3 drafts, window 2-4) against no speculation, with the BF16 and the FP8 QSA cache. Greedy token ids
of copy-heavy prompts (where prompt lookup drafts well), one past the QSA budget, each asked twice
(the second a prefix-cache hit), must equal the same cache's run without speculation token for
token, and vLLM's acceptance counters must reach ``/metrics`` through the service's merged registry
(the Serving dashboard's panels read them). MTP drafts the same way on ``qsa512`` with one trained
MTP layer (``model.tools.mtp_checkpoints``), BF16 cache, against the same checkpoint without
speculation. What this does not yet cover: a preemption under speculation and the distribution of
sampled outputs.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CHECKPOINTS, ROOT

from .test_service_cuda import Service
from .test_upstream_cuda import qsa512_prompts

pytestmark = pytest.mark.vllm_cuda

NEW_TOKENS = 48
STARTS = {
    "bf16-off": {"QWEN4EXP_SPECULATIVE": "off"},
    "bf16-ngram": {"QWEN4EXP_SPECULATIVE": "ngram"},
    "fp8-off": {"QWEN4EXP_SPECULATIVE": "off", "QWEN4EXP_KV_CACHE_DTYPE": "fp8"},
    "fp8-ngram": {"QWEN4EXP_SPECULATIVE": "ngram", "QWEN4EXP_KV_CACHE_DTYPE": "fp8"},
    "mtp-off": {"QWEN4EXP_SPECULATIVE": "off"},
    "mtp-on": {"QWEN4EXP_SPECULATIVE": "mtp"},
}
SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")


def copy_heavy(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """The parity prompts repeated (an answer that continues them copies earlier text) and the
    prompt past the QSA budget as it is."""
    out = {name: ids * 3 for name, ids in prompts.items() if name != "beyond_budget"}
    out["beyond_budget"] = prompts["beyond_budget"]
    return out


def serve(tmp, name: str, prompts: dict[str, list[int]], path) -> dict:
    svc = Service(tmp, name, path, ("VLLM_USE_V2_MODEL_RUNNER",), **STARTS[name])
    try:
        out = {
            "cold": {n: svc.greedy_ids(ids, NEW_TOKENS) for n, ids in prompts.items()},
            "cached": {n: svc.greedy_ids(ids, NEW_TOKENS) for n, ids in prompts.items()},
            "spec": {
                m: sum(s.value for s in svc.samples(m) if s.name.endswith("_total")) for m in SPEC_METRICS
            },
            "log": svc.log(),
        }
    finally:
        out["rc"] = svc.stop()
    return out


def mtp_checkpoint() -> Path:
    """``qsa512`` with one MTP layer trained with it (generated once per machine)."""
    path = CHECKPOINTS / "qsa512-mtp1"
    if not (path / "model.safetensors").exists():
        cmd = [sys.executable, "-m", "model.tools.mtp_checkpoints", "--preset", "qsa512", "--mtp-layers", "1"]
        subprocess.run([*cmd, "--out", str(path)], check=True, cwd=ROOT)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path, prompts = qsa512_prompts()
    prompts = copy_heavy(prompts)
    mtp_path = mtp_checkpoint()
    with concurrent.futures.ThreadPoolExecutor(len(STARTS)) as pool:
        futures = {
            name: pool.submit(
                serve,
                tmp_path_factory.mktemp(name),
                name,
                prompts,
                mtp_path if name.startswith("mtp") else path,
            )
            for name in STARTS
        }
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_greedy_tokens_with_ngram_drafts_equal_those_without(runs, cache):
    off, on = runs[f"{cache}-off"], runs[f"{cache}-ngram"]
    assert "speculative decoding: ngram, 3 draft tokens" in on["log"]
    for kind in ("cold", "cached"):
        for name, ids in off[kind].items():
            assert on[kind][name] == ids, (cache, kind, name)
    assert on["rc"] == 0 and off["rc"] == 0


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_acceptance_counters_reach_the_metrics(runs, cache):
    spec = runs[f"{cache}-ngram"]["spec"]
    drafts, accepted = spec["vllm:spec_decode_num_drafts"], spec["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and 0 < accepted <= 3 * drafts, spec
    assert not any(runs[f"{cache}-off"]["spec"].values())


def test_greedy_tokens_with_mtp_drafts_equal_those_without(runs):
    off, on = runs["mtp-off"], runs["mtp-on"]
    assert "speculative decoding: mtp, " in on["log"], on["log"][-3000:]
    for kind in ("cold", "cached"):
        for name, ids in off[kind].items():
            assert on[kind][name] == ids, (kind, name)
    drafts, accepted = (on["spec"][m] for m in SPEC_METRICS)
    assert drafts > 0 and 0 < accepted, on["spec"]
    assert on["rc"] == 0 and off["rc"] == 0
