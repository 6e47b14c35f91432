"""Triton kernel: sparse paged GQA attention for QSA layers, with BF16 or FP8 (as bytes) KV cache.

Every query token attends to its own list of selected positions (the QSA indexer's choice), read
from vLLM-style paged K/V caches ``[num_blocks, block_size, Hkv, D]``. One program handles one
query token x one KV head x one split of the selection, and computes all ``Hq / Hkv`` query heads
of that group at once, so each gathered K/V row is read once per group and the GQA group becomes
the M dimension of a ``tl.dot`` (padded to 16 rows).

FP8 caches hold ``uint8`` codes. The target GPU (RTX 3090, sm_86) has no FP8 support and Triton
rejects ``tl.float8*`` there, so codes are widened with integer bit moves to an FP16 pattern that
equals ``value * 2**-8`` (E4M3; see ``model.ops.fp8_e4m3``) or ``value`` (E5M2). The ``2**8`` is
folded, together with ``k_scale``, into the logit scale and, with ``v_scale``, into the epilogue,
so decoding costs no float multiply. With an FP8 cache both MMAs run in FP16 (q is cast to FP16, so
|q| must stay below 65504; P is rounded to FP16); with a BF16 cache they run in BF16 (an fp32 q is
cast to BF16). ``model.ops.qsa_sparse_attention.sparse_paged_attention_ref`` is the specification.

Split-K (``num_splits > 1``) divides each token's selection into contiguous chunks whose partial
``(max, sum, acc)`` a second kernel merges; it keeps the GPU busy when a decode batch has few
tokens. Addresses are computed in int64, because ``page * block stride`` overflows int32 in large
caches.

Importing this module never fails: Triton is imported defensively and the kernels are defined only
when it imports. ``is_supported`` tells callers whether the GPU path may be used.
"""

from __future__ import annotations

import math
from typing import Any

import torch

try:  # vLLM's CPU build ships a Triton without a GPU backend; a missing Triton is tolerated too.
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

KV_FORMATS = {"bf16": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}
_E4M3_FP16_SHIFT = 8  # the FP16 read of the shifted E4M3 bits is value * 2**-8
_LOG2E = 1.4426950408889634
MIN_CAPABILITY = (8, 6)


def _interpreting() -> bool:
    """Whether the kernels were decorated under ``TRITON_INTERPRET=1`` (decided at import time)."""
    return triton is not None and type(_sparse_attn_kernel).__name__ == "InterpretedFunction"


def is_supported(device: torch.device | str | int | None = None) -> tuple[bool, str]:
    """Whether the Triton kernel can run on ``device``, and why not.

    True only for CUDA devices of compute capability >= 8.6 with an importable Triton. (The CPU
    tests run the kernel through ``TRITON_INTERPRET=1``, which is a test harness, not a backend:
    this function still answers False for the CPU.)
    """
    if triton is None:
        return False, f"triton is not importable ({_TRITON_IMPORT_ERROR})"
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    if dev.type != "cuda":
        return False, f"device {dev} is not a CUDA device; the QSA Triton kernel needs CUDA sm_86+"
    if not torch.cuda.is_available():
        return False, "torch.cuda is not available (CPU-only torch build or no GPU visible)"
    cap = torch.cuda.get_device_capability(dev)
    if cap < MIN_CAPABILITY:
        return False, f"compute capability {cap[0]}.{cap[1]} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    return True, f"CUDA compute capability {cap[0]}.{cap[1]}"


