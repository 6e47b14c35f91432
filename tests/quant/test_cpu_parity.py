"""Token parity through vLLM's CPU kernels: each quantized checkpoint vs its dequantized-bf16 twin.

vLLM's CPU build runs these formats only on some hosts, and each case says exactly why it cannot run
on the others (the skip reason is the finding, with file and line in vllm 0.32.0):

* int4 routed experts (compressed-tensors W4A16): ``CPUExpertsInt4`` needs x86 AMX tiles
  (``model_executor/layers/fused_moe/experts/cpu_moe.py:840-844``); the other CPU candidates are
  zentorch (AMD ZenDNN library) and the Arm-only ``cpu_int4_moe.py:60-63``. Without one, the MoE
  constructor raises "No WNA16 MoE backend supports the deployment configuration".
* int4 dense linears: ``CPUWNA16LinearKernel`` calls ``torch.ops._C.cpu_gemm_wna16``, compiled only
  into the AVX-512 libraries ``_C``/``_C_AVX512``; AVX2 hosts load ``_C_AVX2``
  (``platforms/cpu.py:655-657``), which lacks it.
* FP8 block experts: ``CPUExpertsFp8`` needs AMX (``cpu_moe.py:456-460``) and 128x128 weight blocks
  with 128-group activations (``cpu_moe.py:478-484``, ``kFp8Static128BlockSym``); the test presets'
  expert widths (64, 96) admit no 128 blocks. FP8 block *linears* need AMX too
  (``kernels/linear/scaled_mm/cpu.py:241-242``). So FP8 experts are judged on ``qsa512`` (hidden 256,
  experts 128 wide: 128x128 blocks fit), built only on AMX hosts (briefly trained, ~20 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.tools.quantize import convert_checkpoint
from tests.conftest import ensure_checkpoint
from tests.parity.prompts import parity_prompts

from .conftest import DENSE_INT4_CASES, cpu_library_has
from .parity import compare, greedy_with_logprobs

MAX_NEW_TOKENS = 16


def _why_not(case: str, path) -> str | None:
    amx = torch.cpu._is_amx_tile_supported()
    if case == "tiny-w4a16" and not amx:
        return "int4 MoE on vLLM's CPU build needs AMX (CPUExpertsInt4, fused_moe/experts/cpu_moe.py:840-844)"
    if case in DENSE_INT4_CASES and not cpu_library_has("cpu_gemm_wna16"):
        return "int4 linears need torch.ops._C.cpu_gemm_wna16, absent from the AVX2 CPU library (platforms/cpu.py:655-657)"
    if case == "tiny-fp8":
        if not amx:
            return (
                "FP8 MoE on vLLM's CPU build needs AMX (CPUExpertsFp8, fused_moe/experts/cpu_moe.py:456-460)"
            )
        block = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"][
            "group_0"
        ]
        if block["weights"]["block_structure"] != [128, 128]:
            return "CPUExpertsFp8 takes only 128x128 blocks (cpu_moe.py:478-484); the preset's experts admit none"
    return None


@pytest.mark.parametrize("case", ["tiny-w4a16", *DENSE_INT4_CASES, "tiny-fp8"])
def test_quantized_generation_equals_dequantized_twin_on_cpu(quant_checkpoints, case):
    why = _why_not(case, quant_checkpoints[case])
    if why:
        pytest.skip(why)
    from transformers import AutoTokenizer

    prompts = parity_prompts(AutoTokenizer.from_pretrained(quant_checkpoints[case]))
    del prompts["very_long_sparse"]
    got = greedy_with_logprobs(quant_checkpoints[case], prompts, MAX_NEW_TOKENS, max_num_seqs=8)
    want = greedy_with_logprobs(quant_checkpoints[f"{case}-deq"], prompts, MAX_NEW_TOKENS, max_num_seqs=8)
    problems = compare(got, want, prompts=prompts, twin=quant_checkpoints[f"{case}-deq"])
    assert not problems, f"{case} differs from its dequantized twin:\n" + "\n".join(problems)


def _amx_fp8_why_not() -> str | None:
    if not torch.cpu._is_amx_tile_supported():
        return "FP8 MoE on vLLM's CPU build needs AMX (CPUExpertsFp8, fused_moe/experts/cpu_moe.py:456-460)"
    return None


def test_fp8_experts_equal_dequantized_twin_on_amx_cpu(tmp_path_factory):
    """FP8 128x128-block experts (``CPUExpertsFp8``) on the 128-wide ``qsa512`` experts."""
    why = _amx_fp8_why_not()
    if why:
        pytest.skip(why)
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("qsa512_fp8")
    src = ensure_checkpoint("qsa512", train_steps=20)
    paths: dict[str, Path] = {}
    for deq in (False, True):
        key = "deq" if deq else "fp8"
        paths[key] = convert_checkpoint(
            src, root / key, "fp8-block", scope="experts", scales="pow2", dequantized=deq
        )
    block = json.loads((paths["fp8"] / "config.json").read_text())["quantization_config"]["config_groups"][
        "group_0"
    ]
    assert block["weights"]["block_structure"] == [128, 128], block
    prompts = parity_prompts(AutoTokenizer.from_pretrained(paths["fp8"]))
    del prompts["very_long_sparse"]
    got = greedy_with_logprobs(paths["fp8"], prompts, MAX_NEW_TOKENS, max_num_seqs=8)
    want = greedy_with_logprobs(paths["deq"], prompts, MAX_NEW_TOKENS, max_num_seqs=8)
    problems = compare(got, want, prompts=prompts, twin=paths["deq"])
    assert not problems, "qsa512 FP8 experts differ from their dequantized twin:\n" + "\n".join(problems)
