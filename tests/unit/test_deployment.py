"""The deployment resolved once (:mod:`model.deployment.resolve`): facts injected, runs on any CPU.

What is checked: the implementation ``auto`` picks from config.json and the GPU, the GDN prefill
kernel, the variables vLLM's processes inherit, the flags added to vLLM's command line, the round
trip through ``additional_config``, every malformed variable reported at once, and that the
implementation is chosen by one function only.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from model.deployment import resolve as R
from model.runtime import additional_config, envs
from service import engine

ROOT = Path(__file__).resolve().parents[2]
A3090 = R.GpuFacts(capability=(8, 6))
H200 = R.GpuFacts(capability=(9, 0), shared_memory_per_block=232448)


def real_shape_config(budget: int = 2048) -> dict:
    from transformers import Qwen4ExpTextConfig

    from model.tools.checkpoints import preset_spec

    spec = {**preset_spec("real-4layer"), "indexer_budget": budget}
    return Qwen4ExpTextConfig(**spec, eos_token_id=2, pad_token_id=0).to_dict()


@pytest.mark.parametrize(("budget", "impl"), [(2048, "upstream"), (1024, "ours")])
def test_auto_on_cuda_is_decided_from_config_json_and_the_gpu(budget, impl):
    d = R.resolve({}, cpu_build=False, config=real_shape_config(budget), gpu=A3090)
    assert (d.requested_implementation, d.implementation) == ("auto", impl)
    assert (d.implementation_reasons == ()) is (impl == "upstream")
    if impl == "ours":  # 1024 tokens at ratio 4: 256 blocks, no upstream top-k kernel
        assert any("k = 256 blocks" in r for r in d.implementation_reasons), d.implementation_reasons


def test_the_cpu_build_serves_ours_and_keeps_an_explicit_upstream_for_its_refusal():
    assert R.resolve({}, cpu_build=True).implementation == "ours"
    assert R.resolve({envs.CUDA_MODEL: "ours"}, cpu_build=True).implementation == "ours"
    # The stand-in registered for upstream on the CPU build refuses at construction, naming why.
    assert R.resolve({envs.CUDA_MODEL: "upstream"}, cpu_build=True).implementation == "upstream"


def test_gdn_prefill_is_triton_where_the_cute_dsl_is_missing_or_a_3090_is_emulated():
    assert R.resolve({}, cpu_build=True).gdn_prefill_backend is None
    assert R.resolve({}, cpu_build=False, gpu=H200).gdn_prefill_backend is None  # vLLM decides
    no_cutlass = R.GpuFacts(capability=(9, 0), has_cute_dsl=False)
    assert R.resolve({}, cpu_build=False, gpu=no_cutlass).gdn_prefill_backend == "triton"
    forced = R.resolve({envs.FORCE_SM86: "1"}, cpu_build=False, gpu=H200)
    assert forced.gdn_prefill_backend == "triton" and forced.fp8_marlin
    assert forced.additional_config()["gdn_prefill_backend"] == "triton"


@pytest.mark.parametrize(
    ("env", "cpu_build", "want"),
    [
        ({}, False, {envs.CUDA_MODEL: "upstream", R.V2_RUNNER: "1"}),
        ({envs.CUDA_MODEL: "ours"}, False, {envs.CUDA_MODEL: "ours", R.V2_RUNNER: "0"}),
        ({R.V2_RUNNER: "0"}, False, {envs.CUDA_MODEL: "upstream"}),  # the operator's value stays
        ({}, True, {envs.CUDA_MODEL: "ours"}),  # vLLM's CPU build needs no runner choice
        ({envs.FORCE_SM86: "1"}, False, {envs.CUDA_MODEL: "upstream", R.V2_RUNNER: "1", R.FP8_MARLIN: "1"}),
    ],
)
def test_what_vllms_processes_inherit(env, cpu_build, want):
    assert R.resolve(env, cpu_build=cpu_build, gpu=None if cpu_build else A3090).child_environment() == want


@pytest.mark.parametrize(
    ("env", "cpu_build", "engram"),
    [
        ({envs.PLE_CPU_OFFLOAD: "0"}, False, True),  # upstream keeps tables where engram_config says
        ({envs.CUDA_MODEL: "upstream", envs.PLE_CPU_OFFLOAD: "off"}, False, True),
        ({}, False, False),  # pinned: vLLM's default already
        ({envs.CUDA_MODEL: "ours", envs.PLE_CPU_OFFLOAD: "0"}, False, False),  # ours reads the deployment
        ({envs.PLE_CPU_OFFLOAD: "0"}, True, False),
    ],
)
def test_ple_storage_reaches_upstreams_engram_config(env, cpu_build, engram):
    d = R.resolve(env, cpu_build=cpu_build, gpu=None if cpu_build else A3090)
    argv = d.engine_args()
    assert ("--engram-config" in argv) is engram
    parsed = engine.parse_args(["--model", "m", *argv])  # vLLM's own parser takes every flag
    if engram:
        assert parsed.engram_config.cpu_offload is False
    assert parsed.additional_config[additional_config.KEY]["ple_storage"] == d.ple_storage


def test_the_deployment_arrives_whole_through_additional_config(tmp_path):
    env = {
        envs.QSA_KV_SCALES: str(tmp_path / "scales.json"),
        envs.QSA_KV_COLLECT: str(tmp_path / "dumps"),
        envs.QSA_KV_CLIP_COUNT: "5",
        envs.PLE_CPU_OFFLOAD: "no",
        envs.QSA_SELECTION: "batched",
        envs.FAULT_INJECT_TOKEN: "7",
        envs.HC_REFERENCE_ROUNDING: "0",
    }
    d = R.resolve(env, cpu_build=False, kv_cache_dtype="fp8", config=real_shape_config(), gpu=A3090)
    extra = json.loads(json.dumps(d.additional_config()))  # what vLLM's parser and pickling carry
    vllm_config = SimpleNamespace(additional_config=extra)
    assert R.of(vllm_config) == d
    assert d.qsa_kv.scales_path == tmp_path / "scales.json" and d.qsa_kv.clip_interval_s == 5.0
    assert (d.ple_storage, d.qsa_selection, d.fault_tokens) == ("device", "batched", ((7, False),))
    assert not d.hc_reference_rounding and d.gdn_short_prefill


def test_without_the_service_a_process_resolves_from_its_environment(monkeypatch):
    monkeypatch.setenv(envs.PLE_CPU_OFFLOAD, "0")
    vllm_config = SimpleNamespace(additional_config={}, cache_config=SimpleNamespace(cache_dtype="auto"))
    d = R.of(vllm_config)
    assert (d.device, d.implementation, d.ple_storage, d.qsa_selection) == ("cpu", "ours", "device", "loop")
    # written back: later readers agree, and vLLM's config hash (its compile-cache key) sees it
    assert json.loads(json.dumps(vllm_config.additional_config))["qwen4exp"]["ple_storage"] == "device"
    monkeypatch.setenv(envs.PLE_CPU_OFFLOAD, "1")
    assert R.of(vllm_config) == d


def test_a_variable_that_changes_the_graph_changes_vllms_compile_cache_key(monkeypatch):
    """vLLM's compile cache is keyed by the config's hash (additional_config included) and vLLM's
    own variables only: the deployment resolved in the process must enter additional_config."""
    from vllm.config import VllmConfig

    hashes = []
    for rounding in ("1", "0"):
        monkeypatch.setenv(envs.HC_REFERENCE_ROUNDING, rounding)
        vllm_config = VllmConfig()
        vllm_config.cache_config.cache_dtype = "auto"
        R.of(vllm_config)
        hashes.append(vllm_config.compute_hash())
    assert hashes[0] != hashes[1]


def test_every_malformed_variable_is_reported_at_once():
    env = {envs.PLE_CPU_OFFLOAD: "of", envs.CUDA_MODEL: "fastest", envs.QSA_KV_CLIP_COUNT: "-1"}
    with pytest.raises(R.DeploymentError) as info:
        R.resolve(env, cpu_build=False, gpu=A3090)
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    for name in env:
        assert any(line.startswith(f"{name}=") and "fix:" in line for line in lines), (name, lines)


def _callers(function: str) -> list[str]:
    """Modules of ``model/``, ``service/`` and ``bench/`` that call ``function`` by name."""
    found = []
    for path in sorted(p for top in ("model", "service", "bench") for p in (ROOT / top).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name == function:
                    found.append(str(path.relative_to(ROOT)))
    return found


def test_the_implementation_is_chosen_in_one_function():
    assert _callers("choose_implementation") == ["model/deployment/resolve.py"]
    assert _callers("_choose") == ["model/deployment/resolve.py"]
    # The service's start-up and its preflight reach the choice only through resolve().
    for module in ("service/engine.py", "service/preflight_checks.py"):
        source = (ROOT / module).read_text()
        assert "from model.deployment.resolve import" in source, module


def test_several_ranks_on_the_cpu_build_get_their_own_cores_and_a_share_of_memory():
    d = R.resolve({}, cpu_build=True, tensor_parallel_size=2, cpus=(0, 1, 2, 3, 4), memory_available=8 << 30)
    assert d.child_environment()[R.CPU_THREADS_BIND] == "0,1|2,3"
    assert d.cpu_kv_cache_bytes == 2 << 30  # half of what is available, split between the ranks
    at = d.engine_args().index("--kv-cache-memory-bytes")
    assert d.engine_args()[at + 1] == str(2 << 30)
    # The operator's binding and sizes are theirs; one rank needs neither.
    given = R.resolve(
        {R.CPU_THREADS_BIND: "0|1", "VLLM_CPU_KVCACHE_SPACE": "4"}, cpu_build=True, tensor_parallel_size=2,
        cpus=(0, 1), memory_available=8 << 30,
    )  # fmt: skip
    assert (given.cpu_threads_bind, given.cpu_kv_cache_bytes) == (None, None)
    sized = R.resolve({}, cpu_build=True, tensor_parallel_size=2, cpus=(0, 1), kv_cache_memory_bytes=1 << 30)
    assert sized.cpu_kv_cache_bytes is None and "--kv-cache-memory-bytes" not in sized.engine_args()
    alone = R.resolve({}, cpu_build=True, cpus=(0, 1), memory_available=8 << 30)
    assert (alone.cpu_threads_bind, alone.cpu_kv_cache_bytes) == (None, None)
    with pytest.raises(
        R.DeploymentError, match="QWEN4EXP_TENSOR_PARALLEL_SIZE=4 on vLLM's CPU build needs a core"
    ):
        R.resolve({}, cpu_build=True, tensor_parallel_size=4, cpus=(0, 1))


def _int4_config(width: int) -> dict:
    """config.json of a TP=4 checkpoint with int4 (group 128) experts ``width`` wide."""
    config = json.loads((ROOT / "deploy" / "qwen4-exp-config.example.json").read_text())
    config["moe_intermediate_size"] = width
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {
                "targets": [r"re:^model\.layers\.\d+\.mlp\.experts\.\d+\.gate_proj$"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "strategy": "group",
                    "group_size": 128,
                    "symmetric": True,
                },
            }
        },
    }
    return config


def test_auto_serves_whole_experts_where_marlin_cannot_take_the_slices():
    """640-wide int4 experts at TP=4 are 160 per rank, which no group of 128 tiles: ``auto`` gives each
    rank whole experts and says why; 512-wide ones (128 per rank) keep the slices."""
    wide = R.resolve({}, cpu_build=False, config=_int4_config(640), gpu=A3090, tensor_parallel_size=4)
    assert wide.expert_parallel and "--enable-expert-parallel" in wide.engine_args()
    assert "160" in wide.expert_parallel_note
    fits = R.resolve({}, cpu_build=False, config=_int4_config(512), gpu=A3090, tensor_parallel_size=4)
    assert not fits.expert_parallel and "--enable-expert-parallel" not in fits.engine_args()
    on = R.resolve({envs.EXPERT_PARALLEL: "true"}, cpu_build=False, config=_int4_config(512), gpu=A3090,
                   tensor_parallel_size=4)  # fmt: skip
    assert on.expert_parallel
    one_rank = R.resolve({envs.EXPERT_PARALLEL: "on"}, cpu_build=False, config=_int4_config(640), gpu=A3090)
    assert not one_rank.expert_parallel and "nothing to split" in one_rank.expert_parallel_note
    # vLLM's CPU fused-MoE kernel crashes on a rank's share of the experts: sliced there, with the reason.
    cpu = R.resolve({envs.EXPERT_PARALLEL: "on"}, cpu_build=True, tensor_parallel_size=2, cpus=(0, 1),
                    memory_available=8 << 30)  # fmt: skip
    assert not cpu.expert_parallel and "--enable-expert-parallel" not in cpu.engine_args()
    assert "CPU build" in cpu.expert_parallel_note
    # The deployment travels to vLLM's processes whole, the new field with it.
    assert R.from_json(json.loads(json.dumps(R._to_json(wide)))) == wide


def test_expert_parallelism_off_where_only_whole_experts_fit_stops_start_up_naming_the_fix():
    with pytest.raises(R.DeploymentError, match="QWEN4EXP_EXPERT_PARALLEL=off: Marlin cannot run"):
        R.resolve({envs.EXPERT_PARALLEL: "off"}, cpu_build=False, config=_int4_config(640), gpu=A3090,
                  tensor_parallel_size=4)  # fmt: skip
    with pytest.raises(R.DeploymentError, match="QWEN4EXP_EXPERT_PARALLEL='sideways'"):
        R.resolve({envs.EXPERT_PARALLEL: "sideways"}, cpu_build=False, gpu=A3090)
