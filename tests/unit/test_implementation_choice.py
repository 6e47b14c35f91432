"""``QWEN4EXP_CUDA_MODEL``: the choice, every refusal of upstream and the registration targets (CPU).

Upstream cannot run (or even be imported) on vLLM's CPU build, so this covers the decision with
injected facts; ``tests/gpu/test_upstream_cuda.py`` starts upstream on a GPU.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from model.deployment import implementation as choice
from model.runtime import envs

CLEAN_CONFIG = {
    "architectures": ["Qwen4ExpForCausalLM"],
    "hidden_act": "silu",
    "output_gate_type": "silu",
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "layer_types": ["linear_attention", "indexed_attention"],
    "ple_embedding_dtype": None,
}
CLEAN = dict(cuda=True, capability=(9, 0), kv_cache_dtype="auto", v2_runner=True)


def problems(config=None, env=None, **facts):
    return choice.problems_for_upstream(
        CLEAN_CONFIG if config is None else config, env or {}, **{**CLEAN, **facts}
    )


def test_parser_spellings_default_and_errors():
    assert envs.cuda_model({}) == "auto"
    assert envs.cuda_model({envs.CUDA_MODEL: " "}) == "auto"
    assert choice.registered("auto", cpu_build=True) == "ours"
    assert choice.registered("auto", cpu_build=False) == "upstream"
    assert choice.registered("ours", cpu_build=False) == "ours"
    assert envs.cuda_model({envs.CUDA_MODEL: "Upstream "}) == "upstream"
    assert envs.cuda_model({envs.CUDA_MODEL: "OURS"}) == "ours"
    for bad in ("vllm", "native", "1", "up"):
        with pytest.raises(
            envs.EnvError, match=f"^QWEN4EXP_CUDA_MODEL='{bad}' is not a valid value: use auto"
        ):
            envs.cuda_model({envs.CUDA_MODEL: bad})
    _, found = envs.validate({envs.CUDA_MODEL: "vllm"})
    assert any(p.startswith("QWEN4EXP_CUDA_MODEL='vllm'") and "fix: use auto" in p for p in found)


@pytest.mark.parametrize("config", [CLEAN_CONFIG, {"text_config": CLEAN_CONFIG}])
def test_clean_cuda_deployment_has_no_problems(config):
    assert problems(config) == []
    assert problems(config, kv_cache_dtype="fp8", capability=(8, 9)) == []
    assert problems(config, kv_cache_dtype="fp8_e4m3", capability=(9, 0)) == []
    assert problems(config, kv_cache_dtype="bfloat16") == []
    # The FP8 main cache below sm_89 and our K/V features: our subclass carries them (model.upstream.qsa).
    assert problems(config, kv_cache_dtype="fp8", capability=(8, 6)) == []
    assert problems(config, kv_cache_dtype="fp8_e4m3", capability=None) == []
    kv_env = {envs.QSA_KV_SCALES: "/s.json", envs.QSA_KV_COLLECT: "/tmp/c", envs.QSA_KV_CLIP_COUNT: "5"}
    assert problems(config, kv_env, kv_cache_dtype="fp8", capability=(8, 6)) == []
    assert problems(config, indexer_kv_dtype="fp8", capability=(9, 0)) == []
    # Our PLE table formats: the subclass reads them (model.upstream.ple).
    assert problems({**config, "ple_embedding_dtype": "nvfp4"}) == []
    fp8_ple = {**CLEAN_CONFIG, "quantization_config": {"ple_embedding_dtype": "float8_e4m3fn"}}
    assert problems(fp8_ple) == []
    for k in choice.UPSTREAM_TOPK_BLOCKS:
        assert problems({**CLEAN_CONFIG, "indexer_budget": 4 * k}) == []
    # Unset or empty variables are not features in use.
    assert problems(env={envs.QSA_KV_SCALES: "", envs.QSA_KV_COLLECT: "  "}) == []


def test_each_problem_names_its_variable_and_the_fix():
    cases = {
        "vLLM's CUDA build": dict(cuda=False, capability=None),
        "VLLM_USE_V2_MODEL_RUNNER=1": dict(v2_runner=False),
        "output_gate_type='tanh'": dict(config={**CLEAN_CONFIG, "output_gate_type": "tanh"}),
        "k = 256 blocks": dict(config={**CLEAN_CONFIG, "indexer_budget": 1024}),
        "no whole number of blocks": dict(config={**CLEAN_CONFIG, "indexer_budget": 2050}),
        "indexer_kv_dtype=fp8 on a GPU of compute capability sm_86": dict(
            indexer_kv_dtype="fp8", capability=(8, 6)
        ),
        "indexer_kv_dtype=fp8 on a GPU of compute capability unknown": dict(
            indexer_kv_dtype="fp8", capability=None
        ),
        "--kv-cache-dtype fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2"),
        "is not a PLE table format": dict(config={**CLEAN_CONFIG, "ple_embedding_dtype": "fp8"}),
    }
    for needle, facts in cases.items():
        (found,) = problems(**facts)  # exactly one problem, this one
        assert needle in found, (needle, found)
        assert "fix:" in found and "set QWEN4EXP_CUDA_MODEL=ours" in found, found
    assert (
        "VLLM_USE_V2_MODEL_RUNNER='0'" in problems(env={"VLLM_USE_V2_MODEL_RUNNER": "0"}, v2_runner=False)[0]
    )
    # A null gate is hidden_act, as transformers reads it; the subclass writes it into the config.
    assert problems({**CLEAN_CONFIG, "output_gate_type": None}) == []
    assert (
        "hidden_act='tanh'" in problems({**CLEAN_CONFIG, "output_gate_type": None, "hidden_act": "tanh"})[0]
    )
    # Missing QSA fields are a problem; a model without QSA layers has no top-k to check.
    no_budget = {k: v for k, v in CLEAN_CONFIG.items() if k != "indexer_budget"}
    assert "indexer_budget=None" in problems(no_budget)[0]
    assert problems({**no_budget, "layer_types": ["linear_attention"]}) == []
    # Weight formats are vLLM's to check (upstream loads them through vLLM's configs; the AWQ/GPTQ
    # and compressed-tensors pairs ran on the H200, tests/gpu/test_upstream_cuda.py).
    for method in ("fp8", "compressed-tensors", "awq", "gptq"):
        assert problems({**CLEAN_CONFIG, "quantization_config": {"quant_method": method}}) == [], method


def test_all_problems_are_reported_at_once():
    bad_config = {
        **CLEAN_CONFIG,
        "output_gate_type": "tanh",
        "indexer_budget": 64,
        "ple_embedding_dtype": "nvfp4",
    }
    env = {envs.QSA_KV_SCALES: "s.json", envs.QSA_KV_COLLECT: "d", envs.QSA_KV_CLIP_COUNT: "1"}
    found = problems(
        bad_config, env, v2_runner=False, kv_cache_dtype="fp8_e5m2", capability=(8, 6), indexer_kv_dtype="fp8"
    )
    assert len(found) == 5, found
    text = choice.refusal_message(found)
    assert text.startswith("QWEN4EXP_CUDA_MODEL=upstream (vLLM's own CUDA Qwen4-Exp) cannot serve")
    assert "5 problem(s)" in text and text.count("\n  - ") == 5
    for name in (
        "VLLM_USE_V2_MODEL_RUNNER",
        "output_gate_type",
        "indexer_budget",
        "--kv-cache-dtype fp8_e5m2",
        "indexer_kv_dtype",
    ):
        assert name in text


def test_registration_targets():
    ours = {
        "Qwen4ExpForCausalLM": "model.ours.model:Qwen4ExpForCausalLM",
        "Qwen4ExpForConditionalGeneration": "model.ours.model:Qwen4ExpForConditionalGeneration",
    }
    assert choice.registration_targets("ours", cpu_build=True) == ours
    assert choice.registration_targets("ours", cpu_build=False) == ours
    assert choice.registration_targets("upstream", cpu_build=False) == {
        "Qwen4ExpForCausalLM": "model.upstream.model:Qwen4ExpForCausalLM",
        "Qwen4ExpForConditionalGeneration": "model.upstream.model:Qwen4ExpForConditionalGeneration",
    }
    assert choice.registration_targets("upstream", cpu_build=True) == {
        "Qwen4ExpForCausalLM": "model.ours.upstream_stand_ins:Qwen4ExpForCausalLMRefusedOnCpuBuild",
        "Qwen4ExpForConditionalGeneration": (
            "model.ours.upstream_stand_ins:Qwen4ExpForConditionalGenerationRefusedOnCpuBuild"
        ),
    }
    # auto: ours on the CPU build, upstream's subclasses on CUDA.
    assert choice.registration_targets("auto", cpu_build=True) == ours
    assert choice.registration_targets("auto", cpu_build=False) == choice.registration_targets(
        "upstream", cpu_build=False
    )
    with pytest.raises(ValueError, match="unknown QWEN4EXP_CUDA_MODEL choice"):
        choice.registration_targets("vllm", cpu_build=False)


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def test_plugin_registers_the_choice(monkeypatch):
    """``register()`` on this machine (vLLM's CPU build): ours by default, the stand-ins for upstream."""
    from vllm import ModelRegistry

    from model import plugin

    assert choice.vllm_is_cpu_build(), "these CPU tests run on vLLM's CPU build"
    registered = {}
    monkeypatch.setattr(
        ModelRegistry, "register_model", lambda arch, target: registered.update({arch: target})
    )
    for value, cpu_choice in (("", "ours"), ("auto", "ours"), ("ours", "ours"), ("upstream", "upstream")):
        monkeypatch.setenv(envs.CUDA_MODEL, value)
        plugin.register()
        assert registered == choice.registration_targets(cpu_choice, cpu_build=True)
    monkeypatch.setenv(envs.CUDA_MODEL, "nvidia")
    with pytest.raises(envs.EnvError, match="QWEN4EXP_CUDA_MODEL='nvidia'"):
        plugin.register()


def test_cpu_build_stand_ins_refuse_naming_the_variable():
    """Constructing the CPU build's ``upstream`` target raises before ours builds anything."""
    cfg = SimpleNamespace(to_dict=lambda: dict(CLEAN_CONFIG))
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=cfg, quantization=None),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        use_v2_model_runner=True,
    )
    ours = choice.registration_targets("ours", cpu_build=True)
    for arch, target in choice.registration_targets("upstream", cpu_build=True).items():
        cls = _resolve(target)
        assert issubclass(cls, _resolve(ours[arch]))  # vLLM inspects it like ours before construction
        with pytest.raises(ValueError) as err:
            cls(vllm_config=vllm_config)
        text = str(err.value)
        assert text.startswith("QWEN4EXP_CUDA_MODEL=upstream") and "1 problem(s)" in text, text
        assert "needs vLLM's CUDA build" in text and "set QWEN4EXP_CUDA_MODEL=ours" in text


