"""Our model through vLLM on a GPU: output tokens/s by batch size and time to first token by prompt
length, eager vs CUDA graphs, printed as a markdown table.

Run on a machine with vLLM's CUDA build, from the repository root:

    PYTHONPATH=. python3 bench/bench_engine_gpu.py [--model checkpoints/tiny] [--new-tokens 128] [--tp 1,2,4]

One engine per mode (and per tensor-parallel size of ``--tp``, as mode ``graphs+tp2``), each in its own process (V1 runner, Triton GDN prefill as on a 3090, PLE
tables pinned in host memory, the default). Throughput: ``batch`` requests of a short prompt, each
generating ``--new-tokens`` tokens (``ignore_eos``), all submitted at once; tok/s = generated tokens
/ wall time of the whole batch, median of ``--repeats`` runs after one warm-up. TTFT: one request
with a random ``2k``/``8k``-token prompt and ``max_tokens=1``, wall time of the call (prefill +
one sampling step + engine round trip), median of ``--repeats``. The prompts exceed the tiny
checkpoint's ``max_position_embeddings`` (4096); RoPE has no length limit, so the engine is allowed
a longer context (``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``): this measures speed, not quality.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def effective_cudagraph_mode(worker) -> str:
    """Run in each worker: the graph mode the engine core settled on.

    The front end's config keeps what was asked for; the worker lowers it (e.g. to NONE when an
    attention backend declares no graph support), so only the worker's copy says what ran.
    """
    return str(worker.vllm_config.compilation_config.cudagraph_mode)


def time_engine(
    llm, batches: list[int], ttft: list[int], new_tokens: int, repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Output tok/s by batch size and TTFT (ms) by prompt length, keyed by the number as text.

    Throughput: ``batch`` requests of a 16-token prompt, each generating ``new_tokens`` tokens
    (``ignore_eos``), submitted at once; generated tokens / wall time, median of ``repeats`` after
    a warm-up. TTFT: one random prompt of ``n`` tokens with ``max_tokens=1``, wall time of the call,
    median of ``repeats`` after a warm-up (which also compiles for the shape)."""
    import random

    from vllm import SamplingParams

    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    short = [rng.randrange(3, vocab) for _ in range(16)]
    tps, ttft_ms = {}, {}
    gen = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    for b in batches:
        prompts = [{"prompt_token_ids": short} for _ in range(b)]
        llm.generate(prompts, gen, use_tqdm=False)  # warm-up
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            outs = llm.generate(prompts, gen, use_tqdm=False)
            runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        tps[str(b)] = statistics.median(runs)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    for n in ttft:
        prompt = {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]}
        llm.generate([prompt], one, use_tqdm=False)
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            runs.append((time.perf_counter() - t) * 1e3)
        ttft_ms[str(n)] = statistics.median(runs)
    return tps, ttft_ms


def child(spec: dict) -> dict:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("QWEN4EXP_CUDA_MODEL", "ours")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    from vllm import LLM

    graphs = spec["mode"].split("+")[0] == "graphs"
    sizes = sorted(set([1, 2, 4, 8, 16, 32, 64] + spec["batches"]))
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        enforce_eager=not graphs,
        enable_prefix_caching=False,
        max_model_len=max(spec["ttft"]) + 64,
        max_num_seqs=max(spec["batches"]),
        gpu_memory_utilization=0.5,
        tensor_parallel_size=spec.get("tp", 1),
        seed=0,
        additional_config={"gdn_prefill_backend": "triton"},
        **({"compilation_config": {"cudagraph_capture_sizes": sizes}} if graphs else {}),
    )
    result: dict = {"start_s": time.perf_counter() - t0}
    result["cudagraph_mode"] = ",".join(sorted(set(llm.collective_rpc(effective_cudagraph_mode))))
    result["tps"], result["ttft_ms"] = time_engine(
        llm, spec["batches"], spec["ttft"], spec["new_tokens"], spec["repeats"]
    )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "tiny"))
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--ttft", default="2048,8192", help="prompt lengths (tokens) for time to first token")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="eager,graphs")
    p.add_argument("--tp", default="1", help="tensor-parallel sizes, e.g. 1,2,4: each mode runs at each")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(Path(args.child).read_text())
        Path(spec["out"]).write_text(json.dumps(child(spec)))
        return 0

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in [
            m if tp == "1" else f"{m}+tp{tp}" for tp in args.tp.split(",") for m in args.modes.split(",")
        ]:
            spec = {
                "mode": mode,
                "tp": int(mode.rsplit("+tp", 1)[1]) if "+tp" in mode else 1,
                "model": args.model,
                "batches": [int(x) for x in args.batches.split(",")],
                "ttft": [int(x) for x in args.ttft.split(",")],
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "out": str(Path(tmp) / f"{mode}.json"),
            }
            spec_path = Path(tmp) / f"{mode}_spec.json"
            spec_path.write_text(json.dumps(spec))
            proc = subprocess.run([sys.executable, __file__, "--child", str(spec_path)], cwd=ROOT)
            if proc.returncode != 0:
                print(f"{mode}: engine run failed (rc {proc.returncode})")
                continue
            results[mode] = json.loads(Path(spec["out"]).read_text())

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    batches = args.batches.split(",")
    ttfts = args.ttft.split(",")
    header = [
        "mode",
        "cudagraph_mode (effective)",
        *[f"batch {b} (tok/s)" for b in batches],
        *[f"TTFT {int(n) / 1024:g}k (ms)" for n in ttfts],
    ]
    lines = [
        f"Model {Path(args.model).name}, {device}, {args.new_tokens} new tokens per request, "
        f"median of {args.repeats}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for mode, r in results.items():
        cells = [f"{r['tps'][b]:,.0f}" for b in batches] + [f"{r['ttft_ms'][n]:,.1f}" for n in ttfts]
        lines.append(f"| {mode} | {r['cudagraph_mode']} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_engine_gpu.md").write_text(text + "\n")
    return 0 if len(results) == len(args.modes.split(",")) * len(args.tp.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
