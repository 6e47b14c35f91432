"""Quantized PLE tables generate through vLLM exactly like bf16 tables holding the dequantized values.

transformers cannot load fp8/nvfp4 PLE checkpoints, so the reference for each quantized
checkpoint is vLLM running ``<fmt>-deq``: the same bf16 checkpoint with its PLE tables replaced by
the values the quantized lookup produces (``python -m model.tools.ple_quantize --dequantized``). Greedy
tokens must be identical. The four engines also vary the storage mode (VLLM_PLE_CPU_OFFLOAD), the
tensor parallelism (ETP: tables sharded by rows over the ranks) and the prefetch path
(VLLM_PLE_PREFETCH=1 runs the early-lookup plumbing synchronously on CPU), so a fault in any of
them shows up as a token mismatch. Small per-step token budgets split the long
prompts into many prefill chunks batched with decodes, so per-request n-gram state is exercised.
Each engine also exports the PLE metrics, read back from its multiprocess Prometheus directory.
"""

from __future__ import annotations

import os

import prometheus_client  # noqa: F401 - imported before PROMETHEUS_MULTIPROC_DIR is ever set here
import pytest

from tests.parity.prompts import parity_prompts
from tests.vllm_greedy import greedy_vllm

MAX_NEW_TOKENS = 16
LAYERS = ("model.layers.0.ple", "model.layers.1.ple")

# The nvfp4 pair runs with tensor parallelism 2 where two CPUs are available: each rank then holds
# half of every table, gathers raw nvfp4 bytes (codes + block scales) of the rows it owns, and the
# ranks sum the bytes before dequantizing (the bf16 reference sums dequantized rows instead). Both
# engines of a pair use the same parallelism, so only the PLE path can make them differ.
_CPUS = sorted(os.sched_getaffinity(0))
TP = 2 if len(_CPUS) >= 2 else 1
_TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": f"{_CPUS[0]}|{_CPUS[1]}"} if TP == 2 else {}

# name -> (checkpoint, tensor-parallel size, environment)
ENGINES = {
    "fp8_e4m3": ("fp8_e4m3", 1, {"VLLM_PLE_PREFETCH": "1"}),
    "fp8_e4m3-deq": ("fp8_e4m3-deq", 1, {"VLLM_PLE_CPU_OFFLOAD": "0", "VLLM_PLE_PREFETCH": "0"}),
    "nvfp4": ("nvfp4", TP, {"VLLM_PLE_CPU_OFFLOAD": "0", "VLLM_PLE_PREFETCH": "1", **_TP_ENV}),
    "nvfp4-deq": ("nvfp4-deq", TP, {"VLLM_PLE_CPU_OFFLOAD": "1", **_TP_ENV}),
}


def _generate(path, prompts: dict[str, list[int]], tp: int) -> dict[str, list[int]]:
    return greedy_vllm(
        path,
        prompts,
        MAX_NEW_TOKENS,
        in_process=False,  # the PLE metrics are read from the engine's multiprocess directory
        tensor_parallel_size=tp,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
    )


def _ple_samples(directory) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return [
        (s.name, dict(s.labels), s.value)
        for metric in registry.collect()
        for s in metric.samples
        if s.name.startswith("qwen4exp_ple_")
    ]


@pytest.fixture(scope="module")
def runs(ple_checkpoints, tmp_path_factory):
    """Greedy tokens and PLE metric samples of every engine in ENGINES (one engine at a time)."""
    from transformers import AutoTokenizer

    prompts = parity_prompts(AutoTokenizer.from_pretrained(ple_checkpoints["bf16"]))
    del prompts["very_long_sparse"]  # time: long_sparse (283 tokens) already spans 5 prefill chunks
    out = {}
    for name, (ckpt, tp, env) in ENGINES.items():
        metrics_dir = tmp_path_factory.mktemp(f"metrics-{name}")
        with pytest.MonkeyPatch.context() as mp:
            for key in ("VLLM_PLE_CPU_OFFLOAD", "VLLM_PLE_PREFETCH", "VLLM_CPU_OMP_THREADS_BIND"):
                mp.delenv(key, raising=False)
            for key, value in env.items():
                mp.setenv(key, value)
            mp.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
            tokens = _generate(ple_checkpoints[ckpt], prompts, tp)
        out[name] = (tokens, _ple_samples(metrics_dir))
    return out


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_quantized_generation_equals_dequantized_bf16(runs, fmt):
    got, _ = runs[fmt]
    want, _ = runs[f"{fmt}-deq"]
    mismatched = {name: (got[name], want[name]) for name in want if got[name] != want[name]}
    assert not mismatched, f"{fmt} differs from {fmt}-deq:\n" + "\n".join(
        f"  {name}: quantized={g}\n  {' ' * len(name)}  deq      ={w}" for name, (g, w) in mismatched.items()
    )
    assert all(len(tokens) == MAX_NEW_TOKENS for tokens in got.values())


@pytest.mark.parametrize(
    ("name", "mode", "fmt", "row_bytes"),
    [
        ("fp8_e4m3", "pinned", "fp8_e4m3", 32),
        ("fp8_e4m3-deq", "device", "bf16", 64),
        ("nvfp4", "device", "nvfp4", 18),
        ("nvfp4-deq", "pinned", "bf16", 64),
    ],
)
def test_engine_exports_ple_storage_metrics(runs, name, mode, fmt, row_bytes):
    _, samples = runs[name]
    ranks = [str(r) for r in range(ENGINES[name][1])]

    def by(metric: str, *labels: str) -> dict[tuple[str, ...], float]:
        return {tuple(s[1][k] for k in labels): s[2] for s in samples if s[0] == metric}

    info = by("qwen4exp_ple_storage_info", "layer", "rank", "mode", "format")
    assert info == {(layer, r, mode, fmt): 1.0 for layer in LAYERS for r in ranks}, samples
    # 4,064 rows in layer 0 and 4,152 in layer 1 (padded hash vocabularies), split evenly over the
    # ranks; vLLM's CPU build keeps both storage modes in plain RAM ("cpu"), no page-locked bytes.
    rows = dict(zip(LAYERS, (4064, 4152), strict=True))
    want = {(layer, r, "cpu"): rows[layer] // len(ranks) * row_bytes for layer in LAYERS for r in ranks}
    assert by("qwen4exp_ple_table_bytes", "layer", "rank", "storage") == want
    assert by("qwen4exp_ple_pinned_bytes", "layer", "rank") == {
        (layer, r): 0.0 for layer in LAYERS for r in ranks
    }
