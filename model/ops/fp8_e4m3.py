"""FP8 KV-cache codec in plain torch: E4M3 (and E5M2) bytes stored as ``uint8``.

The RTX 3090 (sm_86) has no FP8 arithmetic and Triton refuses ``tl.float8*`` there, so the QSA
KV cache keeps FP8 *codes* in ``uint8`` tensors and the attention kernel widens them with integer
bit manipulation. ``decode_e4m3`` below performs exactly that arithmetic on integer tensors, so
the CPU tests of this module also check the trick the GPU kernel relies on.

The trick (E4M3: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; FP16: 1, 5 with bias 15,
10): ``bits16 = (b & 0x80) << 8 | (b & 0x7F) << 7`` moves the sign to bit 15, the exponent to
the low 4 bits of FP16's exponent field and the mantissa to FP16's top mantissa bits. The FP16
number read from ``bits16`` is the E4M3 value times ``2**-8`` (the bias difference 15 - 7),
exactly, subnormals included: an E4M3 subnormal ``m/8 * 2**-6`` lands on the FP16 subnormal
``m*128/1024 * 2**-14``. Multiplying by ``2**8`` (exact) gives the value; the kernel instead
folds that power of two into its score and output scales.

The two NaN codes 0x7F / 0xFF decode to +-480 (the pattern read as an ordinary number): the
encoder never emits them because it clamps to the finite range +-448 first.

E5M2 is the top byte of an FP16 number, so its decode is ``b << 8`` reinterpreted as FP16.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
# Exponent-bias difference between FP16 (15) and E4M3 (7): the FP16 read of the shifted bits is
# the E4M3 value times 2**-E4M3_FP16_SHIFT.
E4M3_FP16_SHIFT = 8


def _as_scale(scale: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor | float:
    """A float stays a float; a tensor scale is moved to fp32 on ``like``'s device so it broadcasts."""
    if isinstance(scale, torch.Tensor):
        return scale.to(device=like.device, dtype=torch.float32)
    return float(scale)


def encode_e4m3(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """E4M3 codes (``uint8``, same shape) of ``x / scale``.

    Values beyond the finite range are clamped to +-448 rather than left to the cast, because
    torch's ``float8_e4m3fn`` cast turns out-of-range values into NaN, which would poison a whole
    softmax row. Rounding is torch's own cast (round to nearest, ties to even).
    """
    scaled = x.float() / _as_scale(scale, x)
    scaled = scaled.clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3_fp16_scaled(codes: torch.Tensor) -> torch.Tensor:
    """FP16 tensor equal to ``value * 2**-8`` for each E4M3 code, by pure integer bit moves.

    This is the form the Triton kernel computes per element (no float multiply); exposed so the
    CPU tests can check it on its own.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"E4M3 codes must be uint8, got {codes.dtype}")
    b = codes.to(torch.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    # Map the unsigned 16-bit pattern into int16's range before the narrowing cast.
    bits = bits - ((bits >> 15) << 16)
    return bits.to(torch.int16).view(torch.float16)


def decode_e4m3(codes: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode E4M3 ``uint8`` codes to ``dtype`` (exact for all 254 finite codes in fp16/bf16/fp32).

    0x7F / 0xFF (NaN in ``float8_e4m3fn``) decode to +480 / -480; see the module docstring.
    """
    value = decode_e4m3_fp16_scaled(codes).float() * float(2**E4M3_FP16_SHIFT)
    return value.to(dtype)


def count_clipped(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Number of elements that ``encode_e4m3`` clamps (``|x| > 448 * scale``), as an int64 scalar tensor.

    Kept as a tensor so callers can accumulate it on the device without a host sync per layer.
    """
    return (x.float().abs() > E4M3_MAX * _as_scale(scale, x)).sum()


def encode_e5m2(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """E5M2 codes (``uint8``) of ``x / scale``, clamped to +-57344 for the same reason as E4M3."""
    scaled = x.float() / _as_scale(scale, x)
    scaled = scaled.clamp(-E5M2_MAX, E5M2_MAX)
    return scaled.to(torch.float8_e5m2).view(torch.uint8)


def decode_e5m2(codes: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode E5M2 ``uint8`` codes: the code is the high byte of an FP16 bit pattern.

    Exact in fp16/fp32 for all codes (inf/NaN included); in bf16 the finite values are exact too.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"E5M2 codes must be uint8, got {codes.dtype}")
    bits = codes.to(torch.int32) << 8
    bits = bits - ((bits >> 15) << 16)
    return bits.to(torch.int16).view(torch.float16).to(dtype)
