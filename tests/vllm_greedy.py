"""Greedy generation through vLLM's engine, the way every engine-level test starts one."""

from __future__ import annotations

import gc


def greedy_vllm(
    path, prompts: dict[str, list[int]], max_new_tokens: int, **engine_args
) -> dict[str, list[int]]:
    """Greedy tokens per prompt (never stopping at EOS); the engine is shut down before returning."""
    from vllm import LLM, SamplingParams

    args = dict(dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False, max_model_len=2048, seed=0)
    llm = LLM(model=str(path), **{**args, **engine_args})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts.values()], params, use_tqdm=False
        )
        return {name: list(out.outputs[0].token_ids) for name, out in zip(prompts, outputs, strict=True)}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
