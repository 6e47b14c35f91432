"""Greedy tokens of a quantized checkpoint against its dequantized-bf16 twin, both through vLLM.

Shared by the CPU parity test and the CUDA (Marlin) one. The twin holds exactly the values the
quantized kernels dequantize to (power-of-two scales), so the two engines differ only in how the
kernels accumulate; a divergence is accepted only at an exact near-tie of the twin.
"""

from __future__ import annotations

import gc

TIE_LOGPROB = 0.05


def greedy_with_logprobs(
    path, prompts: dict[str, list[int]], max_new_tokens: int, on_engine=None, **engine_args
):
    """Per prompt: greedy tokens and, per step, the top-5 log-probabilities ``{token: logprob}``.

    ``on_engine(llm)``, if given, runs once the engine has started (e.g. to record its kernels)."""
    from vllm import LLM, SamplingParams

    args = dict(dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False, max_model_len=2048, seed=0)
    llm = LLM(model=str(path), **{**args, **engine_args})
    try:
        if on_engine is not None:
            on_engine(llm)
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts.values()], params, use_tqdm=False)
        result = {}
        for name, out in zip(prompts, outs, strict=True):
            steps = [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]
            result[name] = (list(out.outputs[0].token_ids), steps)
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def compare(got: dict, want: dict) -> list[str]:
    """Problems (empty when the quantized run matches the twin up to near-ties)."""
    problems, ties = [], 0
    for name, (ref, ref_lp) in want.items():
        tokens = got[name][0]
        i = next((j for j, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), None)
        if i is None:
            continue
        gap = ref_lp[i][ref[i]] - ref_lp[i].get(tokens[i], float("-inf"))
        if gap <= TIE_LOGPROB:
            ties += 1
            continue
        problems.append(
            f"{name}: token {i} differs (twin prefers its token by {gap:.3f} nats)\n  q  ={tokens}\n  deq={ref}"
        )
    if ties > len(want) // 4:
        problems.append(f"{ties} prompts ended in near-ties: the checkpoint is too undecided to compare")
    return problems
