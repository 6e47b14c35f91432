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

from model.runtime.expert_format import routed_expert_format

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


def marlin_group(config: Mapping[str, Any]) -> int | None:
    """The group size Marlin sees for the checkpoint's routed experts (config.json as a dict): the
    int4 group, -1 for FP8 (Marlin's W8A16 path is per channel), None for bf16 experts or a
    ``quantization_config`` whose experts no rule here reads (vLLM then decides on its own)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping):
        return None
    try:
        fmt = routed_expert_format(qc)
    except ValueError:
        return None
    return None if fmt.name == "bf16" else fmt.group if fmt.name == "int4" else -1


def slices_need_whole_experts(hidden: int, width: int, tp: int, group: int) -> list[str]:
    """Why Marlin cannot run ``width``-wide experts sliced over ``tp`` ranks while it can run them
    whole (empty: slices fit, or whole experts do not fit either): where ``auto`` takes expert
    parallelism, for the deployment and the planner alike."""
    if tp <= 1 or marlin_misfit(hidden, width, group):
        return []
    if width % tp:
        return [f"moe_intermediate_size {width} does not split over {tp} ranks"]
    return marlin_misfit(hidden, width // tp, group)


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
    if requested == "on" and not cuda:
        # vLLM 0.32's CPU fused-MoE kernel (csrc/cpu/cpu_fused_moe.cpp) dies with SIGSEGV in the first
        # step when a rank holds a share of the experts; sliced experts are the CPU build's one layout.
        return False, (
            f"QWEN4EXP_EXPERT_PARALLEL=on: not on vLLM's CPU build (its fused-MoE kernel crashes on a "
            f"rank's share of the experts); every expert is sliced over the {tp} ranks instead"
        ), []  # fmt: skip
    if requested == "on":
        return True, f"expert parallelism on ({tp} ranks, whole experts per rank)", []
    group = marlin_group(config) if cuda and config is not None else None
    why: list[str] = []
    if group is not None:
        hidden, width = int(config.get("hidden_size", 0)), int(config.get("moe_intermediate_size", 0))
        why = slices_need_whole_experts(hidden, width, tp, group)
    if not why:
        return False, "", []
    if requested == "off":
        return False, "", [
            f"QWEN4EXP_EXPERT_PARALLEL=off: Marlin cannot run the experts sliced over {tp} ranks "
            f"({'; '.join(why)}); fix: set QWEN4EXP_EXPERT_PARALLEL=auto or on"
        ]  # fmt: skip
    return True, (
        f"QWEN4EXP_EXPERT_PARALLEL=auto: whole experts per rank, since Marlin cannot run them sliced over "
        f"{tp} ranks ({'; '.join(why)})"
    ), []  # fmt: skip
