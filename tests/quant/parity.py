"""Greedy tokens of a quantized checkpoint against its dequantized-bf16 twin, both through vLLM.

Shared by the CPU parity test and the CUDA (Marlin) one. The twin holds exactly the values the
quantized kernels dequantize to (power-of-two scales), so the two engines differ only in how the
kernels accumulate; a divergence is accepted only at a near-tie of the twin: of its next-token
log-probabilities, or (given the twin's path) of an MoE router's top-k choice at that position.

Why router ties: routing is discontinuous. When the k-th and (k+1)-th router logits of some layer
are closer than the two engines' rounding differences, the two pick different experts there and the
next token can change completely, with no near-tie in the output at all. Measured on the H200:
``fp8-experts`` of ``qsa512`` through upstream diverged at ``chat`` token 3 in four runs, the
quantized token outside the twin's top 5, while tokens 0-2 matched to 0.02 nats; transformers on
the twin puts a 0.0023-logit gap at layer 1's top-k boundary exactly at that position (the next
smallest there: 0.04), and with that tie taken the other way the twin's next tokens are the
quantized engine's (356, 286, 85 at -0.44, -1.94, -3.78; the engine: -0.45, -1.89, -3.86).
"""

from __future__ import annotations

import gc
from pathlib import Path

TIE_LOGPROB = 0.05
# Router logits closer than this at the top-k boundary are a tie (logit units; the smallest gap
# seen to flip between Marlin and Triton experts was 0.0023, one seen not to flip 0.0047).
ROUTER_TIE_LOGITS = 0.01


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


def router_margin(model, ids: list[int]) -> tuple[float, str]:
    """At the last position of ``ids``: the smallest gap, over the MoE layers of a transformers
    Qwen4-Exp ``model``, between the k-th and (k+1)-th router logits (fp32 from the router's own
    input), and the layer it is in."""
    import torch

    gaps: list[tuple[float, str]] = []

    def record(name):
        def hook(module, args, _out):
            x = args[0].reshape(-1, args[0].shape[-1])[-1].float()
            logits = torch.sort(x @ module.weight.float().t(), descending=True).values
            gaps.append((float(logits[module.top_k - 1] - logits[module.top_k]), name))

        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    if not gaps:
        raise ValueError("no MoE router (mlp.gate) in the model")
    return min(gaps)


class RouterTies:
    """:func:`router_margin` of the twin's transformers reference, loaded on first use (CPU, bf16)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.model = None

    def margin(self, ids: list[int]) -> tuple[float, str]:
        if self.model is None:
            import torch
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.bfloat16).eval()
        return router_margin(self.model, ids)


def compare(
    got: dict, want: dict, *, prompts: dict[str, list[int]] | None = None, twin: str | Path | None = None
) -> list[str]:
    """Problems (empty when the quantized run matches the twin up to near-ties).

    With ``prompts`` and ``twin`` (the twin's checkpoint), an output near-tie is anything closer
    than what bf16 alone moves a log-prob on that prompt (``measure.bf16_noise`` of the twin, when
    above :data:`TIE_LOGPROB`), and a divergence that is no output near-tie is still accepted, and
    printed, where the twin's router has a top-k tie at that position (:data:`ROUTER_TIE_LOGITS`)."""
    problems, ties = [], 0
    routers = RouterTies(twin) if twin is not None and prompts is not None else None
    for name, (ref, ref_lp) in want.items():
        tokens = got[name][0]
        i = next((j for j, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), None)
        if i is None:
            continue
        gap = ref_lp[i][ref[i]] - ref_lp[i].get(tokens[i], float("-inf"))
        if gap <= TIE_LOGPROB:
            ties += 1
            continue
        if routers is not None:
            from tests.fidelity.measure import bf16_noise

            (noise,) = bf16_noise(twin, [list(prompts[name]) + list(ref)])
            if gap <= noise:
                print(
                    f"{name}: token {i} differs at a near-tie ({gap:.3f} nats; bf16 moves {noise:.3f} here)"
                )
                ties += 1
                continue
            margin, layer = routers.margin(list(prompts[name]) + list(ref[:i]))
            if margin < ROUTER_TIE_LOGITS:
                print(f"{name}: token {i} differs at a router tie ({layer}: top-k gap {margin:.4f} logits)")
                ties += 1
                continue
        problems.append(
            f"{name}: token {i} differs (twin prefers its token by {gap:.3f} nats)\n  q  ={tokens}\n  deq={ref}"
        )
    if ties > len(want) // 4:
        problems.append(f"{ties} prompts ended in near-ties: the checkpoint is too undecided to compare")
    return problems
