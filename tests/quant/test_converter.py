"""The converter writes the real compressed-tensors formats, and the twin holds exactly their values.

Checked without vLLM's kernels: the config parses with vLLM's own compressed-tensors config class;
targets and ignore lists name exactly the intended modules; tensors have the format's names, dtypes
and shapes; an independent decoder of the on-disk bits (written here from the format's definition,
not with the library) reproduces the twin bit for bit; the quantizer is round-to-nearest.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from model.quantize import EXPERT_RE, KEEP_RE, choose_group, convert_checkpoint

from .conftest import CASES


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _qconfig(path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def _matches(patterns: list[str], name: str) -> bool:
    return any(re.match(p.removeprefix("re:"), name) if p.startswith("re:") else p == name for p in patterns)


def decode_int4(packed: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    """compressed-tensors pack-quantized, symmetric: 8 values per int32 along the input dim, low
    nibble first, each stored as ``q + 8`` for q in [-8, 7]; value = q * scale of its group."""
    n, k = (int(v) for v in shape)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(n, -1)[:, :k]
    q = nibbles - 8
    group = k // scale.shape[1]
    return q.float() * scale.float().repeat_interleave(group, dim=1)


def decode_fp8_block(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    bn, bk = weight.shape[0] // scale.shape[0], weight.shape[1] // scale.shape[1]
    full = scale.float().repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return weight.float() * full


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_parses_with_vllm_and_targets_exactly_the_intended_modules(quant_checkpoints, case):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    preset, fmt, scope = CASES[case]
    qc = _qconfig(quant_checkpoints[case])
    CompressedTensorsConfig.from_config(qc)  # vLLM's own parser accepts it
    assert qc["format"] == ("pack-quantized" if fmt == "w4a16" else "float-quantized")
    names = [n.removesuffix(".weight") for n in _tensors(quant_checkpoints[preset]) if n.endswith(".weight")]
    targets = qc["config_groups"]["group_0"]["targets"]
    for module in names:
        targeted = _matches(targets, module)
        if KEEP_RE.match(module) or ".ple." in module or "hyper_connection" in module or "embed" in module:
            assert not targeted, module
        if KEEP_RE.match(module):
            assert _matches(qc["ignore"], module), f"{module} must be ignored by name"
        if EXPERT_RE.match(module):
            assert targeted == (scope in ("experts", "all")), module
    assert "lm_head" in qc["ignore"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_on_disk_bits_decode_to_the_twin_exactly(quant_checkpoints, case):
    preset, fmt, _ = CASES[case]
    q = _tensors(quant_checkpoints[case])
    twin = _tensors(quant_checkpoints[f"{case}-deq"])
    src = _tensors(quant_checkpoints[preset])
    group = choose_group(
        [
            tuple(src[f"{m}.weight"].shape)
            for m in {k.rsplit(".", 1)[0] for k in q if k.endswith("weight_scale")}
        ],
        fmt,
        None,
    )
    quantized = 0
    for name, weight in twin.items():
        module = name.removesuffix(".weight")
        if f"{module}.weight_scale" not in q:
            assert torch.equal(q[name], src[name]) and torch.equal(weight, src[name]), name
            continue
        quantized += 1
        scale = q[f"{module}.weight_scale"]
        n, k = src[name].shape
        if fmt == "w4a16":
            packed = q[f"{module}.weight_packed"]
            assert packed.dtype == torch.int32 and tuple(packed.shape) == (n, k // 8), name
            assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (n, k // group), name
            assert q[f"{module}.weight_shape"].tolist() == [n, k]
            values = decode_int4(packed, scale, (n, k))
            step = scale.float().repeat_interleave(group, dim=1)
        else:
            assert q[name].dtype == torch.float8_e4m3fn and tuple(q[name].shape) == (n, k), name
            assert scale.dtype == torch.float32 and tuple(scale.shape) == (n // group, k // group), name
            values = decode_fp8_block(q[name], scale)
            # E4M3 has 3 mantissa bits: round-to-nearest error <= 1/16 of the value's binade.
            step = values.abs().clamp_min(scale.float().min()) / 8
        assert torch.equal(values.to(torch.bfloat16).float(), values), (
            f"{name}: not exact in bf16 (pow2 scales)"
        )
        assert torch.equal(weight.float(), values), f"{name}: twin differs from the decoded bits"
        err = (src[name].float() - values).abs()
        assert bool((err <= step / 2 + 1e-6).all()), f"{name}: not round-to-nearest (max error {err.max()})"
    assert quantized > 0


def test_group_size_follows_the_shapes_and_bad_choices_are_refused(tmp_path):
    assert choose_group([(64, 128), (128, 64)], "w4a16", None) == 64
    assert choose_group([(96, 192), (192, 96)], "w4a16", None) == 32
    assert choose_group([(256, 512)], "fp8-block", None) == 128
    with pytest.raises(ValueError, match=r"--group-size 128 does not divide the target dims \[64\]"):
        choose_group([(64, 128), (128, 64)], "w4a16", 128)


def test_refuses_an_already_quantized_source(quant_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="already has a quantization_config"):
        convert_checkpoint(quant_checkpoints["tiny-w4a16"], tmp_path / "again", "w4a16")
