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
def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].float().argmax())
        out.append(token)
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
    return out
