"""Which query tile of upstream's QSA indexer prefill kernel fits a GPU's shared memory: arithmetic only.

Why here, apart from the launcher that uses it (:mod:`model.upstream.indexer_tiles`): whether any
tile fits decides whether upstream can serve a checkpoint on a GPU at all, and that decision is
made by :mod:`model.deployment.implementation` in the service before vLLM starts, with no GPU
kernel imported. The bound for the key tiles covers what Triton compiled for this kernel on sm_86
and sm_90 (checked by ``tests/kernels/test_sm86_compile.py``).
"""

from __future__ import annotations

# Query rows per program, largest first; upstream's defaults are 64 (bf16) and 32 (fp8).
TILE_ROWS = (64, 32, 16, 8, 4, 2, 1)
DEFAULT_TILE = {False: (64, 2, 4), True: (32, 2, 8)}  # fp8 cache? -> (TILE_R, STAGES, num_warps)
BLOCK_N = 64  # key columns per step, as upstream
K_TILES = 16
# Shared bytes beyond the query tile (key tiles, pipelining, reductions), the largest Triton reported
# for this kernel over 1-16 heads of 128 at BLOCK_N=64, two stages: 32,768 on sm_86, 40,960 on sm_90.
KEY_TILE_BYTES = {86: 32768, 90: 40960}
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows: TILE_R x padded heads


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def shared_bytes_bound(tile_r: int, heads: int, head_dim: int, elt_bytes: int, capability: int) -> int:
    """Shared memory the prefill kernel needs per block, never below what Triton allocates for it."""
    padded_dim = max(16, _pow2(head_dim))
    key_bytes = KEY_TILE_BYTES[90] if capability >= 90 else KEY_TILE_BYTES[86]
    key_bytes *= max(1, padded_dim // 128)  # the key tiles grow with the head dim
    return tile_r * _pow2(heads) * padded_dim * elt_bytes + key_bytes


def prefill_tile(
    heads: int, head_dim: int, *, fp8: bool, shared_limit: int, capability: int
) -> tuple[int, int, int] | None:
    """``(TILE_R, STAGES, num_warps)`` for this indexer shape on this GPU, or None if no tile fits.

    Starts at upstream's tuned tile and halves ``TILE_R`` until the kernel fits ``shared_limit``;
    stages and warps stay upstream's."""
    default_rows, stages, warps = DEFAULT_TILE[fp8]
    elt = 1 if fp8 else 2
    for rows in TILE_ROWS:
        if rows > default_rows or rows * _pow2(heads) < MIN_DOT_ROWS:
            continue
        if shared_bytes_bound(rows, heads, head_dim, elt, capability) <= shared_limit:
            return rows, stages, warps
    return None


def refusal(heads: int, head_dim: int, *, fp8: bool, shared_limit: int, capability: int) -> str | None:
    """Why upstream's indexer prefill cannot run at all on this GPU (None: some tile fits)."""
    if prefill_tile(heads, head_dim, fp8=fp8, shared_limit=shared_limit, capability=capability):
        return None
    smallest = min(r for r in TILE_ROWS if r * _pow2(heads) >= MIN_DOT_ROWS)
    need = shared_bytes_bound(smallest, heads, head_dim, 1 if fp8 else 2, capability)
    return (
        f"indexer_n_heads={heads} x indexer_head_dim={head_dim}: upstream's QSA indexer prefill kernel "
        f"needs {need:,} bytes of shared memory even with {smallest} query rows per program; this GPU "
        f"allows {shared_limit:,}"
    )
