"""Prefix caching on vLLM's CUDA build: greedy tokens with cache hits equal transformers' (on the GPU).

The CPU suite (``tests/prefix_cache``) proves the hybrid layout's hits on vLLM's CPU build; this is
the same claim on CUDA, where vLLM picks its own scheduler block size for the hybrid page layout
(often far larger than the CPU's 128 tokens, which is why the shared prefix here is several
thousand tokens long). Requests run one at a time so each can hit the blocks the previous one left;
every request that should hit asserts that it did, and the tokens are held to the reference by the
parity tests' rule (divergence only at the reference's exact near-ties).
"""

from __future__ import annotations

import pytest

from tests.conftest import ensure_checkpoint
from tests.parity.prompts import SENTENCES
from tests.parity.test_generation_parity import assert_same
from tests.prefix_cache.test_prefix_cache_parity import run_in_order

from .engine import cuda_engine_args
from .test_engine_parity import REF_DEVICE, reference_greedy

pytestmark = pytest.mark.vllm_cuda
PREFIX_LEN = 2560


def test_prefix_hits_on_cuda_match_reference():
    from transformers import AutoTokenizer

    path = ensure_checkpoint("tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    enc = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    # 2,560 tokens: a multiple of every scheduler block size seen (80 on the H200, 128/256 on CPUs). In
    # align mode vLLM keeps a request's state only at the last block boundary it reached, so a request
    # sharing only the prefix can resume there only if no boundary falls inside the first one's
    # suffix (at 3,500 tokens and 80-token blocks ``other_suffix`` got no hit on the H200).
    prefix = enc(" ".join(SENTENCES[(7 * i) % len(SENTENCES)] for i in range(160)))[: PREFIX_LEN - 1] + [eos]
    assert len(prefix) == PREFIX_LEN
    first = prefix + enc(SENTENCES[1])
    prompts = {
        "first": first,
        "again": list(first),
        "other_suffix": prefix + enc(SENTENCES[6]),
        "second_turn": first + [eos] + enc(SENTENCES[3]),
    }
    expected = reference_greedy(path, prompts, REF_DEVICE)
    got, cached, block = run_in_order(
        path, prompts, **cuda_engine_args(enable_prefix_caching=True, max_model_len=4096)
    )
    print(
        f"CUDA prefix caching: block size {block}, cached tokens {cached}, prompt lengths "
        f"{ {n: len(p) for n, p in prompts.items()} }"
    )
    assert cached["first"] == 0
    for name in ("again", "other_suffix", "second_turn"):
        assert cached[name] >= block, f"{name}: {cached[name]} cached tokens (block {block}), expected a hit"
    # run_in_order generates tests/prefix_cache's 16 tokens; the reference generates the parity length.
    assert_same(got, {n: (t[: len(got[n])], lps[: len(got[n])]) for n, (t, lps) in expected.items()})
