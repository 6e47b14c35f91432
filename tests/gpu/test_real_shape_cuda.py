"""The real model's shape served by ``python -m service`` on CUDA, the 3090's choices forced.

``real-4layer`` (``model.tools.checkpoints``): the real config (16 index heads of 128, budget 2048 at
ratio 4, 512 experts, a null output gate, RoPE on a quarter of 256-wide heads) cut to 4 layers so
that transformers can be the reference on one GPU. Random weights drawn on the GPU.

Three starts of ``python -m service`` itself (no test shim), prefix caching on (the service's
default), prompts from 16 to 16,000 tokens, each asked twice (the second time from the prefix
cache):

1. ``defaults``: nothing set but the checkpoint and limits: the implementation, GDN prefill and
   kernels the product picks on this GPU by itself, CUDA graphs; a streamed chat completion through
   the openai client;
2. ``sm86-eager``: ``QWEN4EXP_FORCE_SM86=1`` (Triton GDN prefill, Marlin, sm_86 tiles), eager;
3. ``sm86-graphs``: the same with CUDA graphs.

Each start's greedy tokens must equal transformers' (bf16) or part at a proven near-tie of the
reference (``tests.parity.test_generation_parity.assert_same``), and ``/metrics`` must name the
implementation it serves.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.parity.test_generation_parity import assert_same

from .test_engine_parity import reference_greedy
from .test_service_cuda import Service, stream_chat

pytestmark = pytest.mark.vllm_cuda

PRESET = "real-4layer"
LENGTHS = tuple(int(n) for n in os.environ.get("GPU_TEST_REAL_LENGTHS", "16,600,4000,16000").split(","))
NEW_TOKENS = 8
STARTS = {
    "defaults": {},
    "sm86-eager": {"QWEN4EXP_FORCE_SM86": "1", "QWEN4EXP_ENFORCE_EAGER": "true"},
    "sm86-graphs": {"QWEN4EXP_FORCE_SM86": "1"},
}
# Drop the runner/implementation pins of this directory's conftest: the service chooses them.
CHOSEN_BY_SERVICE = ("QWEN4EXP_CUDA_MODEL", "VLLM_USE_V2_MODEL_RUNNER")


def real_checkpoint() -> Path:
    from model.tools.checkpoints import make_checkpoint

    path = ROOT / "checkpoints" / PRESET
    if not (path / "model.safetensors").exists():
        make_checkpoint(PRESET, path, seed=0, train_steps=0, device="cuda")
    return path


@pytest.fixture(scope="module")
def case():
    from tests.fidelity.measure import prompts_of_lengths

    path = real_checkpoint()
    prompts = {f"{n}": ids for n, ids in zip(LENGTHS, prompts_of_lengths(path, LENGTHS), strict=True)}
    return path, prompts, reference_greedy(path, prompts, "cuda", NEW_TOKENS)


@pytest.fixture(scope="module", params=list(STARTS))
def served(request, case, tmp_path_factory):
    path, prompts, _ = case
    env = dict(
        QWEN4EXP_MAX_MODEL_LEN=str(max(LENGTHS) + 64),
        QWEN4EXP_KV_CACHE_MEMORY_BYTES=str(8 << 30),
        QWEN4EXP_GPU_MEMORY_UTILIZATION="0.35",
        **STARTS[request.param],
    )
    svc = Service(
        tmp_path_factory.mktemp(request.param),
        request.param,
        path,
        CHOSEN_BY_SERVICE,
        force_sm86=False,  # each start sets its own choices
        startup_timeout_s=900,
        **env,
    )
    try:
        out = {"name": request.param, "ready_after_s": svc.ready_after_s}
        out["stream"] = stream_chat(svc)
        out["cold"] = {n: svc.greedy_ids(ids, NEW_TOKENS) for n, ids in prompts.items()}
        out["cached"] = {n: svc.greedy_ids(ids, NEW_TOKENS) for n, ids in prompts.items()}
        out["info"] = svc.samples("qwen4exp_service_info")
        out["prefix_hits"] = sum(v.value for v in svc.samples("vllm:prefix_cache_hits"))
        out["log"] = svc.log()
    finally:
        out["rc"] = svc.stop()
    print(
        f"[{request.param}] ready after {out['ready_after_s']:.0f} s, prefix-cache hit tokens {out['prefix_hits']:.0f}"
    )
    return out


def test_serves_the_real_shape_with_transformers_tokens(served, case):
    _, prompts, reference = case
    for when in ("cold", "cached"):
        same = sum(served[when][n] == reference[n][0] for n in prompts)
        print(f"[{served['name']}] {when}: {same}/{len(prompts)} prompts token-identical to transformers")
        assert_same(served[when], reference)
    assert served["rc"] == 0, served["log"][-4000:]


def test_answers_a_streamed_chat_and_names_its_implementation(served):
    chunks = served["stream"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text, "no streamed content"
    labels = served["info"][0].labels
    print(f"[{served['name']}] model_impl={labels.get('model_impl')}")
    assert labels["model_impl"] == "upstream", labels


def test_forced_sm86_takes_the_3090_paths(served):
    if served["name"] == "defaults":
        pytest.skip("the defaults start takes this GPU's own choices")
    log = served["log"]
    assert "Using Triton/FLA GDN prefill kernel" in log, log[-4000:]
