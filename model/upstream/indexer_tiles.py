"""The QSA indexer prefill tile of vLLM's own CUDA Qwen4-Exp, chosen for the GPU it runs on.

Why: upstream's indexer prefill kernel (``vllm.models.qwen4_exp.nvidia.ops.qsa_indexer``,
``_qsa_mqa_paged_prefill_kernel``) keeps a query tile of ``TILE_R`` rows x every index head
(padded to a power of two) x the index head dim in shared memory, and its launcher fixes
``TILE_R`` at 64 (bf16 cache) or 32 (FP8), tuned on a GB300. With the real model's 16 index heads
of 128 that tile needs 286,720 bytes on sm_86 and 303,104 on sm_90 (compiled with Triton for each
target, ``tests/kernels/test_sm86_compile.py``), more than an RTX 3090 (101,376 bytes per block)
or an H200 (232,448) allows, so the kernel does not launch and the model cannot serve.

The kernel takes ``TILE_R`` as a compile-time parameter, so a smaller tile is the same kernel with
fewer query rows per program (more programs); the scores it writes are the same. This module
replaces only the launcher: it picks the largest ``TILE_R`` (from upstream's default down) whose
shared memory fits the device's ``shared_memory_per_block_optin`` and launches upstream's kernel
with it. The fit is decided from the tile arithmetic with a bound for the key tiles that covers the
compiled kernels on sm_86 and sm_90 (:func:`shared_bytes_bound`); the compile test checks the
chosen tiles against Triton's own report. ``QWEN4EXP_FORCE_SM86=1`` makes an H200 or H100 pick
the tile a 3090 picks (see :mod:`model.runtime.sm86`).

Measured tiles (bf16 cache, 128-dim index heads): sm_86 keeps 64 rows up to 4 heads, 32 at 8,
16 at 16; sm_90 keeps 64 up to 8 heads and 32 at 16.
"""

from __future__ import annotations

import functools
import inspect
import logging

from model.deployment.indexer_tile_fit import BLOCK_N, DEFAULT_TILE, K_TILES, prefill_tile, refusal

logger = logging.getLogger(__name__)

_PATCHED = "_qwen4exp_tiled_prefill_logits"
_EXPECTED_PARAMETERS = (
    "q",
    "k_cache",
    "page_table",
    "query_start_loc",
    "visible_blocks",
    "logits_workspace",
    "max_query_len",
    "logits_width",
    "query_offset",
    "num_queries",
)


@functools.cache
def _device_facts() -> tuple[int, int]:
    """(shared memory per block, capability as an int like 86) this process's kernels must fit."""
    import torch

    from model.runtime import sm86

    if sm86.forced():
        return sm86.SHARED_MEMORY_PER_BLOCK, 86
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(props.shared_memory_per_block_optin), props.major * 10 + props.minor


@functools.cache
def _tile_for(heads: int, head_dim: int, fp8: bool) -> tuple[int, int, int]:
    shared_limit, capability = _device_facts()
    tile = prefill_tile(heads, head_dim, fp8=fp8, shared_limit=shared_limit, capability=capability)
    if tile is None:  # the start-up check refuses such shapes; reaching this is a bug
        raise RuntimeError(
            refusal(heads, head_dim, fp8=fp8, shared_limit=shared_limit, capability=capability)
        )
    if tile != DEFAULT_TILE[fp8]:
        logger.info(
            "QSA indexer prefill: %d heads x %d dims on a GPU with %d bytes of shared memory per block: "
            "TILE_R=%d (upstream's default %d does not fit)",
            heads, head_dim, shared_limit, tile[0], DEFAULT_TILE[fp8][0],
        )  # fmt: skip
    return tile


def install() -> bool:
    """Replace upstream's indexer prefill launcher with one that sizes the tile for this GPU;
    idempotent. Fails closed if upstream's launcher changed its parameters. Returns whether it
    patched now."""
    import torch
    from vllm.models.qwen4_exp.nvidia.ops import qsa_indexer as ops
    from vllm.triton_utils import triton

    if getattr(ops, _PATCHED, False):
        return False
    found = tuple(inspect.signature(ops._prefill_logits).parameters)
    if found != _EXPECTED_PARAMETERS:
        raise RuntimeError(
            f"vLLM's qsa_indexer._prefill_logits takes {found}, not {_EXPECTED_PARAMETERS}: the indexer "
            "tile choice (model/upstream/indexer_tiles.py) must be re-checked for this vLLM"
        )
    kernel = ops._qsa_mqa_paged_prefill_kernel

    def prefill_logits(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        page_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        visible_blocks: torch.Tensor,
        logits_workspace: torch.Tensor,
        max_query_len: int,
        logits_width: int,
        query_offset: int,
        num_queries: int,
    ) -> torch.Tensor:
        """Upstream's prefill scores for ``num_queries`` rows from ``query_offset``, with our tile."""
        tile_r, stages, warps = _tile_for(q.shape[1], q.shape[2], k_cache.dtype == torch.float8_e4m3fn)
        logits = logits_workspace[: num_queries * logits_width].view(num_queries, logits_width)
        grid = (
            page_table.shape[0],
            triton.cdiv(min(num_queries, max_query_len), tile_r),
            triton.cdiv(logits_width, BLOCK_N * K_TILES),
        )
        kernel[grid](
            q, k_cache, page_table, query_start_loc, visible_blocks, logits,
            *q.stride()[:-1], *k_cache.stride()[:2], *page_table.stride()[:-1], *logits.stride()[:-1],
            num_queries, query_offset, page_table.shape[1],
            PAGE_SIZE=k_cache.shape[1], NUM_HEADS=q.shape[1], HEAD_DIM=q.shape[2],
            TILE_R=tile_r, BLOCK_N=BLOCK_N, K_TILES=K_TILES, STAGES=stages, num_warps=warps,
        )  # fmt: skip
        return logits

    ops._prefill_logits = prefill_logits
    setattr(ops, _PATCHED, True)
    return True
