"""Teacher-forced fidelity: how far an engine's next-token log-probabilities are from the model's.

Greedy tokens of random-weight or briefly trained checkpoints hide precision loss behind decisive
margins (or flip at near-ties that say nothing). This measure does not: at every prompt position it
takes the log-probability the engine gives the prompt's actual next token (vLLM's
``prompt_logprobs``) and compares it with transformers' Qwen4Exp run in float32 on the same weights.
Reported per prompt and pooled: the mean and 99th percentile of |delta| in nats, and top-1 agreement
on decisive positions (float32 margin between the two best logits above ``DECISIVE_MARGIN``).
transformers' own bfloat16 run, measured the same way, is the yardstick: an engine computing in
bf16 cannot be expected to be closer than that, and should not be much farther.
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DECISIVE_MARGIN = 0.1  # logits; below this the float32 argmax itself is a near-tie
# An engine passes when its pooled mean |delta| is at most this multiple of transformers-bf16's on the
# same prompts, plus a floor that keeps near-exact yardsticks (tiny models, short prompts) meaningful.
TOLERANCE_RATIO = 1.25
TOLERANCE_FLOOR_NATS = 0.005


@dataclass
class Reference:
    """Float32 facts at every prompt position but the last: the actual next token's log-prob, the
    argmax token and the margin between the two largest logits."""

    logprobs: torch.Tensor
    argmax: torch.Tensor
    margin: torch.Tensor


@dataclass
class Observed:
    """What a model under test gave at the same positions: the actual token's log-prob and its top-1."""

    logprobs: torch.Tensor
    top1: torch.Tensor


@dataclass
class Fidelity:
    positions: int
    mean_abs: float
    p99_abs: float
    decisive: int
    top1_agreement: float

    def as_row(self) -> str:
        return (
            f"{self.mean_abs:.4f} / {self.p99_abs:.3f} / {100 * self.top1_agreement:.0f}% of {self.decisive}"
        )


def prompts_of_lengths(tokenizer_dir: str | Path, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Deterministic prompts of the given token counts: the checkpoint tokenizer's text of the built-in
    corpus, shuffled by sentence and salted with random tokens (so long prompts do not repeat exactly)."""
    from transformers import AutoTokenizer

    from model.tools.checkpoints import CORPUS

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    sentences = [s.strip() + "." for s in CORPUS.replace("\n", " ").split(".") if s.strip()]
    rng = random.Random(seed)
    vocab = len(tok)
    out = []
    for length in lengths:
        ids: list[int] = []
        while len(ids) < length:
            rng.shuffle(sentences)
            ids += tok(" ".join(sentences), add_special_tokens=False)["input_ids"]
            ids += [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 8))]
        out.append(ids[:length])
    return out


def repeated_prompts(tokenizer_dir: str | Path, lengths: Sequence[int]) -> list[list[int]]:
    """Prompts of the given token counts whose natural text repeats exactly: the built-in corpus in
    its own order, over and over. Later copies are predictable, and a near-tie (a router, a gate) at
    one position recurs at every copy, so an engine that rounds it the other way than float32 is
    wrong at every copy instead of once: salted prompts average such a loss away, these do not."""
    from transformers import AutoTokenizer

    from model.tools.checkpoints import CORPUS

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = " ".join(CORPUS.split())
    copy = tok(text + " ", add_special_tokens=False)["input_ids"]
    return [(copy * (length // len(copy) + 1))[:length] for length in lengths]


@torch.inference_mode()
def transformers_token_logprobs(
    checkpoint: str | Path, prompts: Sequence[Sequence[int]], dtype: torch.dtype, device: str = "cpu"
) -> list[Reference]:
    """transformers' Qwen4Exp, teacher-forced over each prompt in ``dtype`` (the reference in float32,
    the yardstick in bfloat16); log-softmax taken in float32 either way."""
    from transformers import Qwen4ExpForCausalLM

    model = Qwen4ExpForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).to(device).eval()
    refs = []
    try:
        for ids in prompts:
            x = torch.tensor([list(ids)], device=device)
            logits = model(input_ids=x).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            top2 = logits.topk(2, dim=-1).values
            refs.append(
                Reference(
                    logprobs=logp.gather(1, x[0, 1:, None])[:, 0].cpu(),
                    argmax=logits.argmax(-1).cpu(),
                    margin=(top2[:, 0] - top2[:, 1]).cpu(),
                )
            )
    finally:
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return refs


def bf16_noise(checkpoint: str | Path, sequences: Sequence[Sequence[int]]) -> list[float]:
    """Per sequence: the 99th percentile, over its positions, of |transformers-bf16 - float32| in the
    log-prob of the actual next token, teacher-forced on the CPU. How far bf16 alone moves a
    log-prob on this checkpoint, this text and this host's kernels: two tokens closer than this are
    a tie that any bf16 engine may break either way."""
    r32 = transformers_token_logprobs(checkpoint, sequences, torch.float32)
    r16 = transformers_token_logprobs(checkpoint, sequences, torch.bfloat16)
    out = []
    for a, b in zip(r32, r16, strict=True):
        d = (a.logprobs - b.logprobs).abs()
        out.append(float(d.quantile(0.99)) if d.numel() > 1 else float(d.sum()))
    return out


def as_observed(refs: Sequence[Reference]) -> list[Observed]:
    """A reference run seen as a model under test (for the bf16 yardstick)."""
    return [Observed(logprobs=r.logprobs, top1=r.argmax) for r in refs]


def vllm_token_logprobs(llm, prompts: Sequence[Sequence[int]]) -> list[Observed]:
    """The engine's log-prob of each prompt's actual next token and its own top-1, from
    ``prompt_logprobs=1`` (vLLM returns the actual token and the rank-1 token at each position)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    observed = []
    for ids, out in zip(prompts, outs, strict=True):
        lps, top1 = [], []
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            actual = entry[ids[pos]]
            lps.append(actual.logprob)
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
        observed.append(Observed(torch.tensor(lps), torch.tensor(top1)))
    return observed


def fidelity(refs: Sequence[Reference], observed: Sequence[Observed]) -> Fidelity:
    """Pooled statistics of ``observed`` against the float32 ``refs`` over every position."""
    deltas, agree, decisive = [], 0, 0
    for ref, obs in zip(refs, observed, strict=True):
        if obs.logprobs.shape != ref.logprobs.shape:
            raise ValueError(
                f"{obs.logprobs.shape[0]} positions observed, {ref.logprobs.shape[0]} in the reference"
            )
        deltas.append((obs.logprobs.float() - ref.logprobs.float()).abs())
        mask = ref.margin > DECISIVE_MARGIN
        decisive += int(mask.sum())
        agree += int((obs.top1[mask] == ref.argmax[mask]).sum())
    d = torch.cat(deltas)
    if not torch.isfinite(d).all():
        raise ValueError("non-finite log-probabilities")
    return Fidelity(
        positions=int(d.numel()),
        mean_abs=float(d.mean()),
        p99_abs=float(d.quantile(0.99)) if d.numel() > 1 else float(d.max()),
        decisive=decisive,
        top1_agreement=agree / decisive if decisive else math.nan,
    )


def tolerance(yardstick: Fidelity) -> float:
    """The largest pooled mean |delta| an engine may have, given transformers-bf16's on the same prompts."""
    return TOLERANCE_RATIO * yardstick.mean_abs + TOLERANCE_FLOOR_NATS


def as_dict(f: Fidelity) -> dict:
    return asdict(f)
