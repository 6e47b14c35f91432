"""Prime vLLM's incremental detokenizer with the end of the prompt instead of all of it.

Why: vLLM 0.32's fast detokenizer (``vllm/v1/engine/detokenizer.py:195``) builds tokenizers'
``DecodeStream`` with ``ids=request.prompt_token_ids``, and the stream's first ``step`` decodes that
whole prefix to text before the first generated token has any. That is front-end host time between
the engine's first token and the client's, proportional to the prompt and paid by every request,
cached or not: 6 ms of an 8k-token prefix-cache hit's 49 ms on an H200 host (a torch profile of
the hit), and most of what separated that hit's wall-clock time to first token from
the engine's. ``bench/bench_detokenize_prime.py`` times it here, side by side.

A new token's text is ``decode(prefix + [new])`` minus ``decode(prefix)``; for tokenizers' decoders
(byte-level, byte fallback, metaspace, word-piece) the two decodes differ only at their end, so the
prompt's last ``PRIME_TOKENS`` tokens give the same text as the whole prompt. One exception, measured
(3,000 random prompts, byte-level BPE): where the prompt's text ends inside a UTF-8 character
(``"\ufffd"`` last), tokenizers' stream puts part of the *prompt's* text into the first output
delta, and how much depends on how much prompt it was given; such a prompt keeps vLLM's behaviour
exactly (the whole prompt). ``tests/unit/test_detokenize_prime.py`` checks step by step against
vLLM's own class that the text is the same, with three kinds of tokenizer, random prompts (many
ending inside a character) and special tokens skipped or kept.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

PRIME_TOKENS = 64
_PATCHED = "qwen4exp_primes_with_prompt_tail"


def prime_window(prompt_token_ids: list[int] | None, decode: Callable[[list[int]], str]) -> list[int] | None:
    """The prompt tokens the decode stream starts from: the last ``PRIME_TOKENS``, unless their text
    (``decode``, with the request's special-token setting) ends inside a character; then, like a
    shorter prompt and an embeddings-only one (``None``), what vLLM passes."""
    if prompt_token_ids is None or len(prompt_token_ids) <= PRIME_TOKENS:
        return prompt_token_ids
    window = prompt_token_ids[-PRIME_TOKENS:]
    if decode(window).endswith("\ufffd"):
        return prompt_token_ids
    return window


def install() -> bool:
    """Make ``FastIncrementalDetokenizer`` prime its stream with :func:`prime_window`; idempotent,
    returns whether it patched now. The unpatched constructor stays reachable as
    ``FastIncrementalDetokenizer.qwen4exp_unprimed_init`` (tests and the bench compare both). Fails
    closed on another vLLM minor or a constructor whose parameters changed."""
    import msgspec
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from model.runtime.vllm_fixes import require_vllm_minor

    cls = FastIncrementalDetokenizer
    if getattr(cls, _PATCHED, False):
        return False
    recheck = (
        "re-check model/runtime/detokenize_prime.py against vllm/v1/engine/detokenizer.py (drop it if the "
        "stream is no longer primed with the whole prompt)"
    )
    require_vllm_minor("model.runtime.detokenize_prime", recheck)
    original = cls.__init__
    if list(inspect.signature(original).parameters) != ["self", "tokenizer", "request"]:
        raise RuntimeError(
            f"FastIncrementalDetokenizer(tokenizer, request) changed its parameters: {recheck}"
        )

    @functools.wraps(original)
    def __init__(self, tokenizer, request):
        skip = request.sampling_params.skip_special_tokens
        window = prime_window(
            request.prompt_token_ids, lambda ids: tokenizer._tokenizer.decode(ids, skip_special_tokens=skip)
        )
        if window is not request.prompt_token_ids:
            # A shallow copy for the constructor only: the engine keeps the request as it was.
            request = msgspec.structs.replace(request, prompt_token_ids=window)
        original(self, tokenizer, request)

    cls.__init__ = __init__
    cls.qwen4exp_unprimed_init = original
    setattr(cls, _PATCHED, True)
    return True
