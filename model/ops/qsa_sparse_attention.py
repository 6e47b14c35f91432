"""Plain-torch reference for sparse paged GQA attention of QSA layers.

Each query token attends only to the token positions its indexer selected, read from a paged KV
cache. This is the specification the Triton kernel (``model.kernels.qsa_sparse_attention``) is
tested against; it is written for clarity and vectorisation (one gather, one masked softmax), not
for memory efficiency: it materialises ``[T, S, Hkv, D]`` K and V.
"""

from __future__ import annotations

import torch

from .fp8_e4m3 import decode_e4m3, decode_e5m2


def _decode_cache(cache: torch.Tensor, kv_format: str | None) -> torch.Tensor:
    """Gathered cache rows as fp32; ``uint8`` means E4M3 codes unless ``kv_format`` says E5M2."""
    if cache.dtype == torch.uint8:
        if kv_format == "fp8_e5m2":
            return decode_e5m2(cache, torch.float32)
        return decode_e4m3(cache, torch.float32)
    return cache.float()


def sparse_paged_attention_ref(
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
    kv_format: str | None = None,
) -> torch.Tensor:
    """Attention of each query token over its selected positions; returns ``[T, Hq, D]`` in q's dtype.

    Shapes: ``q [T, Hq, D]``; ``k_cache``/``v_cache`` ``[num_blocks, block_size, Hkv, D]`` floating or
    ``uint8`` FP8 codes (E4M3 unless ``kv_format == "fp8_e5m2"``); ``block_table [R, max_blocks]``;
    ``token_req_idx [T]``; ``selected [T, S]`` logical positions (-1 = padding); ``num_selected [T]``.
    Only the first ``num_selected[t]`` entries of a row count, and of those only non-negative ones. Logits are
    ``(q . k) * scale * k_scale`` and the output is ``softmax @ v * v_scale``; a row with nothing
    selected outputs zeros.
    """
    num_q_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    width = selected.shape[1]
    device = q.device

    cols = torch.arange(width, device=device)
    valid = cols.unsqueeze(0) < num_selected.to(device).long().unsqueeze(1)  # [T, S]
    valid &= selected >= 0
    pos = torch.where(valid, selected.long(), torch.zeros_like(selected, dtype=torch.long))
    pages = block_table.long()[token_req_idx.long().unsqueeze(1), pos // block_size]  # [T, S]
    offsets = pos % block_size

    k = _decode_cache(k_cache[pages, offsets], kv_format)  # [T, S, Hkv, D]
    v = _decode_cache(v_cache[pages, offsets], kv_format)
    k = k.repeat_interleave(group, dim=2)  # [T, S, Hq, D]
    v = v.repeat_interleave(group, dim=2)

    logits = torch.einsum("thd,tshd->ths", q.float(), k) * (scale * k_scale)
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    # An all-masked row would give NaN from softmax; neutralise it and zero its output below.
    any_valid = valid.any(dim=1)  # [T]
    logits = torch.where(any_valid[:, None, None], logits, torch.zeros_like(logits))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("ths,tshd->thd", probs, v) * v_scale
    out = torch.where(any_valid[:, None, None], out, torch.zeros_like(out))
    return out.to(q.dtype)
