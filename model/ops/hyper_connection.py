"""Hyper-connections: ``hc_count`` residual streams mixed into one block input, then re-injected.

A gated residual reads the stacked streams ``[T, hc_count * hidden]``, normalises each stream,
computes a per-channel sigmoid mix from a low-rank projection, averages the mixed streams into the
block input, and (except for the final mixer) returns per-stream injection weights used to add
the block output back into every stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norms import rms_norm_one_plus


def gated_residual_mix(
    streams: torch.Tensor,
    norm_weight: torch.Tensor,
    down_weight: torch.Tensor,
    up_weight: torch.Tensor,
    inject_weight: torch.Tensor | None,
    hc_count: int,
    hidden_size: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(block_input [T, hidden], injection_weights [T, hc_count] or None)``."""
    normed = rms_norm_one_plus(streams, norm_weight, eps, group_size=hidden_size)
    mix = F.silu(F.linear(normed, down_weight) / hc_count)
    mix = torch.sigmoid(F.linear(mix, up_weight))
    mix = mix.unflatten(-1, (hc_count, hidden_size))
    block_input = (mix * normed.unflatten(-1, (hc_count, hidden_size))).mean(dim=-2)
    if inject_weight is None:
        return block_input, None
    injection = 2 * torch.sigmoid(F.linear(normed, inject_weight) / hc_count)
    return block_input, injection


def inject(streams: torch.Tensor, block_output: torch.Tensor, injection: torch.Tensor) -> torch.Tensor:
    """Add ``block_output`` to every stream, scaled by that stream's injection weight."""
    added = block_output.unsqueeze(-2) * injection.unsqueeze(-1)
    return streams + added.flatten(-2)
