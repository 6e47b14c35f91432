"""Triton gather kernel for PLE tables, from device memory or from pinned host memory (UVA).

Why a custom kernel: the PLE tables (~45B params) live in pinned host memory, and a torch
``index_select`` cannot read host memory from the GPU. Under unified virtual addressing the
host pointer of a pinned (or ``cudaHostRegister``-ed) buffer is directly dereferenceable by a
kernel, so each looked-up row crosses PCIe exactly once, with no staging copy, and the
dequantization is fused into the same pass.

One kernel covers every format (see ``model.ple.tables`` for the layouts) in two modes:

* dequantize: write ``out[n, :D]`` in ``out``'s float dtype (bf16 normally), computed in fp32 in
  the same association order as ``lookup_ref`` so results are bit-identical;
* raw ("keep storage dtype"): copy the stored bytes unchanged (bf16 rows, fp8 codes, nvfp4 packed
  rows *and* block scales) so an ETP all-reduce can move 1 or ~0.56 bytes per value instead of 2.

Ids are global row ids; rows outside this rank's ``[vocab_start, vocab_start + num_rows)`` come
out as zeros (+0.0 or zero bytes). Each program handles ``BLOCK_R`` rows per step and loops over
row blocks grid-stride, so the grid can be capped (useful when the gather overlaps other work).

Measured on an H200 (PCIe Gen5, 8 GiB pinned table, 256 B rows, CUDA-graph timed; see
``bench/gpu_ple_gather.py``): up to ~2k random rows the gather runs at ~0.9x a contiguous copy
of the same bytes (6.5 us for 512 rows, 15 us for 2,048). Beyond that, rows spread over GiBs
drop to 9-13 GB/s whatever the launch shape, host page size (THP) or launch splitting, while
the same number of rows inside a 64 MiB window still runs at ~50 GB/s: host-side address
translation, not PCIe bandwidth, bounds large random gathers. Row locality is the lever (hence
nvfp4 scales interleaved into each row by the storage), not kernel tuning.

The module imports without error where Triton is missing or has no usable backend (vLLM's CPU
build); call :func:`is_supported` before launching.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:  # pragma: no cover - exercised implicitly by the import
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken backend discovered at import
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

FORMAT_IDS = {"bf16": 0, "fp8_e4m3": 1, "nvfp4": 2}

# Elements of the row processed per inner step; keeps per-program register use bounded for wide
# rows while 128..512-wide PLE rows are done in one step.
_MAX_BLOCK_W = 512


class HostPtr:
    """Pointer-like wrapper for a pinned host tensor, accepted by Triton as a kernel argument.

    Triton refuses CPU ``torch.Tensor`` arguments on the GPU path, but any object with
    ``data_ptr()`` and ``dtype`` is passed as a raw pointer. For pinned/registered memory that
    pointer is valid on the device under unified addressing. Keeps a reference to the tensor so
    the memory outlives the launch object.
    """

    __slots__ = ("tensor", "dtype", "_ptr")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.dtype = tensor.dtype
        self._ptr = tensor.data_ptr()

    def data_ptr(self) -> int:
        return self._ptr


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_supported(device: torch.device | str | int) -> bool:
    """Whether :func:`ple_gather` can run for tensors on ``device``.

    CUDA devices need Triton with a working GPU backend; CPU only works under Triton's
    interpreter (``TRITON_INTERPRET=1`` set before this module was imported), which is what the
    CPU tests use. Never raises.
    """
    if triton is None:
        return False
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cpu":
        return _KERNEL_INTERPRETED
    if dev.type != "cuda" or _KERNEL_INTERPRETED:
        return False
    try:
        if not torch.cuda.is_available():
            return False
        backend = triton.runtime.driver.active.get_current_target().backend
    except Exception:
        return False
    return backend in ("cuda", "hip")


if triton is not None:

    @triton.jit
    def _e4m3_to_f32(b):
        """E4M3 byte -> fp32, exact: re-bias via the fp16 bit layout, then scale by 2**8.

        Works on every GPU generation (no fp8 hardware conversion needed, e.g. sm_86) and in the
        interpreter. NaN codes (0x7F/0xFF) are not handled; quantizers never produce them.
        """
        x = b.to(tl.int32)
        bits = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0

    @triton.jit
    def _e2m1_to_f32(nib):
        """4-bit E2M1 code (int32, bit 3 = sign) -> fp32, exact, same fp16 trick scaled by 2**14."""
        bits = ((nib & 0x8) << 12) | ((nib & 0x7) << 9)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0

    @triton.jit
    def _to_out(f, OUT_BF16: tl.constexpr, out_ty: tl.constexpr):
        """fp32 -> output dtype. bf16 uses an explicit integer round-to-nearest-even.

        Same result as the GPU's ``cvt.rn.bf16.f32`` for finite values, but also exact under
        Triton's interpreter, whose fp32->bf16 cast truncates; that keeps CPU tests bit-exact.
        """
        if OUT_BF16:
            b = f.to(tl.uint32, bitcast=True)
            r = b + 0x7FFF + ((b >> 16) & 1)
            return (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return f.to(out_ty)

    @triton.jit
    def _ple_gather_kernel(
        ids_ptr,
        n_ids,
        vocab_start,
        num_rows,
        data_ptr,
        scales_ptr,
        out_ptr,
        out_scales_ptr,
        global_scale,
        W: tl.constexpr,  # stored row width in elements of data (D, D or D/2)
        S: tl.constexpr,  # block scales per row (nvfp4 only, else 1)
        DATA_STRIDE: tl.constexpr,  # elements between rows of data (>= W)
        SCALE_STRIDE: tl.constexpr,  # bytes between rows of block scales (>= S)
        OUT_W: tl.constexpr,  # output row width in elements
        FMT: tl.constexpr,
        RAW: tl.constexpr,
        OUT_BF16: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_W: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        n_blocks = tl.cdiv(n_ids, BLOCK_R)
        r_off = tl.arange(0, BLOCK_R)
        w_off = tl.arange(0, BLOCK_W)
        for blk in range(pid, n_blocks, nprog):
            rows = blk * BLOCK_R + r_off
            row_ok = rows < n_ids
            gid = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            local = gid - vocab_start
            valid = row_ok & (local >= 0) & (local < num_rows)
            local = tl.where(valid, local, 0)
            src_row = local * DATA_STRIDE  # int64: tables exceed 2**31 elements
            sc_row = local * SCALE_STRIDE
            out_row = rows.to(tl.int64) * OUT_W

            for c0 in tl.static_range(0, W, BLOCK_W):
                cols = c0 + w_off
                col_ok = cols < W
                ld_mask = valid[:, None] & col_ok[None, :]
                st_mask = row_ok[:, None] & col_ok[None, :]
                v = tl.load(data_ptr + src_row[:, None] + cols[None, :], mask=ld_mask, other=0)
                if RAW:
                    tl.store(out_ptr + out_row[:, None] + cols[None, :], v, mask=st_mask)
                elif FMT == 0:
                    tl.store(
                        out_ptr + out_row[:, None] + cols[None, :],
                        v.to(out_ptr.dtype.element_ty),
                        mask=st_mask,
                    )
                elif FMT == 1:
                    f = _e4m3_to_f32(v) * global_scale
                    tl.store(
                        out_ptr + out_row[:, None] + cols[None, :],
                        _to_out(f, OUT_BF16, out_ptr.dtype.element_ty),
                        mask=st_mask,
                    )
                else:
                    # nvfp4: byte j holds values 2j (low nibble) and 2j+1; block scale j // 8.
                    sc_cols = cols // 8
                    sc = tl.load(
                        scales_ptr + sc_row[:, None] + sc_cols[None, :],
                        mask=ld_mask,
                        other=0,
                    )
                    scf = _e4m3_to_f32(sc)
                    x = v.to(tl.int32)
                    lo = (_e2m1_to_f32(x & 0xF) * scf) * global_scale
                    hi = (_e2m1_to_f32(x >> 4) * scf) * global_scale
                    vals = _to_out(tl.interleave(lo, hi), OUT_BF16, out_ptr.dtype.element_ty)
                    ocols = 2 * c0 + tl.arange(0, 2 * BLOCK_W)
                    o_mask = row_ok[:, None] & (ocols < OUT_W)[None, :]
                    tl.store(out_ptr + out_row[:, None] + ocols[None, :], vals, mask=o_mask)

            if RAW and FMT == 2:
                s_off = tl.arange(0, BLOCK_S)
                s_ok = s_off < S
                sc_raw = tl.load(
                    scales_ptr + sc_row[:, None] + s_off[None, :],
                    mask=valid[:, None] & s_ok[None, :],
                    other=0,
                )
                tl.store(
                    out_scales_ptr + (rows.to(tl.int64) * S)[:, None] + s_off[None, :],
                    sc_raw,
                    mask=row_ok[:, None] & s_ok[None, :],
                )


_KERNEL_INTERPRETED = triton is not None and type(_ple_gather_kernel).__name__ == "InterpretedFunction"

# The compiled kernel of the latest launch (Triton's CompiledKernel; None when interpreted), kept so
# benchmarks can inspect the generated PTX (e.g. that row loads are 16-byte vectors).
_LAST_KERNEL: Any = None


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_launch_config(fmt: str, dim: int, raw: bool) -> tuple[int, int]:
    """``(rows_per_program, num_warps)`` heuristic: about 4 KiB per program step.

    Gathers over PCIe are latency bound; several rows per program keeps many independent
    16-byte requests in flight per warp, while programs stay small enough that decode-sized
    batches still spread over all SMs. The 4 KiB counts the larger of the bytes read and the
    bytes written (dequantized rows are wider), which bounds registers per thread.
    """
    row_bytes = {"bf16": 2 * dim, "fp8_e4m3": dim, "nvfp4": dim // 2 + dim // 16}[fmt]
    out_bytes = row_bytes if raw else 2 * dim
    rows = max(1, min(64, _next_pow2(max(1, 4096 // max(1, row_bytes, out_bytes)))))
    return rows, 4


def _as_kernel_arg(t: torch.Tensor, on_gpu: bool) -> Any:
    if on_gpu and t.device.type == "cpu":
        return HostPtr(t)
    return t


def ple_gather(
    fmt: str,
    data: torch.Tensor,
    ids: torch.Tensor,
    vocab_start: int,
    out: torch.Tensor,
    *,
    block_scales: torch.Tensor | None = None,
    global_scale: float = 1.0,
    raw: bool = False,
    out_scales: torch.Tensor | None = None,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    max_programs: int | None = None,
    max_rows_per_launch: int | None = None,
    assume_pinned: bool = False,
) -> torch.Tensor:
    """Gather rows ``ids`` (global int64 ids, any shape) of one table shard into ``out``.

    ``data``/``block_scales`` hold rows ``[vocab_start, vocab_start + data.shape[0])`` and may be
    on the GPU or in pinned host memory (read through UVA). ``out`` is ``[..., D]`` of a float
    dtype (dequantize mode) or ``[..., W]`` of ``data.dtype`` (``raw=True``; nvfp4 also needs
    ``out_scales`` ``[..., D/16]`` uint8). Nothing is allocated when ``ids`` is contiguous int64,
    so the call is safe inside CUDA-graph capture. Returns ``out``.

    ``data``/``block_scales`` may be row-strided views (e.g. nvfp4 packed bytes and scales
    interleaved in one ``[rows, D/2 + D/16]`` buffer, so each row is one host access).
    ``max_rows_per_launch`` splits a large batch into consecutive launches over slices (views,
    no allocation). Host tensors must be pinned or host-registered; ``assume_pinned`` skips that
    (per-call, ~microseconds) check when the caller verified it once at allocation.
    """
    if triton is None:
        raise RuntimeError("Triton is not available")
    if fmt not in FORMAT_IDS:
        raise ValueError(f"unknown PLE format {fmt!r}")
    if data.dim() != 2 or data.stride(1) != 1 or data.stride(0) < data.shape[1]:
        raise ValueError("data must be a row-major [rows, width] tensor (unit column stride)")
    num_rows, width = data.shape
    if fmt == "nvfp4":
        if (
            block_scales is None
            or block_scales.shape != (num_rows, width // 8)
            or block_scales.dtype != torch.uint8
            or block_scales.stride(1) != 1
            or block_scales.stride(0) < width // 8
        ):
            raise ValueError("nvfp4 needs row-major uint8 block_scales [rows, D/16]")
        dim, n_scales = 2 * width, width // 8
        scale_stride = block_scales.stride(0)
    else:
        dim, n_scales, scale_stride = width, 1, 1
    out_w = width if raw else dim
    if out.shape[-1] != out_w or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [..., {out_w}], got {list(out.shape)}")
    if raw and out.dtype != data.dtype:
        raise ValueError(f"raw mode writes {data.dtype}, out is {out.dtype}")
    if not raw and not out.dtype.is_floating_point:
        raise ValueError("dequantize mode needs a floating-point out")
    n = ids.numel()
    if out.numel() != n * out_w:
        raise ValueError(f"out holds {out.numel() // max(out_w, 1)} rows, ids has {n}")
    if (
        raw
        and fmt == "nvfp4"
        and (
            out_scales is None
            or out_scales.numel() != n * n_scales
            or out_scales.dtype != torch.uint8
            or not out_scales.is_contiguous()
        )
    ):
        raise ValueError("raw nvfp4 needs a contiguous uint8 out_scales [..., D/16]")

    on_gpu = out.device.type == "cuda"
    if on_gpu == _KERNEL_INTERPRETED:
        raise RuntimeError(
            f"ple_gather kernel is {'interpreted' if _KERNEL_INTERPRETED else 'compiled'}; "
            f"cannot run on {out.device}"
        )
    if on_gpu:
        if ids.device != out.device:
            raise ValueError("ids must be on the output device")
        if not assume_pinned:
            for t in (data, block_scales):
                if t is not None and t.device.type == "cpu" and not t.is_pinned():
                    raise ValueError("host table tensors must be pinned for UVA access")
    if n == 0:
        return out
    ids_flat = ids.reshape(-1)
    if ids_flat.dtype != torch.int64 or not ids_flat.is_contiguous():
        ids_flat = ids_flat.to(torch.int64).contiguous()

    d_rows, d_warps = default_launch_config(fmt, dim, raw)
    block_r = _next_pow2(rows_per_program or d_rows)
    warps = num_warps or d_warps
    block_w = min(_next_pow2(width), _MAX_BLOCK_W)
    data_arg = _as_kernel_arg(data, on_gpu)
    scales_arg = _as_kernel_arg(block_scales if block_scales is not None else data, on_gpu)
    out2 = out.view(n, out_w)
    out_s2 = out_scales.view(n, n_scales) if out_scales is not None else None
    step = n if not max_rows_per_launch else max(1, int(max_rows_per_launch))
    global _LAST_KERNEL
    for a in range(0, n, step):
        m = min(step, n - a)
        n_blocks = triton.cdiv(m, block_r)
        grid = (max(1, min(n_blocks, max_programs)) if max_programs else n_blocks,)
        _LAST_KERNEL = _ple_gather_kernel[grid](
            ids_flat[a : a + m],
            m,
            int(vocab_start),
            num_rows,
            data_arg,
            scales_arg,
            out2[a : a + m],
            out_s2[a : a + m] if out_s2 is not None else out2,
            float(global_scale),
            W=width,
            S=n_scales,
            DATA_STRIDE=data.stride(0),
            SCALE_STRIDE=scale_stride,
            OUT_W=out_w,
            FMT=FORMAT_IDS[fmt],
            RAW=raw,
            OUT_BF16=out.dtype == torch.bfloat16,
            BLOCK_R=block_r,
            BLOCK_W=block_w,
            BLOCK_S=_next_pow2(n_scales),
            num_warps=warps,
        )
    return out