def test_ple_needs_a_single_eos_id_for_upstream():
    ple = {**CLEAN_CONFIG, "ple_layer_ids": [1]}
    assert problems({**ple, "eos_token_id": 7}) == []
    for eos in ([7, 8], None, "7"):
        (found,) = problems({**ple, "eos_token_id": eos})
        assert f"eos_token_id={eos!r}" in found and "QWEN4EXP_CUDA_MODEL=ours" in found
    assert problems({**CLEAN_CONFIG, "eos_token_id": [7, 8]}) == []  # no PLE layers: not read


PLE_CONFIG = {**CLEAN_CONFIG, "ple_layer_ids": [1], "eos_token_id": 2}


def test_ple_storage_must_match_upstreams_engram_config():
    """Upstream puts its PLE tables where vLLM's engram_config says, not where VLLM_PLE_CPU_OFFLOAD
    does: a disagreement is refused with the flag that fixes it."""
    off = {envs.PLE_CPU_OFFLOAD: "0"}
    assert problems(PLE_CONFIG, ple_cpu_offload=True) == []  # both default to pinned
    assert problems(PLE_CONFIG, off, ple_cpu_offload=False) == []
    assert problems(PLE_CONFIG, {envs.PLE_CPU_OFFLOAD: "yes"}, ple_cpu_offload=True) == []
    (found,) = problems(PLE_CONFIG, off, ple_cpu_offload=True)
    assert found.startswith("VLLM_PLE_CPU_OFFLOAD='0' asks for PLE tables in GPU memory")
    assert """--engram-config '{"cpu_offload": false}'""" in found
    (found,) = problems(PLE_CONFIG, {}, ple_cpu_offload=False)
    assert "pinned host memory" in found and """'{"cpu_offload": true}'""" in found
    # No PLE layers, or no engram config resolved: nothing to compare.
    assert problems(CLEAN_CONFIG, off, ple_cpu_offload=True) == []
    assert problems(PLE_CONFIG, off, ple_cpu_offload=None) == []


