"""``tests.pressure.fp32_judge`` on transformers' own runs of the tiny checkpoint: float32 itself
passes, a batch whose log-probabilities moved by a nat (what a resumed request reading a wrong
state looks like) fails, and so does one that picks another token where float32 is decisive."""

from __future__ import annotations

import random

import torch

from tests.conftest import ensure_checkpoint
from tests.fidelity.measure import DECISIVE_MARGIN
from tests.pressure.fp32_judge import generated_references, judge


def _float32_runs(path, prompts, new_tokens: int):
    """Greedy continuations by transformers in float32, as (tokens, {token: logprob}) runs."""
    from transformers import Qwen4ExpForCausalLM

    model = Qwen4ExpForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    runs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(p) :].tolist()
            lps = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
            runs.append((tokens, [{t: float(lp[t])} for t, lp in zip(tokens, lps, strict=True)]))
    return runs


def test_the_judge_passes_float32_and_fails_a_moved_or_flipped_batch():
    path = ensure_checkpoint("tiny")
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 200) for _ in range(24)] for _ in range(3)]
    runs = _float32_runs(path, prompts, 12)

    ok = judge(path, prompts, runs, runs)
    assert not ok.problems, ok.problems
    assert ok.batch.mean_abs < 1e-3 and ok.bound >= ok.yardstick.mean_abs

    moved = [(t, [{k: v - 1.0 for k, v in s.items()} for s in lps]) for t, lps in runs]
    bad = judge(path, prompts, runs, moved)
    assert any("from float32 on average" in p for p in bad.problems), bad.problems

    # Another token at every decisive position of the first request (the runs keep their
    # float32 log-probabilities: only the choice is wrong).
    [refs] = generated_references(path, prompts, [runs], torch.float32, "cpu")
    tokens, lps = runs[0]
    decisive = (refs[0].margin > DECISIVE_MARGIN).tolist()
    assert any(decisive)
    flipped = [(t + 1) % 200 if d else t for t, d in zip(tokens, decisive, strict=True)]
    wrong = [(flipped, [{f: next(iter(s.values()))} for f, s in zip(flipped, lps, strict=True)]), *runs[1:]]
    verdict = judge(path, prompts, runs, wrong)
    assert any("decisive positions" in p for p in verdict.problems), verdict.problems