if triton is not None:

    @triton.jit
    def e4m3_to_fp16_scaled(b):
        """FP16 equal to E4M3 code ``b`` (uint8) times 2**-8, by integer bit moves only."""
        x = b.to(tl.uint16)
        bits = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True)

    @triton.jit
    def e5m2_to_fp16(b):
        """FP16 equal to E5M2 code ``b`` (uint8): the code is FP16's high byte."""
        return (b.to(tl.uint16) << 8).to(tl.float16, bitcast=True)

    @triton.jit
    def _decode_tile(raw, KV_FORMAT: tl.constexpr, COMPUTE: tl.constexpr):
        if KV_FORMAT == 1:
            return e4m3_to_fp16_scaled(raw)
        elif KV_FORMAT == 2:
            return e5m2_to_fp16(raw)
        else:
            return raw.to(COMPUTE)

    @triton.jit
    def _mma(a, b, FP32_DOT: tl.constexpr):
        """``a @ b`` with fp32 accumulation; ``FP32_DOT`` widens the operands and asks for exact fp32.

        Used for fp32 caches (no TF32 rounding), and for bf16 under ``TRITON_INTERPRET=1``, whose
        ``tl.dot`` multiplies bf16 bit patterns as integers (triton-lang/triton#11584). bf16 products
        are exact in fp32, so the widened dot only differs from the tensor-core one by summation order.
        """
        if FP32_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _decode_e4m3_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        """Standalone E4M3 -> fp32 decode through the kernel's helper (used by GPU validation)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        b = tl.load(src_ptr + offs, mask=mask, other=0)
        val = e4m3_to_fp16_scaled(b).to(tl.float32) * 256.0
        tl.store(dst_ptr + offs, val, mask=mask)

    @triton.jit
    def _sparse_attn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        req_ptr,
        sel_ptr,
        nsel_ptr,
        out_ptr,
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        k_scale_ptr,
        v_scale_ptr,
        qk_scale,
        out_scale,
        width,
        block_size,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        stride_sel,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        KV_FORMAT: tl.constexpr,
        COMPUTE: tl.constexpr,
        K_SCALE_FROM_PTR: tl.constexpr,
        V_SCALE_FROM_PTR: tl.constexpr,
        FP32_DOT: tl.constexpr,
    ):
        tok = tl.program_id(0)
        hkv = tl.program_id(1)
        split = tl.program_id(2)
        tok64 = tok.to(tl.int64)
        hkv64 = hkv.to(tl.int64)

        n_sel = tl.minimum(tl.load(nsel_ptr + tok64), width)
        req = tl.load(req_ptr + tok64).to(tl.int64)
        chunk = tl.cdiv(n_sel, NUM_SPLITS)
        start = split * chunk
        end = tl.minimum(start + chunk, n_sel)

        if K_SCALE_FROM_PTR:
            qk_scale = qk_scale * tl.load(k_scale_ptr).to(tl.float32)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        heads = hkv64 * GROUP + offs_g
        q = tl.load(
            q_ptr + tok64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None],
            other=0.0,
        ).to(COMPUTE)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        sel_row = sel_ptr + tok64 * stride_sel
        bt_row = bt_ptr + req * stride_bt
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n
            n_mask = n < end
            pos = tl.load(sel_row + n, mask=n_mask, other=-1)
            valid = n_mask & (pos >= 0)
            pos = tl.where(valid, pos, 0)
            page = tl.load(bt_row + pos // block_size, mask=valid, other=0).to(tl.int64)
            slot = (pos % block_size).to(tl.int64)

            k_rows = page * stride_kb + slot * stride_ks + hkv64 * stride_kh
            k_raw = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
            k = _decode_tile(k_raw, KV_FORMAT, COMPUTE)
            s = _mma(q, tl.trans(k), FP32_DOT)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)

            v_rows = page * stride_vb + slot * stride_vs + hkv64 * stride_vh
            v_raw = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
            v = _decode_tile(v_raw, KV_FORMAT, COMPUTE)
            pv = _mma(p.to(COMPUTE), v, FP32_DOT)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if NUM_SPLITS == 1:
            if V_SCALE_FROM_PTR:
                out_scale = out_scale * tl.load(v_scale_ptr).to(tl.float32)
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            o = acc * (out_scale / l_safe)[:, None]
            tl.store(
                out_ptr + tok64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=g_mask[:, None],
            )
        else:
            # Partials laid out [T, Hq, NUM_SPLITS] and [T, Hq, NUM_SPLITS, D], contiguous.
            row = (tok64 * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
            tl.store(part_m_ptr + row, m_i, mask=g_mask)
            tl.store(part_l_ptr + row, l_i, mask=g_mask)
            tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])

    @triton.jit
    def _merge_splits_kernel(
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        out_ptr,
        v_scale_ptr,
        out_scale,
        num_q_heads,
        stride_ot,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        V_SCALE_FROM_PTR: tl.constexpr,
    ):
        tok64 = tl.program_id(0).to(tl.int64)
        head64 = tl.program_id(1).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, HEAD_DIM)
        s_mask = offs_s < NUM_SPLITS
        base = (tok64 * num_q_heads + head64) * NUM_SPLITS
        m = tl.load(part_m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
        l_s = tl.load(part_l_ptr + base + offs_s, mask=s_mask, other=0.0)
        acc = tl.load(
            part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None],
            other=0.0,
        )
        m_max = tl.max(m, axis=0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_safe)
        l_tot = tl.sum(w * l_s, axis=0)
        o = tl.sum(acc * w[:, None], axis=0)
        if V_SCALE_FROM_PTR:
            out_scale = out_scale * tl.load(v_scale_ptr).to(tl.float32)
        l_safe = tl.where(l_tot > 0.0, l_tot, 1.0)
        o = o * (out_scale / l_safe)
        tl.store(out_ptr + tok64 * stride_ot + head64 * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


_LAST_LAUNCH: dict[str, Any] = {}


def last_launch_info() -> dict[str, Any]:
    """Tile configuration, shared memory, registers and spills of the last main-kernel launch.

    For benchmarks and tuning: shared memory must stay under 99 KB per block on sm_86, whatever
    a larger GPU used for measuring would allow.
    """
    info = {k: v for k, v in _LAST_LAUNCH.items() if k != "compiled"}
    compiled = _LAST_LAUNCH.get("compiled")
    metadata = getattr(compiled, "metadata", None)
    info["shared_bytes"] = getattr(metadata, "shared", None)
    info["n_regs"] = getattr(compiled, "n_regs", None)
    info["n_spills"] = getattr(compiled, "n_spills", None)
    return info


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def default_num_splits(
    num_tokens: int, num_kv_heads: int, width: int, block_n: int, device: torch.device
) -> int:
    """Split count that gives about two programs per SM without splits shorter than two tiles.

    Decode batches have few tokens, so without splitting most SMs would idle; prefill batches
    already fill the GPU and splitting would only add the merge pass.
    """
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    programs = max(1, num_tokens * num_kv_heads)
    want = math.ceil(2 * sms / programs)
    most = max(1, width // (2 * block_n))
    return int(max(1, min(want, most, 64)))


def _scale_arg(scale: float | torch.Tensor, dummy: torch.Tensor) -> tuple[float, torch.Tensor, bool]:
    """A float scale goes in as an argument; a tensor scale is read by the kernel (no host sync).

    Returns ``(host factor, pointer argument, read-from-pointer flag)``.
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError("k_scale / v_scale tensors must hold a single element")
        return 1.0, scale.reshape(1).to(dummy.device), True
    return float(scale), dummy, False


