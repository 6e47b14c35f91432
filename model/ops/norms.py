"""RMS norms of Qwen4-Exp, in plain torch.

Qwen4-Exp stores norm weights zero-centred: the effective gain is ``1 + weight``. Several norms
(hyper-connection and PLE norms) normalise each residual stream separately, which is a norm over
groups of ``group_size`` channels. The arithmetic (fp32 inside, cast back at the end) follows the
reference so bf16 outputs agree bit for bit with transformers.
"""

from __future__ import annotations

import torch


def rms_norm_one_plus(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None
) -> torch.Tensor:
    """``x / rms(x) * (1 + weight)``, optionally per group of ``group_size`` channels."""
    xf = x.float()
    if group_size is not None:
        xf = xf.reshape(*xf.shape[:-1], -1, group_size)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        out = out.flatten(-2)
    return (out * (1.0 + weight.float())).type_as(x)
