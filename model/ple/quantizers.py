"""Offline quantizers of PLE tables (checkpoint conversion and tests): bf16 rows -> fp8 / nvfp4.

Why apart from ``tables``: serving only decodes; encoding (global scales from a whole
table's absmax, nearest-value rounding, chunked so a multi-GiB shard needs no fp32 copy of
itself) is needed by ``model.tools.ple_quantize`` and the tests only.
"""

from __future__ import annotations

import torch

from model.ple.codes import E2M1_MAX, E2M1_MIDPOINTS, E4M3_MAX, NVFP4_BLOCK, decode_e4m3, fp32_exact

# Rows processed per chunk by the quantizers, so converting a multi-GiB shard does not need
# several fp32 copies of it at once.
_QUANT_CHUNK_ROWS = 1 << 16


def _encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 codes (uint8), saturating at +-448 so no NaN codes are ever produced."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _global_amax(w: torch.Tensor) -> float:
    amax = 0.0
    for r0 in range(0, w.shape[0], _QUANT_CHUNK_ROWS):
        chunk = w[r0 : r0 + _QUANT_CHUNK_ROWS]
        if chunk.numel():
            amax = max(amax, float(chunk.abs().max().float().item()))
    if amax != amax or amax in (float("inf"), float("-inf")):
        raise ValueError("table contains NaN/inf")
    return amax


def fp8_global_scale(amax: float) -> float:
    """The fp32 global scale that maps a table absmax of ``amax`` to E4M3's 448 (1.0 for all-zero)."""
    scale = fp32_exact(amax / E4M3_MAX) if amax > 0 else 1.0
    if scale == 0.0:  # amax is tiny enough that amax/448 underflows fp32
        scale = fp32_exact(float.fromhex("0x1p-149"))
    return scale


def nvfp4_global_scale(amax: float) -> float:
    """The fp32 global scale that maps a table absmax to ``448 * 6`` (E4M3 block scale x E2M1 max)."""
    scale = fp32_exact(amax / (E4M3_MAX * E2M1_MAX)) if amax > 0 else 1.0
    if scale == 0.0:
        scale = fp32_exact(float.fromhex("0x1p-149"))
    return scale


def table_amax(parts) -> float:
    """Absmax over several ``[rows, D]`` pieces of one table (e.g. its checkpoint shards).

    Why: a PLE table has ONE global scale, but checkpoints split it into ``split_ngram_parts``
    shards; converting shard by shard needs the whole table's absmax first.
    """
    return max((_global_amax(p) for p in parts), default=0.0)


def _check_given_scale(global_scale: float) -> float:
    gs = fp32_exact(global_scale)
    if not (gs > 0.0 and gs != float("inf")):
        raise ValueError(f"global scale must be a finite positive fp32 value, got {global_scale}")
    return gs


def quantize_fp8_rows(w_bf16: torch.Tensor, global_scale: float | None = None) -> tuple[torch.Tensor, float]:
    """``[V, D]`` float -> ``(uint8 E4M3 codes [V, D], fp32 global scale)``.

    One per-tensor scale maps the table's absmax to 448; rounding is torch's round-to-nearest-even
    cast to float8_e4m3fn. An all-zero table gets scale 1.0. ``global_scale`` overrides the
    scale (values beyond ``448 * scale`` saturate): used to quantize the shards of one table with
    the scale of the whole table.
    """
    if w_bf16.dim() != 2:
        raise ValueError("expected a 2-D [rows, dim] tensor")
    if global_scale is None:
        scale = fp8_global_scale(_global_amax(w_bf16))
    else:
        scale = _check_given_scale(global_scale)
    scale_t = torch.tensor(scale, dtype=torch.float32)
    codes = torch.empty(w_bf16.shape, dtype=torch.uint8, device=w_bf16.device)
    for r0 in range(0, w_bf16.shape[0], _QUANT_CHUNK_ROWS):
        chunk = w_bf16[r0 : r0 + _QUANT_CHUNK_ROWS].float()
        codes[r0 : r0 + _QUANT_CHUNK_ROWS] = _encode_e4m3(chunk / scale_t)
    return codes, scale


def _encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already divided by its scale) -> 4-bit codes, nearest magnitude, sign in bit 3.

    Zero magnitudes never carry the sign bit, so the quantizer never emits -0 (code 8).
    """
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = torch.bucketize(x.abs().clamp(max=E2M1_MAX), mids).to(torch.uint8)
    sign = ((x < 0) & (mag != 0)).to(torch.uint8) << 3
    return mag | sign


def quantize_nvfp4_rows(
    w_bf16: torch.Tensor, global_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``[V, D]`` float -> ``(packed uint8 [V, D/2], E4M3 block scales uint8 [V, D/16], fp32 scale)``.

    Two-level scaling as in NVIDIA's NVFP4: the global scale maps the table absmax to
    ``448 * 6`` so block scales use E4M3's full range; each block of 16 values gets the E4M3 scale
    nearest to ``block_amax / 6 / global``, and values are rounded to the nearest E2M1 magnitude
    after dividing by the *decoded* block scale (so quantization error is measured against what
    the kernel will actually reconstruct). ``global_scale`` overrides the table-level scale (to
    quantize every checkpoint shard of one table with the whole table's scale).
    """
    if w_bf16.dim() != 2:
        raise ValueError("expected a 2-D [rows, dim] tensor")
    rows, dim = w_bf16.shape
    if dim % NVFP4_BLOCK != 0:
        raise ValueError(f"nvfp4 needs dim divisible by {NVFP4_BLOCK}, got {dim}")
    if global_scale is None:
        gscale = nvfp4_global_scale(_global_amax(w_bf16))
    else:
        gscale = _check_given_scale(global_scale)
    packed = torch.empty((rows, dim // 2), dtype=torch.uint8, device=w_bf16.device)
    scales = torch.empty((rows, dim // NVFP4_BLOCK), dtype=torch.uint8, device=w_bf16.device)
    min_sub = float.fromhex("0x1p-9")  # smallest positive E4M3 subnormal
    for r0 in range(0, rows, _QUANT_CHUNK_ROWS):
        x = w_bf16[r0 : r0 + _QUANT_CHUNK_ROWS].float()
        n = x.shape[0]
        blocks = x.reshape(n, dim // NVFP4_BLOCK, NVFP4_BLOCK)
        bamax = blocks.abs().amax(dim=-1)
        want = bamax / (E2M1_MAX * gscale)
        # A non-zero block must not get a zero scale (it would vanish entirely).
        want = torch.where(bamax > 0, want.clamp(min=min_sub), torch.zeros_like(want))
        s_codes = _encode_e4m3(want)
        s_vals = decode_e4m3(s_codes) * gscale  # effective per-block scale, fp32
        denom = torch.where(s_vals > 0, s_vals, torch.ones_like(s_vals))
        q = _encode_e2m1(blocks / denom[..., None]).reshape(n, dim)
        q = torch.where(s_vals.repeat_interleave(NVFP4_BLOCK, dim=-1) > 0, q, torch.zeros_like(q))
        packed[r0 : r0 + n] = q[:, 0::2] | (q[:, 1::2] << 4)
        scales[r0 : r0 + n] = s_codes
    return packed, scales, gscale
