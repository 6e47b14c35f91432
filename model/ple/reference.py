"""PLE layer math: gate n-gram values with each residual stream, then a dilated causal conv.

Given the concatenated n-gram embeddings of each token, PLE projects one value and one key per
residual stream. The per-stream gate is a signed square root of the key/stream dot product, the
gated values are normalised per stream and passed through a depthwise causal convolution with
dilation ``ngram_size`` whose last ``(kernel - 1) * dilation`` inputs are carried between steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from model.ops.norms import rms_norm_one_plus


def ple_gated_values(
    streams: torch.Tensor,
    embeddings: torch.Tensor,
    key_weight: torch.Tensor,
    value_weight: torch.Tensor,
    norm_key_weight: torch.Tensor,
    norm_query_weight: torch.Tensor,
    norm_conv_weight: torch.Tensor,
    hc_count: int,
    hidden_size: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(gated_values, conv_input)``, both ``[T, hc_count * hidden]``."""
    key = rms_norm_one_plus(F.linear(embeddings, key_weight), norm_key_weight, eps, hidden_size)
    key = key.unflatten(-1, (hc_count, hidden_size))
    value = F.linear(embeddings, value_weight)
    query = rms_norm_one_plus(streams, norm_query_weight, eps, hidden_size).unflatten(
        -1, (hc_count, hidden_size)
    )
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
    return gated, rms_norm_one_plus(gated, norm_conv_weight, eps, hidden_size)


def dilated_causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, dilation: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of one request.

    ``x`` ``[L, C]`` new inputs, ``state`` ``[S, C]`` previous inputs with ``S = (K-1)*dilation``
    (zeros for a new request), ``weight`` ``[C, K]``. Returns ``(silu(conv) [L, C], new_state)``.
    """
    state_len = state.shape[0]
    full = torch.cat([state.to(x.dtype), x], dim=0)
    out = F.conv1d(
        full.t().unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=x.shape[1], dilation=dilation
    )
    out = F.silu(out[0].t())
    return out, full[full.shape[0] - state_len :]
