"""Per-step device ops of the QSA KV cache: row scatter, clip counting, running absmax.

All of them are written for CUDA-graph capture: no host synchronisation, no data-dependent
shapes (no boolean indexing), and statistics only accumulate *in place* into tensors allocated
once at start-up. A captured graph then replays the same additions into the same memory, so the
counters keep counting across replays; a fresh tensor assigned per step would be frozen into the
graph instead. Padding rows (slot ``< 0``, present when a captured batch is larger than the real
one) are masked out arithmetically.
"""

from __future__ import annotations

import torch

from model.ops.fp8_e4m3 import E4M3_MAX


def slots_for_rows(slot_mapping: torch.Tensor, num_rows: int) -> torch.Tensor:
    """One slot per row (int64); rows past ``slot_mapping``'s end are padding (-1)."""
    slots = slot_mapping.to(torch.int64)
    if slots.shape[0] < num_rows:
        slots = torch.nn.functional.pad(slots, (0, num_rows - slots.shape[0]), value=-1)
    return slots[:num_rows]


def fp8_rows(
    k_codes: torch.Tensor, v_codes: torch.Tensor, index_k: torch.Tensor, index_dtype: torch.dtype
) -> torch.Tensor:
    """Cache rows ``[T, 2 * Hkv * D + index_dim * itemsize]`` (uint8) of an FP8 QSA cache.

    K and V are E4M3 codes; the index key keeps ``index_dtype`` and is stored as its raw bytes, so
    the reader recovers it exactly with ``Tensor.view(index_dtype)``.
    """
    index_bytes = index_k.to(index_dtype).contiguous().view(torch.uint8)
    return torch.cat([k_codes.flatten(1), v_codes.flatten(1), index_bytes], dim=-1)


def scatter_rows_(cache_rows: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache_rows[slot // B, slot % B] = rows[t]`` for every ``slots[t] >= 0``, with static shapes.

    ``cache_rows`` is the paged cache ``[num_blocks, B, ...]`` (ours: ``[num_blocks, B, C]``;
    upstream's K or V half: ``[num_blocks, B, heads, D]``), any strides (vLLM's per-layer views need
    not be contiguous); ``rows`` is ``[T, ...]`` with the same trailing shape. Padding rows are
    redirected to slot 0 and write back slot 0's current content, so they change nothing. Slot 0
    belongs to vLLM's null block (block id 0, never given to a request), so no real row of the same
    step can target it and race with that write-back.
    """
    block_size = cache_rows.shape[1]
    keep = slots >= 0
    target = torch.where(keep, slots, torch.zeros_like(slots))
    block, offset = target // block_size, target % block_size
    keep_rows = keep.view(-1, *([1] * (cache_rows.dim() - 2)))
    rows = torch.where(keep_rows, rows.to(cache_rows.dtype), cache_rows[block, offset])
    cache_rows.index_put_((block, offset), rows)


def clipped_per_row(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Elements of each row ``x[t]`` that ``encode_e4m3(x, scale)`` clamps, as int64 ``[T]``.

    Uses the same arithmetic as the encoder (``x.float() / scale`` compared with 448), so a count
    is exactly the number of clamped elements, not an approximation at the boundary.
    """
    return ((x.float() / scale).abs() > E4M3_MAX).flatten(1).sum(dim=1)


def count_clips_(
    counter: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | float,
    v_scale: torch.Tensor | float,
    keep: torch.Tensor,
) -> None:
    """``counter[0] += clipped K elements``, ``counter[1] += clipped V elements`` over rows with ``keep``."""
    zero = torch.zeros((), dtype=torch.int64, device=k.device)
    ck = torch.where(keep, clipped_per_row(k, k_scale), zero).sum()
    cv = torch.where(keep, clipped_per_row(v, v_scale), zero).sum()
    counter.add_(torch.stack([ck, cv]))


def update_absmax_(
    absmax: torch.Tensor, tokens: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
) -> None:
    """``absmax = max(absmax, [max|K|, max|V|])`` and ``tokens += rows kept``, over rows with ``keep``.

    A NaN in a kept row propagates into ``absmax`` on purpose: the dump then shows a broken layer
    and the merge refuses it, instead of calibrating on the remaining values.
    """
    if k.shape[0] == 0:
        return
    zero = torch.zeros((), dtype=torch.float32, device=k.device)
    ak = torch.where(keep, k.float().abs().flatten(1).amax(dim=1), zero).amax()
    av = torch.where(keep, v.float().abs().flatten(1).amax(dim=1), zero).amax()
    torch.maximum(absmax, torch.stack([ak, av]), out=absmax)
    tokens.add_(keep.sum())
