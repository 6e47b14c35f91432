"""Our implementation on vLLM's CPU build against transformers in float32, teacher-forced.

For each case the pooled mean |delta| of the actual next token's log-prob must be within
``measure.tolerance`` of transformers' own bfloat16 error on the same prompts (the yardstick; see
``tests.fidelity.measure``). Prints both, with p99 and top-1 agreement on decisive positions. Cases:
a preset and a drawn shape (``model.tools.checkpoints.drawn_shape``) with salted prompts; the
repetitive case (``tests.fidelity.repetitive_case``: transformers' own initialisation, text that
repeats; its prompts up to ~600 tokens here); a drawn shape with transformers' own initialisation
and repeated text. The CUDA paths have the same judge on the GPU (``tests/gpu/test_fidelity_cuda.py``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import CHECKPOINTS, ROOT
from tests.fidelity import measure
from tests.vllm_greedy import in_process_engine, shut_down

# drawn-6: hc 3, 8 experts, PLE on three layers with 4-grams, 4 index heads, RoPE on 32 of 128 dims.
# Its prompts stop at 300 tokens: a 904-token batch of it took the CPU worker past this machine's
# memory (see docs/fidelity.md).
LENGTHS = {"tiny": (4, 300, 600), "drawn-6": (4, 300)}


def _checkpoint(shape: str, init: str = "random"):
    path = CHECKPOINTS / f"fidelity-{shape}" if init == "random" else CHECKPOINTS / f"fidelity-{shape}-{init}"
    if not (path / "model.safetensors").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "model.tools.checkpoints",
                "--preset",
                shape,
                "--out",
                str(path),
                "--train-steps",
                "0",
                "--init",
                init,
            ],
            check=True,
            cwd=ROOT,
        )
    return path


def judge_ours(name: str, path, prompts: list[list[int]]) -> None:
    from vllm import LLM

    ref32 = measure.transformers_token_logprobs(path, prompts, torch.float32)
    yardstick = measure.fidelity(
        ref32, measure.as_observed(measure.transformers_token_logprobs(path, prompts, torch.bfloat16))
    )
    with in_process_engine():
        llm = LLM(
            model=str(path), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
            max_model_len=max(map(len, prompts)) + 16, seed=0,
        )  # fmt: skip
        try:
            ours = measure.fidelity(ref32, measure.vllm_token_logprobs(llm, prompts))
        finally:
            shut_down(llm)
    print(
        f"\n{name}: transformers-bf16 {yardstick.as_row()}; ours {ours.as_row()} ({ours.positions} positions)"
    )
    assert ours.mean_abs <= measure.tolerance(yardstick), (name, ours, yardstick)


@pytest.mark.parametrize("shape", sorted(LENGTHS))
def test_ours_is_as_close_to_float32_as_transformers_bf16(shape):
    path = _checkpoint(shape)
    judge_ours(shape, path, measure.prompts_of_lengths(path, LENGTHS[shape]))


def test_ours_on_the_repetitive_case(tmp_path):
    from tests.fidelity.repetitive_case import build_checkpoint, prompts

    path = build_checkpoint(tmp_path / "case")
    case = prompts(path)
    judge_ours("repetitive case", path, [case[name] for name in ("short", "chat", "p600")])


def test_ours_on_a_default_init_draw_with_repeated_text():
    path = _checkpoint("drawn-2", init="transformers")
    judge_ours("drawn-2, transformers' init, repeated text", path, measure.repeated_prompts(path, (4, 300)))
