"""How the routed experts are laid out over tensor-parallel ranks: sliced, or whole experts per rank.

Why a decision: with TP-sharded experts each rank holds a ``1 / tp`` slice of every expert's
intermediate width; with expert parallelism (vLLM's ``--enable-expert-parallel``) each rank holds
``num_experts / tp`` whole experts. The bytes are the same; the matrices the MoE kernel sees are not.
A 3090 runs int4 and FP8 experts through vLLM's fused-MoE Marlin kernel, whose tiles need the
per-rank width to be a multiple of ``max(64, group)``: Qwen3.8-Flash-Next's 640-wide experts give
160 per rank at TP=4, which no int4 group of 128 tiles, while whole experts (640) do. There expert
parallelism is the only layout that serves, so ``auto`` takes it and says why; elsewhere ``auto``
keeps the slices (at batch 1 the rank holding most of a token's experts sets the pace, which slices
avoid). Pure arithmetic: the planner and the deployment share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MARLIN_GROUPS = (-1, 32, 64, 128)  # group sizes vLLM's MoE Marlin kernel takes (-1: per channel)


def marlin_misfit(hidden: int, width_per_rank: int, group: int) -> list[str]:
    """What stops vLLM's fused-MoE Marlin kernel on these per-rank expert matrices (empty: nothing).

    Mirrors vLLM's ``check_moe_marlin_supports_config``: the hidden size a multiple of 128, the
    per-rank intermediate width a multiple of ``max(64, group)`` (gate-up is twice that wide, down
    reduces over it), and a group size the kernel has."""
    problems = []
    if hidden % 128:
        problems.append(f"hidden_size {hidden} is not a multiple of 128")
    if width_per_rank % max(64, group):
        problems.append(f"the per-rank expert width {width_per_rank} is not a multiple of {max(64, group)}")
    if group not in MARLIN_GROUPS:
        problems.append(f"group size {group} is not one of {MARLIN_GROUPS[1:]}")
    return problems


def quantized_expert_group(config: Mapping[str, Any]) -> int | None:
    """The group size Marlin sees for the checkpoint's routed experts: the int4 group (compressed-tensors
    W4A16 or GPTQ/AWQ), -1 for FP8 (Marlin's W8A16 path is per channel), None for bf16 experts."""
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping):
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return -1
    if method in ("gptq", "awq"):
        return int(qc.get("group_size", 128))
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            targets = " ".join(map(str, group.get("targets", [])))
            if "expert" not in targets and "Linear" not in targets:
                continue
            weights = group.get("weights") or {}
            if weights.get("type") == "float":
                return -1
            return int(weights.get("group_size") or -1)
    return None


def choose(
    requested: str, config: Mapping[str, Any] | None, *, tp: int, cuda: bool
) -> tuple[bool, str, list[str]]:
    """``(expert_parallel, note, problems)`` for ``QWEN4EXP_EXPERT_PARALLEL`` = ``auto`` | ``on`` | ``off``.

    ``problems``: a layout that vLLM would refuse at load (``off`` where only whole experts fit
    Marlin), one line naming the fix; ``note``: the start-up log's line."""
    if tp <= 1:
        note = (
            ""
            if requested == "auto"
            else "QWEN4EXP_EXPERT_PARALLEL: one rank holds every expert; nothing to split"
        )
        return False, note, []
    group = quantized_expert_group(config) if cuda and config is not None else None
    sliced_problems: list[str] = []
    if group is not None:
        hidden = int(config.get("hidden_size", 0))
        width = int(config.get("moe_intermediate_size", 0))
        sliced_problems = marlin_misfit(hidden, width // tp, group) if width % tp == 0 else [
            f"moe_intermediate_size {width} does not split over {tp} ranks"
        ]  # fmt: skip
        whole_fits = not marlin_misfit(hidden, width, group)
    else:
        whole_fits = True
    if requested == "on":
        return True, f"expert parallelism on ({tp} ranks, whole experts per rank)", []
    if requested == "off":
        if sliced_problems:
            fix = "set QWEN4EXP_EXPERT_PARALLEL=auto or on" if whole_fits else "use another TP size"
            return False, "", [
                f"QWEN4EXP_EXPERT_PARALLEL=off: Marlin cannot run the experts sliced over {tp} ranks "
                f"({'; '.join(sliced_problems)}); fix: {fix}"
            ]  # fmt: skip
        return False, "", []
    if sliced_problems and whole_fits:
        return True, (
            f"QWEN4EXP_EXPERT_PARALLEL=auto: whole experts per rank, since Marlin cannot run them sliced over "
            f"{tp} ranks ({'; '.join(sliced_problems)})"
        ), []  # fmt: skip
    return False, "", []
