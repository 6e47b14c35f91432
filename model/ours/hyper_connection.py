"""Small parameter holders shared by the vLLM modules: zero-centred norms and gated residuals.

These are replicated on every tensor-parallel rank (they are tiny), and they call the plain-torch
ops in ``model.ops`` so the math is the one the unit tests check against the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from model.ops.hyper_connection import gated_residual_mix, inject
from model.ops.norms import rms_norm_one_plus


class WeightOnly(nn.Module):
    """A module with one ``weight`` parameter, so checkpoint names map one to one."""

    def __init__(self, *shape: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class ZeroCenteredRMSNorm(WeightOnly):
    """RMS norm with gain ``1 + weight``, optionally per group of ``group_size`` channels."""

    def __init__(self, dim: int, eps: float, group_size: int | None = None) -> None:
        super().__init__(dim)
        self.eps = eps
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_one_plus(x, self.weight, self.eps, self.group_size)


class GatedResidual(nn.Module):
    """Hyper-connection: mixes ``hc_count`` streams into a block input and re-injects its output."""

    def __init__(
        self, hc_count: int, hidden_size: int, lowrank: int, eps: float, with_injection: bool = True
    ):
        super().__init__()
        self.hc_count = hc_count
        self.hidden_size = hidden_size
        width = hc_count * hidden_size
        self.hc_norm = ZeroCenteredRMSNorm(width, eps, group_size=hidden_size)
        self.input_mix_weight_down = WeightOnly(lowrank, width)
        self.input_mix_weight_up = WeightOnly(width, lowrank)
        self.block_inject_weight = WeightOnly(hc_count, width) if with_injection else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return gated_residual_mix(
            streams,
            self.hc_norm.weight,
            self.input_mix_weight_down.weight,
            self.input_mix_weight_up.weight,
            None if self.block_inject_weight is None else self.block_inject_weight.weight,
            self.hc_count,
            self.hidden_size,
            self.hc_norm.eps,
        )

    @staticmethod
    def inject(streams: torch.Tensor, block_output: torch.Tensor, injection: torch.Tensor) -> torch.Tensor:
        return inject(streams, block_output, injection)
