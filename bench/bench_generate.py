"""Tokens/s of our vLLM Qwen4-Exp against transformers' ``generate``, same prompts, one run.

Greedy decoding of ``--new-tokens`` tokens for batch 1 and batch 16 on the CPU (bf16). The ratio
is what the README records; absolute numbers depend on the machine.

    .venv/bin/python bench/bench_generate.py --model checkpoints/tiny
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def prompts(tokenizer, n: int) -> list[list[int]]:
    from model.tools.checkpoints import CORPUS

    lines = [line for line in CORPUS.splitlines() if line.strip()]
    return [tokenizer(lines[i % len(lines)])["input_ids"] for i in range(n)]


def bench_transformers(path: str, batch: list[list[int]], new_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    pad = model.config.pad_token_id
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        model.generate(input_ids=ids[:, :4], attention_mask=mask[:, :4], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
    return len(batch) * new_tokens / elapsed


def bench_vllm(llm, batch: list[list[int]], new_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:4]} for p in batch[:1]], params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return len(batch) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/tiny")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    batches = {1: prompts(tokenizer, 1), 16: prompts(tokenizer, 16)}
    hf = {b: bench_transformers(args.model, p, args.new_tokens) for b, p in batches.items()}
    gc.collect()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=1024,
    )
    ours = {b: bench_vllm(llm, p, args.new_tokens) for b, p in batches.items()}
    print(f"\nmodel {args.model}, greedy, {args.new_tokens} new tokens, bf16, CPU ({os.cpu_count()} cores)\n")
    print("| batch | transformers generate (tok/s) | our vLLM model (tok/s) | ratio |")
    print("|---|---|---|---|")
    for b in batches:
        print(f"| {b} | {hf[b]:.1f} | {ours[b]:.1f} | {ours[b] / hf[b]:.1f}x |")


if __name__ == "__main__":
    main()
