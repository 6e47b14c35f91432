"""Routed-expert weight formats: what a checkpoint's ``quantization_config`` stores, and what vLLM
allocates for it.

Why here, below the planner and the deployment: both read the experts' format from one parser (the
planner for memory, ``model.deployment.expert_layout`` for the experts' layout over the ranks), and
the format rules (which ``quantization_config`` shapes mean which expert format, and the exact
tensors vLLM's quantization methods allocate) are their own concern; the planner test checks them against the parameters a real vLLM engine built
(``tests/quant/test_planner_quant.py``).

Formats (routed experts; the dense layers are planned in bf16 and a checkpoint that quantizes them
is refused, not silently planned as bf16):

* ``int4``: compressed-tensors W4A16 ``pack-quantized`` (``model.tools.quantize``; Marlin on sm_86), as
  ``CompressedTensorsWNA16MoEMethod`` allocates it per expert: int32 codes ``[2I, H/8]`` and
  ``[H, I/8]``, bf16 scales ``[2I, H/g]`` and ``[H, I/g]``, two bf16 ``weight_shape`` pairs.
  GPTQ/AWQ checkpoints (4-bit codes plus packed zeros per group) are planned with their zeros.
* ``fp8``: FP8 block-scaled (compressed-tensors ``float-quantized`` block or the ``fp8`` method with
  ``weight_block_size``, as published Qwen FP8 checkpoints are; W8A16 Marlin on sm_86), as
  ``CompressedTensorsW8A8Fp8MoEMethod`` allocates it: one byte per weight and one fp32 scale per
  ``b x b`` block of ``[2I, H]`` and ``[H, I]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EXPERT_FORMATS = ("bf16", "fp8", "int4")
DEFAULT_GROUP = 128  # int4 group size / FP8 block edge when planning a conversion


@dataclass(frozen=True)
class ExpertFormat:
    name: str  # bf16 | fp8 | int4
    group: int = DEFAULT_GROUP  # int4 group size, or FP8 block edge
    zeros: bool = False  # GPTQ/AWQ layouts store packed zero points
    source: str = "assumed"  # "checkpoint" when read from quantization_config

    def label(self) -> str:
        if self.name == "bf16":
            return "bf16"
        what = f"group {self.group}" if self.name == "int4" else f"block {self.group}x{self.group}"
        return f"{self.name}, {what}"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expert_bytes_per_rank(experts: int, i_r: int, hidden: int, fmt: ExpertFormat) -> int:
    """Bytes one rank allocates for one layer's routed experts (intermediate ``i_r`` per rank)."""
    w13, w2 = 2 * i_r * hidden, hidden * i_r
    if fmt.name == "bf16":
        return experts * 2 * (w13 + w2)
    g = fmt.group
    if fmt.name == "int4":
        if i_r % g or hidden % g:
            raise ValueError(
                f"int4 group size {g} does not divide hidden {hidden} / per-rank intermediate {i_r}"
            )
        codes = (w13 + w2) // 2
        scales = 2 * (2 * i_r * (hidden // g) + hidden * (i_r // g))
        extra = (2 * i_r * (hidden // g) + hidden * (i_r // g)) // 2 if fmt.zeros else 2 * 2 * 2
        return experts * (codes + scales + extra)
    if fmt.name == "fp8":
        scales = 4 * (2 * cdiv(i_r, g) * cdiv(hidden, g) + cdiv(hidden, g) * cdiv(i_r, g))
        return experts * (w13 + w2 + scales)
    raise ValueError(f"unknown expert weight format {fmt.name!r}; expected one of {EXPERT_FORMATS}")


_EXPERT_PROBE = "model.layers.0.mlp.experts.0.gate_proj"
_DENSE_PROBES = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.linear_attn.in_proj_qkv",
    "model.layers.0.linear_attn.out_proj",
    "model.layers.0.mlp.shared_expert.down_proj",
)


def _matches(patterns, name: str) -> bool:
    for p in patterns or ():
        if p.startswith("re:") and re.match(p[3:], name):
            return True
        if p in ("Linear", name):
            return True
    return False


def _ct_group_for(qc: dict, name: str) -> dict | None:
    if _matches(qc.get("ignore"), name):
        return None
    for group in (qc.get("config_groups") or {}).values():
        if _matches(group.get("targets"), name):
            return group
    return None


def _ct_format(weights: dict, where: str) -> ExpertFormat:
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if bits == 4 and kind == "int" and strategy == "group":
        return ExpertFormat(
            "int4", int(weights["group_size"]), zeros=not weights.get("symmetric", True), source="checkpoint"
        )
    if bits == 8 and kind == "float" and strategy == "block":
        bn, bk = weights["block_structure"]
        if bn != bk:
            raise ValueError(
                f"{where}: block_structure {[bn, bk]} is not square; the planner models b x b blocks"
            )
        return ExpertFormat("fp8", int(bn), source="checkpoint")
    raise ValueError(
        f"{where}: weights {{num_bits: {bits}, type: {kind}, strategy: {strategy}}} is not a format the "
        "planner models (int4 group / fp8 block); plan with --expert-weights explicitly"
    )


def checkpoint_expert_format(config) -> ExpertFormat:
    """The routed-expert format a checkpoint's ``quantization_config`` declares (bf16 when none);
    refused where it quantizes dense layers too (the planner models those in bf16)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return ExpertFormat("bf16", source="checkpoint")
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        dense = [n for n in _DENSE_PROBES if _ct_group_for(qc, n) is not None]
        if dense:
            raise ValueError(
                f"quantization_config quantizes dense layers too ({', '.join(dense)}); the planner models "
                "quantized routed experts with bf16 dense layers only"
            )
        return routed_expert_format(qc)
    fmt = routed_expert_format(qc)
    if method == "fp8":
        skipped = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
        dense = [n for n in _DENSE_PROBES if not any(s in n for s in skipped)]
        if dense:
            raise ValueError(
                f"quantization_config (fp8) quantizes dense layers too ({', '.join(dense)}); the planner "
                "models quantized routed experts with bf16 dense layers only"
            )
    return fmt


def routed_expert_format(qc: Mapping[str, Any]) -> ExpertFormat:
    """The routed experts' format in a ``quantization_config`` (bf16 when it leaves them out), whatever
    it does to the dense layers; ValueError for a format neither the planner nor Marlin's layout rules
    know. The deployment reads the experts' layout from it too (``model.deployment.expert_layout``)."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        group = _ct_group_for(dict(qc), _EXPERT_PROBE)
        if group is None:
            return ExpertFormat("bf16", source="checkpoint")
        return _ct_format(group.get("weights") or {}, "quantization_config.config_groups")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not block:
            raise ValueError(
                "quantization_config (fp8) has no weight_block_size; the planner models block FP8"
            )
        return ExpertFormat("fp8", int(block[0]), source="checkpoint")
    if method in ("gptq", "awq") and qc.get("bits") == 4:
        return ExpertFormat("int4", int(qc.get("group_size", DEFAULT_GROUP)), zeros=True, source="checkpoint")
    raise ValueError(
        f"quantization_config.quant_method {qc.get('quant_method')!r} is not one the planner reads "
        "(compressed-tensors, fp8, gptq, awq); plan with --expert-weights explicitly"
    )
