"""QSA token selection: which past tokens a query attends to.

Keys of consecutive ``compress_ratio`` tokens are mean-pooled into one block key, RMS-normalised
and rotated to the position of the block's first token. A query scores each *complete* block as
``sum_h relu(q_h . k_block) / sqrt(d)`` over the indexer heads, keeps the ``budget / ratio`` best
blocks, and always keeps the incomplete tail block (the most recent ``< ratio`` tokens). When a
query sees no more complete blocks than the budget allows, every token is selected and the layer
is exactly dense causal attention.

``select_tokens`` (a loop over queries in the reference's operation order) is the CPU path and the
test reference; ``select_tokens_batched`` computes the same selection a chunk of queries at a time
and is what the vLLM adapter uses on CUDA (see its docstring for why both exist).
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


# Upper bound on the fp32 elements of one chunk's ``[Qc, H, B]`` score tensor (256 MiB).
_SCORE_ELEMENTS_PER_CHUNK = 1 << 26


def select_tokens_batched(
    index_q: torch.Tensor,
    positions: torch.Tensor,
    block_keys: torch.Tensor,
    budget: int,
    ratio: int,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_tokens`` for many queries at once: same arguments, same outputs, same token order.

    Why two implementations: ``select_tokens`` runs a Python loop with a host sync, a matmul and a
    topk per query, which on a GPU costs tens of thousands of launches and syncs per QSA layer for
    a long prefill. This version scores ``chunk`` queries per step (``[Qc, H, D] x [D, B]``, relu,
    sum over heads, ``/ sqrt(D)``), masks the blocks a query cannot see yet to ``-inf`` (block ``b``
    is complete for position ``p`` iff ``b < (p + 1) // ratio``) and runs one ``topk`` per chunk. It
    has no loop over queries and no host sync; only the number of chunks depends on shapes.

    It is used on CUDA only. On the CPU the adapter keeps the loop, because the loop mirrors
    transformers' per-query operation order and so breaks ties (exact ties at 0 from the relu are
    common) and near-ties exactly like the reference; the CPU parity tests rely on that. Here the
    head sum and the topk run over a different layout, so tied blocks may be chosen differently;
    any such choice is equivalent (equal scores). On a GPU ties break differently from the CPU
    reference in any case (on the H200, 5-10% of queries picked another of near-tied blocks with
    the loop, and tokens still matched).

    Token order in a row, as in ``select_tokens``: a sparse query (more than ``budget // ratio``
    complete blocks) lists the ``ratio`` tokens of each chosen block in topk (descending score)
    order, then its tail ``[complete * ratio, p]``; a dense query lists ``0 .. p``. The attention
    (``sparse_paged_attention_ref`` and the Triton kernel) is a softmax over the set of the first
    ``count`` entries and does not depend on the order beyond float summation order.

    ``chunk`` is the number of queries scored at once; by default it keeps the ``[Qc, H, B]`` fp32
    scores under ``2**26`` elements. ``block_keys`` must hold at least the largest number of
    complete blocks among the queries (blocks beyond a query's complete ones are never selected).
    """
    device = index_q.device
    num_q, heads, dim = index_q.shape
    width = budget + ratio - 1
    top_blocks = budget // ratio
    scale = math.sqrt(dim)
    selected = torch.full((num_q, width), -1, dtype=torch.int32, device=device)
    counts = torch.zeros(num_q, dtype=torch.int32, device=device)
    if num_q == 0:
        return selected, counts

    num_blocks = block_keys.shape[0]
    keys_t = block_keys.float().transpose(0, 1)  # [D, B]
    # With fewer blocks than top_blocks no query can be sparse; topk still needs k <= B.
    k = min(top_blocks, num_blocks)
    if chunk is None:
        chunk = max(1, _SCORE_ELEMENTS_PER_CHUNK // max(1, heads * num_blocks))
    cols = torch.arange(width, device=device)  # [W]
    block_cols = torch.arange(num_blocks, device=device)  # [B]
    block_offsets = torch.arange(ratio, device=device).repeat(top_blocks)  # [top_blocks * ratio]
    tail_offsets = torch.arange(ratio - 1, device=device)  # [ratio - 1]
    pos_all = positions.to(device=device, dtype=torch.long)

    for start in range(0, num_q, chunk):
        end = min(start + chunk, num_q)
        pos = pos_all[start:end]  # [Qc]
        complete = torch.div(pos + 1, ratio, rounding_mode="floor")  # [Qc]
        sparse = complete > top_blocks  # [Qc]

        if k > 0:
            scores = torch.matmul(index_q[start:end].float(), keys_t)  # [Qc, H, B]
            scores = scores.relu_().sum(dim=1) / scale  # [Qc, B]
            scores.masked_fill_(block_cols.unsqueeze(0) >= complete.unsqueeze(1), float("-inf"))
            blocks = scores.topk(k, dim=1).indices  # [Qc, k], descending score
            if k < top_blocks:  # only dense queries here; pad so the gather below has its shape
                blocks = torch.nn.functional.pad(blocks, (0, top_blocks - k))
        else:
            blocks = torch.zeros(end - start, top_blocks, dtype=torch.long, device=device)

        block_tokens = blocks.repeat_interleave(ratio, dim=1) * ratio + block_offsets  # [Qc, top*ratio]
        tail_tokens = (complete * ratio).unsqueeze(1) + tail_offsets  # [Qc, ratio - 1]
        sparse_tokens = torch.cat([block_tokens, tail_tokens], dim=1)  # [Qc, top*ratio + ratio - 1]
        if sparse_tokens.shape[1] < width:  # budget not a multiple of ratio: pad to the row width
            sparse_tokens = torch.nn.functional.pad(sparse_tokens, (0, width - sparse_tokens.shape[1]))
        tokens = torch.where(sparse.unsqueeze(1), sparse_tokens, cols.unsqueeze(0))
        count = torch.where(sparse, top_blocks * ratio + pos + 1 - complete * ratio, pos + 1)
        tokens = torch.where(cols.unsqueeze(0) < count.unsqueeze(1), tokens, torch.full_like(tokens, -1))
        selected[start:end] = tokens.to(torch.int32)
        counts[start:end] = count.to(torch.int32)
    return selected, counts