def _default_block_n(head_dim: int) -> int:
    # 99 KB of shared memory per block on sm_86: two pipeline stages of K and V tiles must fit.
    return 64 if head_dim <= 128 else 32


def sparse_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_req_idx: torch.Tensor,
    selected: torch.Tensor,
    num_selected: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    num_splits: int | None = 1,
    kv_format: str | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Sparse paged GQA attention; same contract as ``sparse_paged_attention_ref``.

    ``kv_format``: ``"bf16"`` (any unquantised float cache: bf16, fp16 or fp32), ``"fp8_e4m3"`` or
    ``"fp8_e5m2"`` (``uint8`` codes); ``None`` infers E4M3 for ``uint8`` and ``"bf16"`` otherwise.
    ``num_splits``: split-K factor (1 = none, ``None`` = pick from the SM count). ``k_scale`` and
    ``v_scale`` may be floats or one-element device tensors (read in-kernel, CUDA-graph safe).
    ``block_n``/``num_warps``/``num_stages`` override the tile configuration.
    """
    if triton is None:
        raise RuntimeError(f"triton is not importable: {_TRITON_IMPORT_ERROR}")
    if q.device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"QSA Triton kernel needs a CUDA device (or TRITON_INTERPRET=1), got {q.device}")
    if kv_format is None:
        kv_format = "fp8_e4m3" if k_cache.dtype == torch.uint8 else "bf16"
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {sorted(KV_FORMATS)}, got {kv_format!r}")
    fmt = KV_FORMATS[kv_format]
    if (fmt != 0) != (k_cache.dtype == torch.uint8) or k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"kv_format {kv_format!r} does not match cache dtypes {k_cache.dtype}/{v_cache.dtype}"
        )

    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit q {tuple(q.shape)}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dimension")
    group = num_q_heads // num_kv_heads

    block_table = block_table.to(torch.int32).contiguous()
    token_req_idx = token_req_idx.to(torch.int32).contiguous()
    selected = selected.to(torch.int32).contiguous()
    num_selected = num_selected.to(torch.int32).contiguous()
    width = selected.shape[1]

    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out

    if fmt == 0:
        compute = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(k_cache.dtype, tl.float32)
    else:
        compute = tl.float16
    fp32_dot = compute == tl.float32 or (compute == tl.bfloat16 and _interpreting())
    shift = float(2**_E4M3_FP16_SHIFT) if fmt == 1 else 1.0

    block_n = block_n or _default_block_n(head_dim)
    if num_splits is None:
        num_splits = default_num_splits(num_tokens, num_kv_heads, width, block_n, q.device)
    num_splits = max(1, int(num_splits))
    # Not tuned for sm_86 yet. On an H200 (decode T=64, D=256, 2051 keys, bs 16) 4 warps beat 8 for
    # BF16 (100 vs 154 us), and for E4M3 BLOCK_N=16 / 4 warps / 3 stages was best (146 vs 170 us).
    num_warps = num_warps or (4 if head_dim <= 128 else 8)
    num_stages = num_stages or 2

    k_val, k_scale_t, k_from_ptr = _scale_arg(k_scale, q)
    v_val, v_scale_t, v_from_ptr = _scale_arg(v_scale, q)
    qk_scale = float(scale) * k_val * shift * _LOG2E
    out_scale = v_val * shift

    if num_splits > 1:
        part_m = torch.empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
    else:
        part_m = part_l = part_acc = out  # unused placeholders

    launch: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = _sparse_attn_kernel[(num_tokens, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        token_req_idx,
        selected,
        num_selected,
        out,
        part_m,
        part_l,
        part_acc,
        k_scale_t,
        v_scale_t,
        qk_scale,
        out_scale,
        width,
        block_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        selected.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        KV_FORMAT=fmt,
        COMPUTE=compute,
        K_SCALE_FROM_PTR=k_from_ptr,
        V_SCALE_FROM_PTR=v_from_ptr,
        FP32_DOT=fp32_dot,
        **launch,
    )
    _LAST_LAUNCH.update(
        block_n=block_n, num_warps=num_warps, num_stages=num_stages, num_splits=num_splits, compiled=compiled
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            v_scale_t,
            out_scale,
            num_q_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=_next_pow2(num_splits),
            V_SCALE_FROM_PTR=v_from_ptr,
            num_warps=4,
        )
    return out


def decode_e4m3_triton(codes: torch.Tensor) -> torch.Tensor:
    """Decode ``uint8`` E4M3 codes to fp32 with the kernel's own helper (for bit-exactness checks)."""
    if triton is None:
        raise RuntimeError(f"triton is not importable: {_TRITON_IMPORT_ERROR}")
    flat = codes.contiguous().view(-1)
    dst = torch.empty(flat.shape, dtype=torch.float32, device=codes.device)
    block = 1024
    _decode_e4m3_kernel[(triton.cdiv(flat.numel(), block),)](flat, dst, flat.numel(), BLOCK=block)
    return dst.view(codes.shape)
