"""vLLM engine settings for the GPU tests: the paths a 3090 takes, small caches, few graph sizes."""

from __future__ import annotations

import os

# Triton/FLA GDN prefill: the path an RTX 3090 (sm_86) takes; on an H200 vLLM would otherwise pick
# FlashInfer's CuTe-DSL prefill (sm_90 only, needs the cutlass DSL package).
CUDA_ADDITIONAL_CONFIG = {"gdn_prefill_backend": "triton"}
GRAPH_SIZES = [1, 2, 4, 8, 16]


def cuda_engine_args(graphs: bool = False, **overrides) -> dict:
    """Engine arguments for one test engine on CUDA (vLLM's CPU build when dry-running)."""
    args: dict = dict(
        enforce_eager=not graphs,
        gpu_memory_utilization=float(os.environ.get("QWEN4EXP_GPU_TEST_MEM", "0.5")),
        kv_cache_memory_bytes=2 << 30,
        additional_config=dict(CUDA_ADDITIONAL_CONFIG),
    )
    if graphs:
        args["compilation_config"] = {"cudagraph_capture_sizes": GRAPH_SIZES}
    args.update(overrides)
    return args
