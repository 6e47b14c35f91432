"""QSA token selection: which past tokens a query attends to.

Keys of consecutive ``compress_ratio`` tokens are mean-pooled into one block key, RMS-normalised
and rotated to the position of the block's first token. A query scores each *complete* block as
``sum_h relu(q_h . k_block) / sqrt(d)`` over the indexer heads, keeps the ``budget / ratio`` best
blocks, and always keeps the incomplete tail block (the most recent ``< ratio`` tokens). When a
query sees no more complete blocks than the budget allows, every token is selected and the layer
is exactly dense causal attention.
"""

from __future__ import annotations

import math

import torch

from .norms import rms_norm_one_plus
from .rope import apply_rope, rope_cos_sin


def pooled_block_keys(
    raw_keys: torch.Tensor, ratio: int, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Block keys ``[L // ratio, D]`` from one request's raw index keys ``[L, D]``."""
    num_blocks = raw_keys.shape[0] // ratio
    d = raw_keys.shape[-1]
    groups = raw_keys[: num_blocks * ratio].view(num_blocks, ratio, d)
    pooled = groups.float().mean(dim=1).to(raw_keys.dtype)
    pooled = rms_norm_one_plus(pooled, norm_weight, eps)
    starts = torch.arange(num_blocks, device=raw_keys.device) * ratio
    cos, sin = rope_cos_sin(starts, inv_freq, raw_keys.dtype)
    return apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1)


def select_tokens(
    index_q: torch.Tensor, positions: torch.Tensor, block_keys: torch.Tensor, budget: int, ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected token positions of each query of one request.

    ``index_q`` ``[Q, H, D]`` (normed and rotated), ``positions`` ``[Q]`` absolute positions,
    ``block_keys`` ``[>= max complete blocks, D]``. Returns ``(selected [Q, budget + ratio - 1]``
    padded with -1, ``num_selected [Q])``.
    """
    num_q = index_q.shape[0]
    width = budget + ratio - 1
    top_blocks = budget // ratio
    scale = math.sqrt(index_q.shape[-1])
    selected = torch.full((num_q, width), -1, dtype=torch.int32, device=index_q.device)
    counts = torch.zeros(num_q, dtype=torch.int32, device=index_q.device)
    keys_f = block_keys.float()
    for i in range(num_q):
        pos = int(positions[i])
        complete = (pos + 1) // ratio
        if complete > top_blocks:
            # Same operation order as the reference so that ties and near-ties break identically.
            scores = torch.matmul(index_q[i].float(), keys_f[:complete].transpose(-1, -2)).transpose(-1, -2)
            scores = torch.relu(scores).sum(dim=-1) / scale
            blocks = scores.topk(top_blocks, dim=0).indices
            offsets = torch.arange(ratio, device=index_q.device)
            chosen = (blocks.unsqueeze(1) * ratio + offsets).flatten()
        else:
            chosen = torch.arange(complete * ratio, device=index_q.device)
        tail = torch.arange(complete * ratio, pos + 1, device=index_q.device)
        tokens = torch.cat([chosen, tail])
        selected[i, : tokens.numel()] = tokens.to(torch.int32)
        counts[i] = tokens.numel()
    return selected, counts
