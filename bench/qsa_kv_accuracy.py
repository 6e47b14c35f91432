"""FP8 QSA KV cache accuracy through vLLM (CPU build): calibrated scales vs scales of 1.0.

For a checkpoint, from the repository root:

    .venv/bin/python bench/qsa_kv_accuracy.py --checkpoint checkpoints/tiny [--outlier] [--margin 1.1]

1. BF16 cache with ``VLLM_QSA_KV_COLLECT``: reference log-probabilities of every prompt token of the
   parity prompts, plus calibration dumps; ``python -m model.qsa_kv.merge`` turns them into a sidecar.
2. FP8 cache with that sidecar, and FP8 cache without one (scales 1.0).
3. Prints mean / p99 / max of ``|logprob(FP8) - logprob(BF16)|`` for both, as a markdown table.

``--outlier`` first rewrites the checkpoint into its function-identical variant whose QSA V values
exceed E4M3's +-448 (``model/tools/cases.py``), the situation real checkpoints are in. One
engine runs at a time (~35 s each on the 2-core CPU machine).

Results: ``docs/benchmarks.md`` ("FP8 QSA KV cache accuracy").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def stats(run: list[list[float]], ref: list[list[float]]) -> tuple[float, float, float]:
    diffs = sorted(abs(a - b) for ra, rb in zip(run, ref, strict=True) for a, b in zip(ra, rb, strict=True))
    return sum(diffs) / len(diffs), diffs[int(0.99 * (len(diffs) - 1))], diffs[-1]


QSA_ENV = (
    "VLLM_QSA_KV_SCALES",
    "VLLM_QSA_KV_SCALES_STRICT",
    "VLLM_QSA_KV_COLLECT",
    "VLLM_QSA_KV_COLLECT_INTERVAL",
    "VLLM_QSA_KV_CLIP_COUNT",
)


def prompt_logprobs(
    path: Path, prompts: list[list[int]], kv_cache_dtype: str, env: dict[str, str]
) -> list[list[float]]:
    """Log-probability of every prompt token (positions 1..) under vLLM, one engine, eager, CPU.

    The ``VLLM_QSA_KV_*`` variables are exactly ``env`` while the engine starts (workers read them
    then); the engine lingers half a second so the calibration collector dumps at least once."""
    import time

    from vllm import LLM, SamplingParams

    for name in QSA_ENV:
        os.environ.pop(name, None)
    os.environ.update(env)
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=1024,
        seed=0,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        time.sleep(0.5)
        return [
            [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
            for ids, out in zip(prompts, outs, strict=True)
        ]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        for name in env:
            os.environ.pop(name, None)


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
    from transformers import AutoTokenizer

    from model.tools.cases import make_outlier_checkpoint, parity_prompts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "tiny")
    p.add_argument("--outlier", action="store_true")
    p.add_argument("--margin", type=float, default=1.1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="qsa-kv-acc-") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = make_outlier_checkpoint(args.checkpoint, tmp / "outlier") if args.outlier else args.checkpoint
        prompts = list(parity_prompts(AutoTokenizer.from_pretrained(ckpt)).values())
        dumps = tmp / "dumps"
        ref = prompt_logprobs(ckpt, prompts, "auto", {"VLLM_QSA_KV_COLLECT": str(dumps)})
        sidecar = tmp / "scales.json"
        merge = subprocess.run(
            [
                sys.executable,
                "-m",
                "model.qsa_kv.merge",
                "--out",
                str(sidecar),
                str(dumps),
                "--margin",
                str(args.margin),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        print(merge.stdout + merge.stderr)
        if merge.returncode:
            return 1
        cal = prompt_logprobs(ckpt, prompts, "fp8", {"VLLM_QSA_KV_SCALES": str(sidecar)})
        one = prompt_logprobs(ckpt, prompts, "fp8", {})
        scales = json.loads(sidecar.read_text())
    n = sum(len(r) for r in ref)
    name = f"{args.checkpoint.name}{' (outlier V x512)' if args.outlier else ''}"
    print("\n| checkpoint | FP8 scales | mean abs dlogprob | p99 | max | tokens |\n|---|---|---|---|---|---|")
    for label, run in ((f"calibrated (margin {args.margin:g})", cal), ("1.0", one)):
        mean, p99, mx = stats(run, ref)
        print(f"| {name} | {label} | {mean:.5f} | {p99:.4f} | {mx:.4f} | {n} |")
    print(f"\nsidecar: {json.dumps(scales)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
