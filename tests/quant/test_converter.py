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

from model.tools.quantize import EXPERT_RE, KEEP_RE, choose_group, convert_checkpoint, per_rank_shapes

from .conftest import CASES, COMPRESSED_TENSORS_CASES


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


@pytest.mark.parametrize("case", COMPRESSED_TENSORS_CASES)
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


@pytest.mark.parametrize("case", COMPRESSED_TENSORS_CASES)
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
    with pytest.raises(ValueError, match=r"--group-size 128 does not divide the per-rank target dims \[64\]"):
        choose_group([(64, 128), (128, 64)], "w4a16", 128)


def test_groups_fit_each_tensor_parallel_rank(quant_checkpoints, tmp_path):
    experts = ["m.layers.0.mlp.experts.0.gate_proj", "m.layers.0.mlp.experts.0.down_proj"]
    # The real config at TP=4: intermediate 512 -> 128 per rank, so group 128 still fits.
    assert choose_group(per_rank_shapes(experts, [(512, 2048), (2048, 512)], 4), "w4a16", None) == 128
    assert per_rank_shapes(experts, [(64, 128), (128, 64)], 2) == [(32, 128), (128, 32)]
    with pytest.raises(ValueError, match=r"down_proj: input dim 64 is not divisible by --tp 3"):
        per_rank_shapes(experts, [(63, 128), (128, 64)], 3)
    out = convert_checkpoint(quant_checkpoints["tiny"], tmp_path / "tp2", "w4a16", tp=2)
    assert _qconfig(out)["config_groups"]["group_0"]["weights"]["group_size"] == 32  # 64 at TP=1


def test_refuses_an_already_quantized_source(quant_checkpoints, tmp_path):
    with pytest.raises(
        ValueError, match=r"has a quantization_config \('compressed-tensors'\) this converter"
    ):
        convert_checkpoint(quant_checkpoints["tiny-w4a16"], tmp_path / "again", "w4a16")


def _qwen_fp8_checkpoint(src, dst, block=64):
    """An FP8 block-scaled checkpoint as Qwen publishes them (``weight`` E4M3 + ``weight_scale_inv``,
    ``quant_method: fp8``), written in two shards, from a bf16 one."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = _tensors(src)
    out = {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight") and w.ndim == 2 and all(d % block == 0 for d in w.shape):
            n, k = w.shape
            tiles = w.float().view(n // block, block, k // block, block)
            inv = (tiles.abs().amax((1, 3)) / 448).clamp_min(1e-12)
            full = inv.repeat_interleave(block, 0).repeat_interleave(block, 1)
            out[name] = (w.float() / full).to(torch.float8_e4m3fn)
            out[name.removesuffix("weight") + "weight_scale_inv"] = inv
        else:
            out[name] = w
    names = sorted(out)
    half = len(names) // 2
    save_file({n: out[n] for n in names[:half]}, str(dst / "model-00001-of-00002.safetensors"))
    save_file({n: out[n] for n in names[half:]}, str(dst / "model-00002-of-00002.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (dst / "config.json").write_text(json.dumps(config))
    deq = {}
    for name, t in out.items():
        if name.endswith("weight_scale_inv"):
            continue
        inv = out.get(name.removesuffix("weight") + "weight_scale_inv")
        full = None if inv is None else inv.repeat_interleave(block, 0).repeat_interleave(block, 1)
        deq[name] = t if inv is None else (t.float() * full).to(torch.bfloat16)
    return dst, deq


def test_fp8_block_source_is_dequantized_then_converted_shard_by_shard(quant_checkpoints, tmp_path):
    fp8_src, deq = _qwen_fp8_checkpoint(quant_checkpoints["tiny"], tmp_path / "qwen-fp8")
    out = convert_checkpoint(fp8_src, tmp_path / "w4", "w4a16", scales="pow2")
    twin = convert_checkpoint(fp8_src, tmp_path / "w4-deq", "w4a16", scales="pow2", dequantized=True)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    merged = {}
    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            merged.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(index) == set(merged)
    assert not any(t.dtype == torch.float8_e4m3fn for t in merged.values())
    assert _qconfig(out)["format"] == "pack-quantized"
    with safe_open(twin / shards[0], "pt") as f0, safe_open(twin / shards[1], "pt") as f1:
        twin_t = {k: f.get_tensor(k) for f in (f0, f1) for k in f.keys()}
    for name, value in deq.items():
        module = name.removesuffix(".weight")
        if f"{module}.weight_packed" in merged:
            packed, scale = merged[f"{module}.weight_packed"], merged[f"{module}.weight_scale"]
            assert torch.equal(decode_int4(packed, scale, value.shape).to(torch.bfloat16), twin_t[name])
        else:
            assert torch.equal(merged[name], value), name  # dense layers: the dequantized FP8 values
