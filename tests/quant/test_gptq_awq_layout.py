"""The GPTQ and AWQ writers (``model.tools.quantize_gptq_awq``) against an unpacker written here from the
layouts' definitions: nibble order, the GPTQ v1 ``zero - 1`` convention and AWQ's interleaved column
order. A writer that packed in the wrong order would still round-trip through vLLM's own packers,
so the reference is independent of them."""

from __future__ import annotations

import pytest
import torch

from model.tools.quantize_gptq_awq import quantize_native

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8*w + AWQ_ORDER[i]


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """``[..., W]`` int32 -> ``[..., W, 8]`` nibbles, the lowest first."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * i)) & 15 for i in range(8)], dim=-1)


def unpack_gptq(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    q = _nibbles(t["qweight"])  # [K/8, N, 8]: nibble i is row 8*r + i
    k8, n, _ = q.shape
    codes = q.permute(0, 2, 1).reshape(k8 * 8, n)  # [K, N]
    zeros = _nibbles(t["qzeros"]).reshape(t["qzeros"].shape[0], -1) + 1  # v1 stores zero - 1
    rows = torch.arange(k8 * 8) // group
    assert torch.equal(t["g_idx"].long(), rows)
    w = (codes - zeros[rows]).float() * t["scales"].float()[rows]
    return w.t()


def unpack_awq(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    def cols(words: torch.Tensor) -> torch.Tensor:
        q = _nibbles(words)  # [R, N/8, 8]
        out = torch.empty(q.shape[0], q.shape[1], 8, dtype=q.dtype)
        for i, c in enumerate(AWQ_ORDER):
            out[:, :, c] = q[:, :, i]
        return out.reshape(q.shape[0], -1)

    codes, zeros = cols(t["qweight"]), cols(t["qzeros"])
    rows = torch.arange(codes.shape[0]) // group
    return ((codes - zeros[rows]).float() * t["scales"].float()[rows]).t()


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("scales", ["pow2", "absmax"])
def test_layout_decodes_to_the_twin(fmt, scales):
    torch.manual_seed(0)
    weight = (torch.randn(96, 256) * 0.05).to(torch.bfloat16)
    weight[3, 70] = 0.4  # one outlier group
    tensors, restored = quantize_native(weight, fmt, 64, scales, "m")
    decoded = (unpack_gptq if fmt == "gptq" else unpack_awq)(tensors, 64)
    assert torch.equal(decoded.to(torch.bfloat16), restored)
    if scales == "pow2":
        assert torch.equal(decoded, restored.float())  # exact in bf16: the twin is the kernel's input
    # round to nearest: every weight within half a step of its group's scale (no clipping), plus
    # the twin's own bf16 rounding where the scale is not a power of two
    step = tensors["scales"].float().t().repeat_interleave(64, dim=1)
    slack = restored.float().abs() * 2.0**-8
    assert bool(((restored.float() - weight.float()).abs() <= step / 2 + slack + 1e-6).all())


def test_scale_outside_fp16_is_refused():
    weight = torch.full((8, 64), 1e6)
    with pytest.raises(ValueError, match="fp16"):
        quantize_native(weight, "gptq", 64, "absmax", "model.layers.0.mlp.experts.0.up_proj")
