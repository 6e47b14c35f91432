"""CPU tests of the FP8 KV-cache codec: the bit trick must agree with torch's own FP8 types."""

from __future__ import annotations

import pytest
import torch

from model.ops.fp8_e4m3 import (
    E4M3_MAX,
    count_clipped,
    decode_e4m3,
    decode_e4m3_fp16_scaled,
    decode_e5m2,
    encode_e4m3,
    encode_e5m2,
)

ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
E4M3_NAN_CODES = (0x7F, 0xFF)


def _torch_e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()


def _finite_e4m3_mask() -> torch.Tensor:
    mask = torch.ones(256, dtype=torch.bool)
    mask[list(E4M3_NAN_CODES)] = False
    return mask


def test_torch_agrees_on_which_codes_are_nan() -> None:
    nan = torch.isnan(_torch_e4m3(ALL_CODES))
    assert nan.sum() == 2 and nan[0x7F] and nan[0xFF]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_matches_torch_on_all_finite_codes(dtype: torch.dtype) -> None:
    finite = _finite_e4m3_mask()
    ours = decode_e4m3(ALL_CODES, dtype)
    assert ours.dtype == dtype
    expected = _torch_e4m3(ALL_CODES).to(dtype)
    # Bit-level equality (catches -0.0 vs 0.0 too), not just numeric closeness.
    assert torch.equal(ours[finite].float(), expected[finite].float())
    assert torch.equal(torch.signbit(ours[finite]), torch.signbit(expected[finite]))
    assert int(finite.sum()) == 254


def test_fp16_scaled_form_is_exact_value_times_2_pow_minus_8() -> None:
    finite = _finite_e4m3_mask()
    scaled = decode_e4m3_fp16_scaled(ALL_CODES)
    assert scaled.dtype == torch.float16
    assert torch.equal(scaled[finite].float() * 256.0, _torch_e4m3(ALL_CODES)[finite])
    # Subnormals land on fp16 subnormals: smallest positive E4M3 is 2**-9.
    assert scaled[0x01].item() == 2.0**-9 / 256.0


def test_nan_codes_decode_to_480_as_documented() -> None:
    out = decode_e4m3(ALL_CODES, torch.float32)
    assert out[0x7F].item() == 480.0 and out[0xFF].item() == -480.0


def test_decode_rejects_non_uint8() -> None:
    with pytest.raises(TypeError):
        decode_e4m3(torch.zeros(3, dtype=torch.int32))


def test_encode_decode_round_trip_all_finite_codes() -> None:
    finite_codes = ALL_CODES[_finite_e4m3_mask()]
    values = decode_e4m3(finite_codes, torch.float32)
    assert torch.equal(encode_e4m3(values), finite_codes)
    # With a scale, x = value * scale encodes back to the same codes.
    assert torch.equal(encode_e4m3(values * 0.03125, 0.03125), finite_codes)


def test_encode_matches_torch_cast_and_rounds_half_to_even() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 50
    scale = 0.7
    expected = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(encode_e4m3(x, scale), expected)
    # Ties: 1.0625 lies halfway between 1.0 (mantissa 0) and 1.125 (mantissa 1) -> even -> 1.0;
    # 1.1875 lies between 1.125 (1) and 1.25 (2) -> 1.25.
    ties = torch.tensor([1.0625, 1.1875, -1.0625, -1.1875])
    assert decode_e4m3(encode_e4m3(ties), torch.float32).tolist() == [1.0, 1.25, -1.0, -1.25]


def test_encode_accepts_tensor_scale_that_broadcasts() -> None:
    x = torch.randn(3, 2, 8)
    scale = torch.tensor([0.5, 2.0]).view(1, 2, 1)
    expected = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(encode_e4m3(x, scale), expected)


def test_encode_clamps_at_448_and_never_emits_nan_codes() -> None:
    x = torch.tensor([448.0, 449.0, 1000.0, 1e30, float("inf"), -500.0, float("-inf")])
    codes = encode_e4m3(x)
    assert codes.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
    assert decode_e4m3(codes, torch.float32).abs().max().item() == E4M3_MAX
    # With a scale the limit is 448 * scale.
    assert encode_e4m3(torch.tensor([10.0]), 0.01).item() == 0x7E


def test_count_clipped() -> None:
    x = torch.tensor([0.0, 447.0, 448.0, 448.5, -449.0, 1e9])
    assert count_clipped(x).item() == 3
    assert count_clipped(x, 2.0).item() == 1  # only 1e9 exceeds 896
    # bf16 input (456 and -464 are bf16-representable, unlike 448.5).
    assert count_clipped(torch.tensor([448.0, 456.0, -464.0, 1.0], dtype=torch.bfloat16)).item() == 2
    assert count_clipped(torch.zeros(0)).item() == 0
    # Elements at the limit are representable and are not counted.
    assert count_clipped(torch.full((5,), 448.0)).item() == 0


def test_e5m2_decode_matches_torch_on_all_codes() -> None:
    ours = decode_e5m2(ALL_CODES, torch.float32)
    expected = ALL_CODES.view(torch.float8_e5m2).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(expected))
    finite = ~torch.isnan(expected)
    assert torch.equal(ours[finite], expected[finite])
    bf = decode_e5m2(ALL_CODES, torch.bfloat16).float()
    fin = torch.isfinite(expected)
    assert torch.equal(bf[fin], expected[fin])


def test_e5m2_round_trip_and_clamp() -> None:
    values = ALL_CODES.view(torch.float8_e5m2).float()
    finite = torch.isfinite(values)
    assert torch.equal(encode_e5m2(values[finite]), ALL_CODES[finite])
    assert encode_e5m2(torch.tensor([1e9])).view(torch.float8_e5m2).float().item() == 57344.0
