"""Front-end time to a long prompt's first token text: vLLM's detokenizer primed with the whole prompt
vs with its last tokens (``model.runtime.detokenize_prime``), side by side in one run.

What is timed is what vLLM's output processor does when the first token comes back: build the
request's ``FastIncrementalDetokenizer`` and ``update`` it with that token. Random-id prompts
(``--lengths``), the best of ``--repeats`` per cell; the texts of both are compared, so a fast wrong
answer cannot pass.

    .venv/bin/python bench/bench_detokenize_prime.py --tokenizer checkpoints/tiny
"""

from __future__ import annotations

import argparse
import os
import random
import time


def first_token_seconds(tokenizer, prompt: list[int], token: int, primed: bool) -> tuple[float, str]:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    request = EngineCoreRequest("b", prompt, None, SamplingParams(max_tokens=1), None, 0.0, None, None, None)
    init = (
        FastIncrementalDetokenizer.__init__ if primed else FastIncrementalDetokenizer.qwen4exp_unprimed_init
    )
    start = time.perf_counter()
    detok = FastIncrementalDetokenizer.__new__(FastIncrementalDetokenizer)
    init(detok, tokenizer, request)
    detok.update([token], stop_terminated=False)
    return time.perf_counter() - start, detok.output_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="checkpoints/tiny")
    parser.add_argument("--lengths", default="1024,8192,32768", help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from vllm.tokenizers import get_tokenizer

    from model.runtime import detokenize_prime

    detokenize_prime.install()
    tokenizer = get_tokenizer(args.tokenizer)
    rng = random.Random(0)
    words = tokenizer.encode("The cache stores eight bit floats with a scale from calibration. " * 8)
    print(
        f"tokenizer {args.tokenizer} (vocabulary {len(tokenizer)}), {os.cpu_count()} cores, best of "
        f"{args.repeats}; window {detokenize_prime.PRIME_TOKENS} tokens\n"
    )
    print("| prompt tokens | whole prompt (ms) | last tokens (ms) | ratio | same text |")
    print("|---|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        # Text-like ids (repeated words) so the prompt ends on a whole character, as real prompts do.
        prompt = [words[rng.randrange(len(words))] for _ in range(length)]
        token = words[0]
        times: dict[bool, float] = {}
        texts: dict[bool, str] = {}
        for _ in range(args.repeats):
            for primed in (False, True):  # alternating, so both meet the same machine state
                seconds, texts[primed] = first_token_seconds(tokenizer, prompt, token, primed)
                times[primed] = min(times.get(primed, seconds), seconds)
        print(
            f"| {length} | {times[False] * 1e3:.3f} | {times[True] * 1e3:.3f} | "
            f"{times[False] / times[True]:.0f}x | {'yes' if texts[False] == texts[True] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
