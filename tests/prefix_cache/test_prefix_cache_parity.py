"""Prefix caching on vLLM's CPU build: greedy tokens with cache hits equal those without, and
transformers' (bf16, token for token).

With prefix caching on, vLLM runs hybrid models in its "align" Mamba cache mode: a request's GDN
and PLE states move to a new block at every block boundary and a hit resumes from the state saved
at the hit's last block. Our QSA layer keeps every token's raw index key in its paged cache, so a
hit needs nothing recomputed there (block keys are pooled from the cache each step). The prompts
share a prefix several scheduler blocks long, and each request runs alone so the next one can hit
the blocks it left; every request that should hit asserts that it did (a run with zero hits would
prove nothing):

* the same prompt twice, and the shared prefix with different suffixes (hits on block boundaries);
* with ``prefix_match_unit=2`` (vLLM's sub-block hits), a prompt that extends an earlier one, like
  a second chat turn: the hit ends at the earlier prompt's last even position, chosen to fall
  inside a QSA compression block (position not a multiple of the ratio) and, as every hit does,
  inside a PLE n-gram window and dilated-conv history that the new tokens read from the state.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import ensure_checkpoint
from tests.parity.prompts import SENTENCES
from tests.parity.reference import greedy, load_reference
from tests.parity.test_generation_parity import assert_same
from tests.vllm_greedy import in_process_engine, shut_down

MAX_NEW_TOKENS = 16
PREFIX_LEN = 768


def run_in_order(path, prompts: dict[str, list[int]], **engine_args) -> tuple[dict, dict, int]:
    """Greedy tokens and cached-token counts per prompt, one request at a time (in dict order),
    and the engine's scheduler block size."""
    from vllm import LLM, SamplingParams

    args = dict(dtype="bfloat16", enforce_eager=True, max_model_len=2048, seed=0)
    with in_process_engine():
        llm = LLM(model=str(path), **{**args, **engine_args})
        try:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
            tokens, cached = {}, {}
            for name, ids in prompts.items():
                (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                tokens[name] = list(out.outputs[0].token_ids)
                cached[name] = out.num_cached_tokens or 0
            return tokens, cached, llm.llm_engine.vllm_config.cache_config.block_size
        finally:
            shut_down(llm)


@pytest.fixture(scope="module")
def case():
    from transformers import AutoTokenizer

    path = ensure_checkpoint("tiny")
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    enc = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    # 768 tokens: three 256-token or six 128-token scheduler blocks (vLLM's CPU build picks 128 on
    # AVX2 hosts and 256 on AVX512-BF16 ones, whose conv-state layout pads pages differently). A
    # multiple of 256 on purpose: in align mode vLLM keeps a request's state only at the last block
    # boundary it reached, so a later request sharing only the prefix can resume there only if no
    # boundary lies inside the first request's suffix.
    text = " ".join(SENTENCES[i % len(SENTENCES)] for i in (2, 7, 0, 9, 4, 1, 8, 3, 6, 5) * 3)
    # A document boundary just before the suffixes: PLE n-grams must restart at EOS after a hit too.
    prefix = enc(text)[: PREFIX_LEN - 1] + [eos]
    assert len(prefix) == PREFIX_LEN
    first = prefix + enc(SENTENCES[1])
    # Length 4m + 3: with 2-token hash blocks the first turn's saved state ends at 4m + 2, inside a
    # compression block of 4.
    ratio = config["indexer_compress_ratio"]
    assert ratio == 4
    first = first[: len(first) - (len(first) - 3) % 4]
    prompts = {
        "first": first,
        "again": list(first),
        "other_suffix": prefix + enc(SENTENCES[6]),
        "short_suffix": prefix + enc("Once"),
        "second_turn": first + [eos] + enc(SENTENCES[3]),
    }
    model = load_reference(path)
    expected = {name: greedy(model, ids, MAX_NEW_TOKENS) for name, ids in prompts.items()}
    del model
    off, off_cached, _ = run_in_order(path, prompts, enable_prefix_caching=False)
    assert not any(off_cached.values())
    return path, prompts, expected, off, ratio


def check(got: dict, off: dict, expected: dict) -> None:
    assert_same(got, expected)
    differs = [n for n in got if got[n] != off[n] and expected[n][0] in (got[n], off[n])]
    assert not differs, f"prefix caching on/off differ where one of them equals the reference: {differs}"


def test_block_hits_match_off_and_reference(case):
    path, prompts, expected, off, _ = case
    got, cached, block = run_in_order(path, prompts, enable_prefix_caching=True)
    assert cached["first"] == 0
    for name in ("again", "other_suffix", "short_suffix", "second_turn"):
        assert cached[name] >= 2 * block, f"{name}: {cached[name]} cached tokens, expected a hit"
        assert cached[name] % block == 0
    check(got, off, expected)


def test_sub_block_hit_inside_compression_block(case):
    path, prompts, expected, off, ratio = case
    got, cached, block = run_in_order(path, prompts, enable_prefix_caching=True, prefix_match_unit=2)
    assert cached["again"] > 0 and cached["other_suffix"] > 0
    # The second turn resumes from the first turn's last saved state, mid-block.
    assert cached["second_turn"] == len(prompts["first"]) - 1, cached
    assert cached["second_turn"] % ratio != 0 and cached["second_turn"] % block != 0
    check(got, off, expected)


def test_fp8_cache_hits_match_a_cold_fp8_engine(case):
    """The FP8 QSA cache (the RTX 3090's) with prefix caching: a hit reads the E4M3 codes an earlier
    request wrote and must give the tokens of an FP8 engine without caching (scales 1.0, no sidecar:
    both engines quantise alike, so the caches hold the same codes)."""
    from tests.qsa_kv.helpers import QSA_ENV, patched_env

    path, prompts, _, _, _ = case
    with patched_env(**dict.fromkeys(QSA_ENV)):
        off, off_cached, _ = run_in_order(path, prompts, enable_prefix_caching=False, kv_cache_dtype="fp8")
        got, cached, block = run_in_order(path, prompts, enable_prefix_caching=True, kv_cache_dtype="fp8")
    assert not any(off_cached.values())
    assert cached["first"] == 0
    for name in ("again", "other_suffix", "short_suffix", "second_turn"):
        assert cached[name] >= 2 * block, f"{name}: {cached[name]} cached tokens, expected a hit"
    differs = {name: (got[name], off[name]) for name in prompts if got[name] != off[name]}
    assert not differs, f"FP8 cache hits differ from a cold FP8 engine: {differs}"
