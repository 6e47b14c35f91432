"""Diagnosis of a W4A16 pair that differs from its dequantized twin on CUDA (tests/gpu/test_quant_marlin).

For one prompt (``--prompt``, default the failing ``chat``) this prints the top-5 log-probabilities
of the first generated tokens from: the quantized checkpoint batched with the other parity prompts
and alone, the bf16 twin batched and alone, and transformers on the twin (bf16, same GPU). Which
rows agree says whether the difference depends on the batch (kernel paths that change with the
number of tokens) and which engine is off the reference. Each engine takes the RTX 3090's (sm_86)
kernels on the H200 (``SM86_ENV``, ``sm86_engine_args`` in ``tests/gpu/test_quant_marlin.py``, which
say why) and prints the kernel each layer family ran (``kernel_record``) with any departure from the
3090's. ``--group-size 32`` is the control for vLLM 0.32's Marlin-MoE w13 scale permutation bug
(see that test's docstring): 64-wide groups hit it on tiny, 32-wide do not.

    PYTHONPATH=$PWD:/tmp/site python3 bench/gpu_marlin_probe.py --scope experts [--group-size 32]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("QWEN4EXP_CUDA_MODEL", "ours")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
# As tests/gpu/conftest.py: without it the engine core is forked from a process that has imported
# torch and built checkpoints, and on the H200 the first engine start hung (twice, 4 minutes each).
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
# The 3090's kernels (and LLM.apply_model), as the test sets them; see SM86_ENV there.
os.environ.setdefault(
    "VLLM_DISABLED_KERNELS", "CutlassW4A8LinearKernel,MacheteLinearKernel,HummingLinearKernel"
)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def top5(step: dict[int, float]) -> str:
    return " ".join(f"{t}:{lp:.3f}" for t, lp in sorted(step.items(), key=lambda kv: -kv[1])[:5])


def main() -> None:
    import torch

    from model.quantize import convert_checkpoint
    from tests.conftest import ensure_checkpoint
    from tests.gpu.engine import cuda_engine_args
    from tests.gpu.test_quant_marlin import SM86_ENV, generate_with_kernels, kernel_problems, sm86_engine_args
    from tests.parity.prompts import parity_prompts

    print("env:", {k: os.environ.get(k) for k in SM86_ENV}, flush=True)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--scope", default="experts")
    p.add_argument("--prompt", default="chat")
    p.add_argument("--group-size", type=int, default=None, help="int4 group (default: the converter's)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="/tmp/marlin_probe")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = ensure_checkpoint(args.preset)
    conv = dict(scope=args.scope, group_size=args.group_size, scales="pow2")
    q = convert_checkpoint(src, f"{args.out}/q", "w4a16", **conv)
    deq = convert_checkpoint(src, f"{args.out}/deq", "w4a16", **conv, dequantized=True)
    prompts = parity_prompts(AutoTokenizer.from_pretrained(src))
    del prompts["very_long_sparse"]
    alone = {args.prompt: prompts[args.prompt]}
    print(f"prompt {args.prompt}: {len(prompts[args.prompt])} tokens; batch of {len(prompts)}", flush=True)

    rows = {}
    for label, path, fmt in (("q", q, "w4a16"), ("deq", deq, None)):
        for how, batch in (("batched", prompts), ("alone", alone)):
            engine = {**cuda_engine_args(max_num_seqs=8), **sm86_engine_args(fmt)}
            out, record = generate_with_kernels(path, batch, args.steps, **engine)
            if how == "batched":
                print(f"{label} kernels:", *(f"  {k}: {v}" for k, v in record.items()), sep="\n")
                print(
                    f"{label} departures from the 3090's kernels: {kernel_problems(record, path, fmt) or 'none'}"
                )
            rows[f"{label} {how}"] = out[args.prompt]
            tokens, steps = out[args.prompt]
            print(f"{label:>3} {how:>7}: tokens {tokens} | step0 {top5(steps[0])}", flush=True)

    model = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.bfloat16).to("cuda").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompts[args.prompt]], device="cuda")).logits[0, -1]
    lp = logits.float().log_softmax(-1)
    vals, idx = lp.topk(5)
    print(
        "transformers twin: step0 "
        + " ".join(f"{int(i)}:{float(v):.3f}" for v, i in zip(vals, idx, strict=True))
    )
    for name, (tokens, _steps) in rows.items():
        t0 = tokens[0]
        print(f"{name}: token0 {t0}, transformers logprob of it {float(lp[t0]):.3f}")


if __name__ == "__main__":
    main()
