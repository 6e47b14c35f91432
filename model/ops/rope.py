"""Rotary position embedding (NeoX half-rotation, optionally partial) in plain torch.

The cos/sin tables are computed in fp32 and rounded to the activation dtype *before* they are
applied, and the rotation itself runs in the activation dtype: this is what the reference does, and
the QSA indexer's top-k makes us care about bitwise agreement of the scores it ranks.
"""

from __future__ import annotations

import torch


def inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables of shape ``[*positions.shape, rotary_dim]`` for the given positions."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x``; ``cos``/``sin`` broadcast over heads.

    ``x`` is ``[T, H, D]`` and ``cos``/``sin`` are ``[T, rotary_dim]``.
    """
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    rotary_dim = cos.shape[-1]
    x_rope, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rope = (x_rope * cos) + (_rotate_half(x_rope) * sin)
    return torch.cat([x_rope, x_pass], dim=-1)
