"""A request that vLLM preempts and recomputes gives exactly the tokens it gives alone.

Qwen4-Exp keeps per-request state beside the attention pages: GDN recurrent and conv states, the
PLE n-gram/conv state, the QSA index-key cache and, with the FP8 cache, E4M3 codes. When the KV
cache runs out vLLM preempts a running request, frees all of its blocks and later recomputes it
from its tokens; every one of those states must then be rebuilt from scratch, not read from a
freed (and meanwhile reused) block.

Tokens are compared as ``tests.pressure.parity`` explains: equal, or first different at a
near-tie of the lone run with the logprobs before it within bf16 noise (a recompute runs as one
prefill what the lone run decoded step by step); at most a quarter of the requests may differ.

Each case starts one engine with a pool of 20 KV blocks (``num_gpu_blocks_override``): three
requests fit at admission (five state blocks and one attention block each), and every prompt is
25-60 tokens short of a block boundary, so the running requests all need one more block a few
decode steps in, and the scheduler must preempt. Every request first runs alone (no pressure),
then all together; vLLM's preemption counter must have moved and every request must pass the
comparison above, its drift bound widened by what recomputation alone moves its logprobs in the same
engine (``parity.recompute_drift``: its lone run's tokens as one prefill, no preemption). The
widening is per request and measured, so it follows the host's kernels (AVX2 hosts keep the GDN
state in bf16, AVX512-BF16 hosts in float32) and the checkpoint generated there, while a request
resumed from a wrong state still misses it by far. Cases: prefix caching off, on (align mode: states saved per block), and
the FP8 QSA cache with prefix caching on.
"""

from __future__ import annotations

import pytest

from tests.conftest import ensure_checkpoint
from tests.qsa_kv.helpers import QSA_ENV, patched_env
from tests.vllm_greedy import in_process_engine, shut_down

from .parity import TOP, compare, plain, problems, prompts_near_block_end, recompute_drift, summary

NUM_BLOCKS = 20
REQUESTS = 10
MAX_NEW_TOKENS = 64

CASES = {
    "prefix-off": dict(enable_prefix_caching=False),
    "prefix-on": dict(enable_prefix_caching=True),
    "fp8-qsa-prefix-on": dict(enable_prefix_caching=True, kv_cache_dtype="fp8"),
}


def preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


@pytest.mark.parametrize("case", list(CASES))
def test_preempted_requests_match_their_lone_runs(case: str, capsys) -> None:
    from vllm import LLM, SamplingParams

    path = ensure_checkpoint("tiny")
    with in_process_engine():
        with patched_env(**dict.fromkeys(QSA_ENV)):  # FP8: scales 1.0, no sidecar, nothing collected
            llm = LLM(
                model=str(path),
                dtype="bfloat16",
                enforce_eager=True,
                max_model_len=1024,
                seed=0,
                num_gpu_blocks_override=NUM_BLOCKS,
                disable_log_stats=False,  # the preemption counter
                **CASES[case],
            )
        try:
            config = llm.llm_engine.vllm_config
            block = config.cache_config.block_size
            prompts = prompts_near_block_end(block, config.model_config.get_vocab_size(), REQUESTS)
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=TOP)
            alone = []
            for ids in prompts:
                (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                alone.append(plain(out.outputs[0]))
            before = preemptions(llm)
            outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
            preempted = preemptions(llm) - before
            together = [plain(o.outputs[0]) for o in outs]
            cached = sum(o.num_cached_tokens or 0 for o in outs)
            control = recompute_drift(llm, prompts, alone)
        finally:
            shut_down(llm)
            del llm  # freed when the block collects on leaving
    verdicts = [compare(a, t) for a, t in zip(alone, together, strict=True)]
    with capsys.disabled():
        print(
            f"\n[pressure] preemption parity {case}: {REQUESTS} requests x {MAX_NEW_TOKENS} tokens, "
            f"{NUM_BLOCKS} KV blocks of {block} tokens, {preempted:.0f} preemptions, "
            f"{cached} prompt tokens from the prefix cache; {summary(verdicts)}; recomputing each lone "
            f"run as one prefill, no preemption: drift {[round(d, 3) for d in control]}"
        )
    assert preempted > 0, "the batch never ran out of KV blocks: the test exercised nothing"
    failed = problems(verdicts, REQUESTS // 4, recompute_drift=control)
    assert not failed, failed
