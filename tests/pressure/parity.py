"""Comparing a request's greedy run under preemption with its lone run, on plain data (token ids
and per-position ``{token: logprob}``) so the CPU test and the GPU child share it.

"Exactly the tokens" holds up to bf16 numerics: a recomputed request runs its prompt and the
tokens it had generated as one prefill, where its lone run decoded them step by step, and the two
paths differ in the last bits (e.g. GDN's chunked prefill against its recurrent decode). Measured
on the tiny checkpoint (CPU): a fresh prefill of a lone run's first 39 tokens gives logprobs within
0.03 of the decoded ones, except at an exact tie (two tokens at -2.4007) that it breaks the other
way. So a request passes with the same tokens, or with a first difference at a near-tie of its
lone run (the batch's token within ``NEAR_TIE`` nats of the lone run's choice), the chosen tokens'
logprobs before that point within ``DRIFT`` of the lone run's. A request resumed from a stale or a
foreign state misses both by a wide margin.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DRIFT = 0.15  # nats, chosen token's logprob, batch vs lone run, before any difference
NEAR_TIE = 0.25  # nats below the lone run's choice that the batch's different token may rank
TOP = 5  # logprobs kept per position

Run = tuple[list[int], list[dict[int, float]]]  # token ids, {token: logprob} per position


@dataclass
class Verdict:
    drift: float  # largest |logprob difference| of the chosen tokens while both runs agree
    first_difference: int | None  # position of the first different token
    below_top: float  # how far below the lone run's choice it ranks the batch's token there


def compare(alone: Run, together: Run) -> Verdict:
    (a, a_lp), (t, t_lp) = alone, together
    drift, k = 0.0, 0
    while k < len(a) and a[k] == t[k]:
        drift = max(drift, abs(a_lp[k][a[k]] - t_lp[k][a[k]]))
        k += 1
    if k == len(a):
        return Verdict(drift, None, 0.0)
    below = a_lp[k][a[k]] - a_lp[k][t[k]] if t[k] in a_lp[k] else float("inf")
    return Verdict(drift, k, below)


def problems(
    verdicts: list[Verdict], max_differing: int, recompute_drift: list[float] | None = None
) -> list[str]:
    """Why these verdicts fail the parity criterion (empty: they pass). ``recompute_drift``: per
    request, how far recomputing its lone run's tokens as one prefill (no preemption) moved their
    logprobs in the same engine; each request's bound grows by that much."""
    out = []
    for i, v in enumerate(verdicts):
        bound = DRIFT + (recompute_drift[i] if recompute_drift else 0.0)
        if v.drift >= bound:
            out.append(
                f"request {i}: logprobs drifted {v.drift:.3f} nats from its lone run (bound {bound:.3f})"
            )
        if v.below_top >= NEAR_TIE:
            out.append(
                f"request {i}: at token {v.first_difference} the batch chose a token {v.below_top:.3f} "
                "nats below the lone run's choice: not a near-tie"
            )
    differing = sum(v.first_difference is not None for v in verdicts)
    if differing > max_differing:
        out.append(f"{differing} of {len(verdicts)} requests differ from their lone runs")
    return out


def summary(verdicts: list[Verdict]) -> str:
    differing = [
        (i, v.first_difference, round(v.below_top, 4))
        for i, v in enumerate(verdicts)
        if v.first_difference is not None
    ]
    return (
        f"{len(verdicts) - len(differing)} identical, max logprob drift "
        f"{max(v.drift for v in verdicts):.4f}; differing at near-ties (request, position, nats): {differing}"
    )


def prompts_near_block_end(block: int, vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that end 25-60 tokens before a block boundary: decoding crosses it soon."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(block - rng.randrange(25, 61))] for _ in range(count)]


def recompute_drift(llm, prompts: list[list[int]], alone: list[Run]) -> list[float]:
    """Per request, how far recomputing its lone run's tokens as one prefill (what a preempted
    request goes through), with no preemption and an empty prefix cache, moves the chosen tokens'
    logprobs in the same engine: the bf16 noise of recomputation alone, which a request resumed
    from a wrong state exceeds by far."""
    from vllm import SamplingParams

    control = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP)
    drift = []
    for p, (tokens, lps) in zip(prompts, alone, strict=True):
        llm.reset_prefix_cache()
        (out,) = llm.generate([{"prompt_token_ids": p + tokens}], control, use_tqdm=False)
        full = out.prompt_logprobs
        drift.append(max(abs(full[len(p) + k][t].logprob - lps[k][t]) for k, t in enumerate(tokens)))
    return drift


def plain(output) -> Run:
    """A vLLM ``CompletionOutput`` (with logprobs) as plain data."""
    return list(output.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in output.logprobs]
