"""Preempted requests judged against the model in float32, with transformers-bf16 as the yardstick.

Comparing a preempted request with its lone run (``parity.compare``) asks for bits a bf16 engine
does not promise: a preempted request is recomputed as one prefill and then decodes from a state
the prefill built, where its lone run built that state step by step, and on a briefly trained
checkpoint such as ``qsa512`` bf16 alone moves chosen-token log-probabilities by tenths of a nat
(transformers' own bf16 run sits up to 1.45 nats from float32 there; its bf16 decode and bf16
prefill of one prompt differ by up to 0.22). A state error does not hide in that noise when the
question is asked of every generated position against float32, pooled, as the fidelity judge asks
it of prompts (``tests/fidelity/measure.py``):

* the batch's chosen-token log-probabilities are as close to transformers-float32 (teacher-forced on
  the batch's own tokens) as the lone runs' are to it on theirs, or as transformers-bf16 is, within
  the fidelity judge's tolerance;
* where float32 is decisive (margin above ``DECISIVE_MARGIN``) the batch chose float32's token as
  often as the lone runs and transformers-bf16 did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.fidelity.measure import (
    Fidelity,
    Observed,
    Reference,
    as_observed,
    fidelity,
    tolerance,
    transformers_token_logprobs,
)

from .parity import Run


@dataclass
class Judgement:
    batch: Fidelity  # the preempted batch's generated tokens against float32
    lone: Fidelity  # the lone runs' against float32
    yardstick: Fidelity  # transformers-bf16 on the batch's tokens against float32
    bound: float  # the largest pooled mean |delta| the batch may have
    problems: list[str]

    def line(self) -> str:
        return (
            f"against float32 (mean |delta| / p99 / top-1 on decisive): batch {self.batch.as_row()}, "
            f"lone {self.lone.as_row()}, transformers-bf16 {self.yardstick.as_row()}; bound {self.bound:.4f}"
        )


def generated_references(
    checkpoint: str | Path,
    prompts: Sequence[Sequence[int]],
    run_sets: Sequence[Sequence[Run]],
    dtype: torch.dtype,
    device: str,
) -> list[list[Reference]]:
    """transformers teacher-forced over prompt + generated tokens of each set of runs, kept at the
    positions that predict the generated tokens. One model load for all sets, and a sequence that
    several sets share (a request that kept its lone run's tokens) is computed once."""
    sets = [
        [tuple(p) + tuple(tokens) for p, (tokens, _) in zip(prompts, runs, strict=True)] for runs in run_sets
    ]
    unique = list(dict.fromkeys(seq for seqs in sets for seq in seqs))
    computed = dict(zip(unique, transformers_token_logprobs(checkpoint, unique, dtype, device), strict=True))
    return [
        [
            Reference(r.logprobs[len(p) - 1 :], r.argmax[len(p) - 1 :], r.margin[len(p) - 1 :])
            for p, r in zip(prompts, (computed[seq] for seq in seqs), strict=True)
        ]
        for seqs in sets
    ]


def observed(runs: Sequence[Run]) -> list[Observed]:
    """An engine's greedy runs as observations: each chosen token's log-prob; greedy's top-1 is
    the chosen token."""
    return [
        Observed(
            torch.tensor([lps[k][t] for k, t in enumerate(tokens)], dtype=torch.float32),
            torch.tensor(tokens),
        )
        for tokens, lps in runs
    ]


def judge(
    checkpoint: str | Path,
    prompts: Sequence[Sequence[int]],
    alone: Sequence[Run],
    together: Sequence[Run],
    device: str = "cpu",
) -> Judgement:
    ref_batch, ref_lone = generated_references(checkpoint, prompts, [together, alone], torch.float32, device)
    [bf16_batch] = generated_references(checkpoint, prompts, [together], torch.bfloat16, device)
    batch = fidelity(ref_batch, observed(together))
    lone = fidelity(ref_lone, observed(alone))
    yardstick = fidelity(ref_batch, as_observed(bf16_batch))
    bound = max(tolerance(lone), tolerance(yardstick))
    problems = []
    if batch.mean_abs > bound:
        problems.append(
            f"the batch's log-probabilities are {batch.mean_abs:.4f} nats from float32 on average, "
            f"more than the bound {bound:.4f} (lone runs {lone.mean_abs:.4f}, transformers-bf16 "
            f"{yardstick.mean_abs:.4f})"
        )
    agreement_floor = min(x for x in (0.99, lone.top1_agreement, yardstick.top1_agreement) if x == x)
    if batch.decisive and batch.top1_agreement < agreement_floor:
        problems.append(
            f"the batch chose float32's token at {batch.top1_agreement:.1%} of {batch.decisive} decisive "
            f"positions, below {agreement_floor:.1%} (lone runs {lone.top1_agreement:.1%}, "
            f"transformers-bf16 {yardstick.top1_agreement:.1%})"
        )
    return Judgement(batch, lone, yardstick, bound, problems)
