"""The QSA indexer prefill tile our subclass picks for upstream's kernel (pure arithmetic; the
compiled sizes are checked by tests/kernels/test_sm86_compile.py)."""

from __future__ import annotations

import pytest

from model.deployment import indexer_tile_fit as tiles

RTX_3090, H200 = 101376, 232448
# Shared bytes Triton reported for upstream's bf16 prefill kernel (128-dim heads, 2 stages, 64 key
# columns) at (heads, TILE_R): sm_86 and sm_90.
COMPILED = {
    86: {(1, 64): 49152, (2, 64): 65536, (4, 64): 90112, (8, 64): 155648, (8, 32): 90112,
         (16, 64): 286720, (16, 32): 155648, (16, 16): 86016},
    90: {(1, 64): 57344, (2, 64): 73728, (4, 64): 106496, (8, 64): 172032, (16, 64): 303104,
         (16, 32): 172032},
}  # fmt: skip


@pytest.mark.parametrize("cap", sorted(COMPILED))
def test_the_bound_is_never_below_the_compiled_kernel(cap):
    for (heads, rows), compiled in COMPILED[cap].items():
        assert tiles.shared_bytes_bound(rows, heads, 128, 2, cap) >= compiled, (cap, heads, rows)


def test_tiles_for_a_3090_and_an_h200():
    def pick(heads, limit, cap):
        return tiles.prefill_tile(heads, 128, fp8=False, shared_limit=limit, capability=cap)

    assert [pick(h, RTX_3090, 86)[0] for h in (1, 2, 4, 8, 16, 32, 64)] == [64, 64, 64, 32, 16, 8, 4]
    assert [pick(h, H200, 90)[0] for h in (1, 2, 4, 8, 16)] == [64, 64, 64, 64, 32]
    # Every chosen tile fits by the compiled sizes where they are known.
    for (heads, rows), compiled in COMPILED[86].items():
        if rows == pick(heads, RTX_3090, 86)[0]:
            assert compiled <= RTX_3090
    # Stages and warps stay upstream's; FP8 starts from its own default (32 rows, 8 warps).
    assert pick(16, RTX_3090, 86)[1:] == (2, 4)
    assert tiles.prefill_tile(16, 128, fp8=True, shared_limit=H200, capability=90) == (32, 2, 8)


def test_one_head_keeps_enough_rows_for_the_dot_and_an_impossible_shape_is_refused():
    assert tiles.prefill_tile(1, 128, fp8=False, shared_limit=30000, capability=86) is None  # 16 rows needed
    why = tiles.refusal(16, 1024, fp8=False, shared_limit=RTX_3090, capability=86)
    assert why.startswith("indexer_n_heads=16 x indexer_head_dim=1024") and "1 query rows" in why
    assert tiles.refusal(16, 128, fp8=False, shared_limit=RTX_3090, capability=86) is None
