"""vLLM engine settings for the GPU tests: the paths a 3090 takes, small caches, few graph sizes."""

from __future__ import annotations

import os
from collections.abc import Sequence

# Triton/FLA GDN prefill: the path an RTX 3090 (sm_86) takes; on an H200 vLLM would otherwise pick
# FlashInfer's CuTe-DSL prefill (sm_90 only, needs the cutlass DSL package).
CUDA_ADDITIONAL_CONFIG = {"gdn_prefill_backend": "triton"}
GRAPH_SIZES = (1, 2, 4, 8, 16)


def cuda_engine_args(
    graphs: bool = False,
    graph_sizes: Sequence[int] = GRAPH_SIZES,
    gpu_memory_utilization: float | None = None,
    **overrides,
) -> dict:
    """Engine arguments for one test engine on CUDA (vLLM's CPU build when dry-running).

    One block, so that every GPU test compares like with like: bfloat16, seed 0, no prefix caching,
    2,048 tokens, eager unless ``graphs`` (then CUDA graphs captured at ``graph_sizes`` only, which
    keeps start-up short), a fixed KV cache (vLLM then skips its memory profiling, which goes wrong
    while other engines start on the same GPU), the 3090's GDN prefill, and no FlashInfer autotune
    (vLLM runs it on sm_90 and newer only, so an RTX 3090 never does; on an H100/H200 it adds minutes
    of start-up and JIT builds per engine).
    ``gpu_memory_utilization``: default ``QWEN4EXP_GPU_TEST_MEM`` (0.5). ``overrides`` replace any
    of these or add other engine arguments.
    """
    if gpu_memory_utilization is None:
        gpu_memory_utilization = float(os.environ.get("QWEN4EXP_GPU_TEST_MEM", "0.5"))
    args: dict = dict(
        dtype="bfloat16",
        seed=0,
        enable_prefix_caching=False,
        max_model_len=2048,
        enforce_eager=not graphs,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=2 << 30,
        additional_config=dict(CUDA_ADDITIONAL_CONFIG),
        enable_flashinfer_autotune=False,
    )
    if graphs:
        args["compilation_config"] = {"cudagraph_capture_sizes": list(graph_sizes)}
    args.update(overrides)
    return args
