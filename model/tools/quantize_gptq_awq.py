"""GPTQ and AWQ checkpoint layouts for ``model.tools.quantize`` (``--format gptq`` / ``--format awq``).

Most community 4-bit checkpoints on the Hub are not compressed-tensors but the layouts AutoGPTQ /
GPTQModel and AutoAWQ write, which vLLM reads through its ``gptq`` and ``awq`` configs and serves
with Marlin on sm_86. These writers produce those layouts from our round-to-nearest quantizer, so
the serving path of such checkpoints can be tested against a dequantized bf16 twin like the
compressed-tensors ones. The bit packing is vLLM's own (``quant_utils.gptq_pack`` / ``awq_pack``,
the packers its Marlin tests use), so what we write is what its loaders read.

Layouts, for a ``[N, K]`` (out, in) weight and groups of ``g`` input channels:

* GPTQ (``checkpoint_format: gptq``, symmetric): ``qweight`` int32 ``[K/8, N]`` (eight 4-bit codes
  along K per word), ``scales`` fp16 ``[K/g, N]``, ``qzeros`` int32 ``[K/g, N/8]`` holding
  ``zero - 1`` (the v1 convention: 7 for the symmetric zero 8), ``g_idx`` int32 ``[K]``.
  Dequantized: ``(code - 8) * scale``.
* AWQ (``version: gemm``, with zero points): ``qweight`` int32 ``[K, N/8]`` packed along N in AWQ's
  interleaved order, ``qzeros`` int32 ``[K/g, N/8]`` likewise, ``scales`` fp16 ``[K/g, N]``.
  Dequantized: ``(code - zero) * scale``.

Scales are fp16 in both layouts (their loaders allocate them in the activation dtype, and fp16 is
what the tools write): a scale above fp16's range is refused rather than rounded; one below its
smallest normal is raised to it (the group's weights are then below fp16's resolution anyway).
"""

from __future__ import annotations

import torch

NATIVE_FORMATS = ("gptq", "awq")
BITS = 4
_FP16_TINY = torch.finfo(torch.float16).tiny
_FP16_MAX = torch.finfo(torch.float16).max


def pow2_up(scale: torch.Tensor) -> torch.Tensor:
    """Each scale rounded up to a power of two: dequantized values are then exact in bf16."""
    return torch.exp2(torch.ceil(torch.log2(scale.float().clamp_min(2.0**-100))))


def _fp16_scales(scale: torch.Tensor, scales: str, module: str) -> torch.Tensor:
    """Group scales as the layouts store them (fp16): raised to fp16's smallest normal, then to a
    power of two for ``scales == "pow2"``; one above fp16's range is refused. Returned as float32
    holding exactly the stored values."""
    scale = scale.clamp_min(_FP16_TINY)  # a power of two, so pow2_up keeps it
    scale = pow2_up(scale) if scales == "pow2" else scale
    bad = scale > _FP16_MAX
    if bool(bad.any()):
        raise ValueError(
            f"{module}: {int(bad.sum())} group scale(s) above fp16's largest value {_FP16_MAX:.3g} "
            f"(e.g. {float(scale[bad][0]):.3g}); GPTQ/AWQ store fp16 "
            "scales, so this weight cannot be written in that layout: use --format w4a16"
        )
    return scale.to(torch.float16).float()


def quantize_native(
    weight: torch.Tensor, fmt: str, group: int, scales: str, module: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One module's GPTQ or AWQ tensors (local names) and its dequantized bf16 weight ``[N, K]``."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack, gptq_pack, pack_cols

    if fmt not in NATIVE_FORMATS:
        raise ValueError(f"unknown native 4-bit format {fmt!r}; expected one of {NATIVE_FORMATS}")
    w = weight.float()
    n, k = w.shape
    if k % group or k % 8 or n % 8:  # both layouts pack zeros (AWQ: codes too) eight columns a word
        raise ValueError(f"{module}: shape [{n}, {k}] does not tile into groups of {group} and words of 8")
    tiles = w.view(n, k // group, group)
    if fmt == "gptq":
        # Symmetric: codes 0..15 around the zero 8, the scale from the group's absmax.
        scale = _fp16_scales(tiles.abs().amax(-1) / 7.0, scales, module)
        zero = torch.full_like(scale, 8.0)
    else:
        # Asymmetric, as AutoAWQ quantizes: the group's [min, max] (with 0 inside) over 15 steps.
        lo, hi = tiles.amin(-1).clamp_max(0.0), tiles.amax(-1).clamp_min(0.0)
        scale = _fp16_scales((hi - lo) / 15.0, scales, module)
        zero = torch.round(-lo / scale).clamp(0, 15)
    codes = (torch.round(tiles / scale[..., None]) + zero[..., None]).clamp(0, 15)
    restored = ((codes - zero[..., None]) * scale[..., None]).view(n, k).to(torch.bfloat16)
    codes_kn = codes.view(n, k).t().contiguous().to(torch.int32)  # [K, N], the packers' orientation
    scale_kn = scale.t().contiguous().to(torch.float16)  # [K/g, N]
    zero_kn = zero.t().contiguous().to(torch.int32)
    if fmt == "gptq":
        tensors = {
            "qweight": gptq_pack(codes_kn, BITS, k, n),
            "qzeros": pack_cols(zero_kn - 1, BITS, k // group, n),
            "scales": scale_kn,
            "g_idx": torch.arange(k, dtype=torch.int32) // group,
        }
    else:
        tensors = {
            "qweight": awq_pack(codes_kn, BITS, k, n),
            "qzeros": awq_pack(zero_kn, BITS, k // group, n),
            "scales": scale_kn,
        }
    return tensors, restored


# Linear-type modules that stay bf16 in every scope, as substrings of vLLM's module prefixes (both
# our model's and upstream's names): the LM head, the QSA indexer (token selection must not move
# with the weight format), the router and shared-expert gates, GDN's tiny a/b projections, PLE's
# projections and the hyper-connection mixers.
ALWAYS_BF16 = (
    "lm_head",
    "self_attn.indexer",
    "mlp.gate",
    "shared_expert_gate",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    ".ple.",
    "hyper_connection",
)
SCOPE_BF16 = {"experts": ("self_attn", "linear_attn", "shared_expert"), "dense": ("mlp.experts",), "all": ()}


def unquantized_substrings(scope: str) -> list[str]:
    """What a ``scope`` leaves in bf16, as the substrings AWQ's ``modules_to_not_convert`` takes."""
    return [*ALWAYS_BF16, *SCOPE_BF16[scope]]


def native_quantization_config(fmt: str, group: int, unquantized: list[str]) -> dict:
    """config.json's ``quantization_config`` as AutoGPTQ / AutoAWQ write it.

    ``unquantized``: module names (vLLM prefixes, as substrings) that stay bf16. AWQ names them in
    ``modules_to_not_convert``; GPTQ has no such list in its base format, and vLLM infers the
    quantized modules from the checkpoint's integer tensors, so the list goes to GPTQModel's
    ``dynamic`` negative rules as well, for readers that do not infer."""
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": BITS,
            "group_size": group,
            "desc_act": False,
            "sym": True,
            "lm_head": False,
            "checkpoint_format": "gptq",
            "dynamic": {f"-:.*{_escape(m)}.*": {} for m in unquantized},
        }
    return {
        "quant_method": "awq",
        "bits": BITS,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(unquantized),
    }


def _escape(name: str) -> str:
    return name.replace(".", r"\.")
