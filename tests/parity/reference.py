"""Greedy decoding with transformers' Qwen4-Exp, the reference the vLLM model must match.

A plain loop over the model with its cache (prefill, then one token per step) rather than
``generate``: it never stops at EOS and applies no logits processors, exactly like vLLM's greedy
sampling with ``ignore_eos``.
"""

from __future__ import annotations

import torch


def load_reference(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    return model


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and, per step, the full next-token log-probabilities (for near-tie checks)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
    out: list[int] = []
    logprobs: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        step = logits[0, -1].float().log_softmax(-1)
        token = int(step.argmax())
        out.append(token)
        logprobs.append(step)
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
    return out, logprobs
