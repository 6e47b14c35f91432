"""Element codes of quantized PLE tables: E4M3 and E2M1 values, decoded exactly to fp32.

Why its own module: the table format (``tables``), the offline quantizers
(``quantizers``) and the tests all need the same constants and the same exact decode; kept
apart, the quantizers can be imported without the table definitions and vice versa.
"""

from __future__ import annotations

import torch

NVFP4_BLOCK = 16
"""Values per NVFP4 block scale."""

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Midpoints between consecutive E2M1 magnitudes: bucketize() against them rounds to nearest.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def fp32_exact(x: float) -> float:
    """Round a Python float to the nearest fp32 value.

    Global scales are stored as fp32 in checkpoints and passed to kernels as fp32 scalars; keeping
    the Python-side value fp32-exact means every path multiplies by the very same number.
    """
    return float(torch.tensor(x, dtype=torch.float32).item())


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn variant: no infinities, 0x7F/0xFF are NaN) codes -> fp32, exact."""
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (bit 3 = sign) -> fp32, exact. Code 8 decodes to -0.0, like the kernel.

    Decoded by re-biasing through the fp16 bit layout (``s ee m`` -> ``s 000ee m000000000`` is
    ``value * 2**-14``) rather than a lookup table: no host-to-device constant is created, so the
    torch path stays legal inside CUDA-graph capture.
    """
    c = codes.to(torch.int16)
    bits = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    return bits.view(torch.float16).to(torch.float32) * 16384.0