def test_index_heads_are_served_with_a_tile_that_fits_and_refused_only_when_none_does():
    """Upstream's indexer prefill tile is sized for the GPU (model.upstream.indexer_tiles),
    so the real model's 16 heads of 128 are no problem on a 3090 or an H200; a shape that no tile
    fits still is."""
    config = {**CLEAN_CONFIG, "indexer_n_heads": 16, "indexer_head_dim": 128}
    assert problems(config, capability=(8, 6), shared_memory_per_block=101376) == []
    assert problems(config, capability=(9, 0), shared_memory_per_block=232448) == []
    assert (
        problems({**config, "indexer_n_heads": 64}, capability=(8, 6), shared_memory_per_block=101376) == []
    )
    (found,) = problems(
        {**config, "indexer_head_dim": 1024}, capability=(8, 6), shared_memory_per_block=101376
    )
    assert "indexer_n_heads=16 x indexer_head_dim=1024" in found and "this GPU allows 101,376" in found
    assert found.endswith(choice.USE_OURS)


def test_auto_picks_upstream_when_it_can_serve_and_ours_with_the_reasons_otherwise():
    real = {**CLEAN_CONFIG, "indexer_n_heads": 16, "indexer_head_dim": 128, "output_gate_type": None}
    facts = dict(cuda=True, capability=(8, 6))
    assert choice.choose_implementation(real, {}, **facts) == ("upstream", [])
    impl, why = choice.choose_implementation({**real, "indexer_budget": 1024}, {}, **facts)
    assert impl == "ours" and "k = 256 blocks" in why[0]
    assert choice.choose_implementation(real, {}, cuda=False, capability=None)[0] == "ours"
    # An explicit choice is kept: upstream with its problems (the service refuses them), or ours.
    assert (
        choice.choose_implementation(
            {**real, "indexer_budget": 1024}, {envs.CUDA_MODEL: "upstream"}, **facts
        )[0]
        == "upstream"
    )
    assert choice.choose_implementation(real, {envs.CUDA_MODEL: "ours"}, **facts)[0] == "ours"
    # The 3090's shared memory under QWEN4EXP_FORCE_SM86, whatever the card.
    huge = {**real, "indexer_head_dim": 512}  # fits an H200 with 2 rows, no 3090
    assert choice.choose_implementation(huge, {}, cuda=True, capability=(9, 0))[0] == "upstream"
    assert (
        choice.choose_implementation(huge, {"QWEN4EXP_FORCE_SM86": "1"}, cuda=True, capability=(9, 0))[0]
        == "ours"
    )


@pytest.mark.parametrize(
    ("eager", "mode", "graphs"),
    [
        (False, "PIECEWISE", True),
        (False, "FULL_AND_PIECEWISE", True),
        (False, "NONE", False),
        (True, "PIECEWISE", False),
    ],
)
def test_cuda_graphs_fact_from_the_vllm_config(eager, mode, graphs):
    from vllm.config.compilation import CUDAGraphMode

    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=eager),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode]),
    )
    assert choice.captures_cuda_graphs(config) is graphs
