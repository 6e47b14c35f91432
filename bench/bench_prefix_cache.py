"""Time to first token of a long prompt served twice (different suffix): prefix caching on vs off.

A random-id prompt of ``--prefix-len`` tokens (8k by default) is sent with one ``--suffix-len``
suffix, then again with another: with prefix caching the second request reads the shared prefix
from the cache (its GDN/PLE states from the align-mode block of the hit, its QSA pages by block
hash) and computes only the suffix. The target is a second TTFT at least 5x shorter. The
same two requests without prefix caching are the control (both cold). TTFT is the wall time of a
one-token generation, after a short warm-up request; the engine's own cached-token count is
printed so a run without a hit cannot pass for a fast one. The "floor" column is a cold request of
as many new tokens as the hit computed, without any context: what one forward of that size costs.

    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 .venv/bin/python bench/bench_prefix_cache.py --model checkpoints/tiny

Runs on vLLM's CPU build (eager, bf16) and on CUDA (``--cuda-graphs`` to leave graphs on). With graphs,
the engine captures batch sizes up to ``--capture-max`` tokens (512, what the service gets with vLLM's
default ``max_num_seqs``): vLLM's own ceiling is ``2 * max_num_seqs``, and this bench's 8 sequences
would leave a hit's new tokens (48 with ``real-compute``'s 272-token blocks) outside every graph and
time the hit at about half its served speed.
``--upstream`` (CUDA) serves vLLM's own Qwen4-Exp through our subclass (``QWEN4EXP_CUDA_MODEL=upstream``,
Model Runner V2, the engine core in this process, as ``bench/bench_ours_vs_upstream.py`` runs it);
it needs a checkpoint upstream takes, e.g. ``qsa512``. Nothing from upstream is imported before
``LLM()``: importing it earlier loses upstream's graph breaks, and a hit with graphs then ignores
its suffix; the subclass refuses that state (``model/upstream/optional_kernels.py``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import random
import statistics
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# The tiny checkpoints declare a 4096-token maximum; their RoPE and QSA work at any length.
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")


def ttft(llm, ids: list[int]) -> tuple[float, int, float, int]:
    """Seconds to the first token of one request, how many of its tokens came from the cache, the
    engine's part of it (vLLM's scheduled -> first-token time, its ``prefill_time``, without the
    ``LLM.generate`` call's own request handling, which a cache hit cannot shorten), and the token."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = out.metrics
    engine = (
        stats.first_token_ts - stats.scheduled_ts
        if stats is not None and stats.scheduled_ts
        else float("nan")
    )
    return wall, out.num_cached_tokens or 0, engine, out.outputs[0].token_ids[0]


def profiled(path: str, call):
    """``call()`` under the torch profiler (CPU and, where there is one, CUDA activity); the op
    tables sorted by GPU time, by host time and by host time per call stack go to ``path``, the
    timeline to ``path.trace.json``. Why a cache hit costs what it
    costs: the engine core must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=False, with_stack=True) as prof:
        result = call()
    prof.export_chrome_trace(path + ".trace.json")  # the timeline: where the host waits, where the GPU idles
    averages = prof.key_averages()
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(path, "w") as out:
        out.write(f"one cache-hit request: wall {result[0]:.4f} s, engine {result[2]:.4f} s\n\n")
        out.write("by GPU time\n" + averages.table(sort_by=device_key, row_limit=40) + "\n\n")
        out.write("by host time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n")
        by_stack = prof.key_averages(group_by_stack_n=6)  # which Python code issued the host time
        out.write(
            "by host time and call stack\n"
            + by_stack.table(sort_by="self_cpu_time_total", row_limit=30)
            + "\n"
        )
    print(f"profile of the cache-hit request written to {path}")
    return result


def capture_sizes(largest: int) -> list[int]:
    """Powers of two up to ``largest``: the service captures every multiple of 8 up to 512, so a
    batch here pads at least as far as it would there (never a kinder graph than the product gets)."""
    return [1 << i for i in range(largest.bit_length()) if 1 << i <= largest]


Sample = tuple[float, int, float, int]  # ttft(): wall s, cached tokens, engine s, first token
Round = tuple[Sample, Sample, Sample]  # the cold request, the cache hit, the floor


def set_gdn_mode(mode: bool | None) -> None:
    """Switch upstream's GDN short-prefill path in the running engine (``None``: leave it)."""
    if mode is not None:
        from model.upstream import gdn as upstream_gdn  # the engine core runs in this process (--upstream)

        upstream_gdn.set_enabled(mode)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def run(
    args, prompts: dict, warmup: list[int], fresh, prefix_caching: bool, gdn_modes: list[bool | None]
) -> dict[bool | None, list[Round]]:
    """Per GDN short-prefill mode (``None``: left as the engine has it), ``--rounds`` samples of
    (cold request, cache hit, floor) from one engine; with several modes the rounds alternate
    between them, so both paths meet the same host and the same engine state."""
    from vllm import LLM
    from vllm.platforms import current_platform

    extra: dict = {}
    if current_platform.is_cuda():
        # The 3090's GDN prefill path (tests/gpu/engine.py); a fixed cache so other GPU jobs fit beside.
        extra = dict(
            gpu_memory_utilization=args.gpu_mem,
            kv_cache_memory_bytes=4 << 30,
            additional_config={"gdn_prefill_backend": "triton"},
        )
        if args.cuda_graphs:
            extra["compilation_config"] = {"cudagraph_capture_sizes": capture_sizes(args.capture_max)}
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        enforce_eager=not args.cuda_graphs,
        enable_prefix_caching=prefix_caching,
        max_model_len=args.prefix_len + args.suffix_len + 64,
        seed=0,
        # One request at a time. vLLM's default (1,024 on an H200) needs one Mamba block per
        # sequence for graph capture, more than a 4 GiB pool holds for a 40-layer model.
        max_num_seqs=8,
        kv_cache_dtype=args.kv_cache_dtype,
        disable_log_stats=False,  # per-request timestamps (RequestOutput.metrics)
        **extra,
    )
    results: dict[bool | None, list[Round]] = {mode: [] for mode in gdn_modes}
    try:
        # Warm-up with a prompt of the same length but another prefix: kernels tuned and compiled
        # for long prefills (Triton autotuning on CUDA) cost the first such request ~3x its TTFT on an
        # H200, which would otherwise count as a prefix-cache win (seen with caching off: 2.7x). Then
        # the same warm-up prefix with another suffix, so the hit path's shapes (a short prefill over
        # a long cached context) are compiled before they are timed too.
        # With several GDN modes, a warm-up hit in each, so neither path compiles in a timed round.
        ttft(llm, warmup)
        for i, mode in enumerate(gdn_modes):
            set_gdn_mode(mode)
            suffix = warmup[i * args.suffix_len : (i + 1) * args.suffix_len]
            ttft(llm, warmup[: -args.suffix_len] + suffix)
        for r in range(args.rounds):
            for mode in gdn_modes:
                set_gdn_mode(mode)
                first_ids, second_ids, third_ids = prompts[r, mode]
                first = ttft(llm, first_ids)
                second = ttft(llm, second_ids)
                # The floor: a cold request of the hit's new-token count (ids no request began with).
                # Twice, the second timed: the first may meet a shape nothing before had (CPU kernels
                # pick their primitives per shape), which would make the floor look higher than it is.
                # Without a hit (the control) there is no floor to compare with.
                floor = (math.nan, 0, math.nan, -1)
                if second[1]:
                    size = len(second_ids) - second[1]
                    ttft(llm, fresh(size))
                    floor = ttft(llm, fresh(size))
                if args.profile and prefix_caching and r == 0 and mode == gdn_modes[0]:
                    # a third request with the shared prefix, under the profiler
                    profiled(args.profile, functools.partial(ttft, llm, third_ids))
                results[mode].append((first, second, floor))
        return results
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/tiny")
    parser.add_argument("--prefix-len", type=int, default=8192)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument(
        "--rounds", type=int, default=1, help="samples per row, each on a new prefix; medians shown"
    )
    parser.add_argument("--no-control", action="store_true", help="skip the prefix-caching-off run")
    parser.add_argument("--cuda-graphs", action="store_true", help="do not pass enforce_eager (CUDA)")
    parser.add_argument(
        "--capture-max", type=int, default=512, help="largest CUDA graph batch in tokens (with graphs)"
    )
    parser.add_argument("--gpu-mem", type=float, default=0.5, help="gpu_memory_utilization (CUDA)")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="vLLM's kv_cache_dtype; 'fp8' is the RTX 3090's QSA cache (our E4M3 writer, upstream's "
        "unfused prepare), here at scale 1.0 without a VLLM_QSA_KV_SCALES sidecar",
    )
    parser.add_argument("--upstream", action="store_true", help="QWEN4EXP_CUDA_MODEL=upstream (CUDA)")
    parser.add_argument(
        "--gdn-ab",
        action="store_true",
        help="with --upstream: alternate the rounds between the GDN short-prefill path on and off "
        "(QWEN4EXP_GDN_SHORT_PREFILL, switched in the running engine), a row for each",
    )
    parser.add_argument("--profile", metavar="FILE", help="torch-profile the cache hit, op tables to FILE")
    args = parser.parse_args()
    if args.gdn_ab and not args.upstream:
        parser.error("--gdn-ab times upstream's GDN prefill paths: it needs --upstream (CUDA)")
    if args.profile:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    if args.upstream:
        os.environ.update(
            QWEN4EXP_CUDA_MODEL="upstream", VLLM_USE_V2_MODEL_RUNNER="1", VLLM_ENABLE_V1_MULTIPROCESSING="0"
        )
        if args.gdn_ab:  # installed, then switched per round
            os.environ["QWEN4EXP_GDN_SHORT_PREFILL"] = "1"
        # Nothing from upstream is imported here: the subclass module does what it needs once vLLM has
        # built its config (see model/upstream/optional_kernels.py for why the order matters).
    else:  # ours, also on CUDA (where the default would be upstream), on its V1 runner there
        os.environ.setdefault("QWEN4EXP_CUDA_MODEL", "ours")

    import json
    from pathlib import Path

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    gdn_modes: list[bool | None] = [True, False] if args.gdn_ab else [None]
    prompts = {}  # a new prefix per (round, mode), three suffixes each
    for r in range(args.rounds):
        for mode in gdn_modes:
            prefix = fresh(args.prefix_len)
            prompts[r, mode] = [prefix + fresh(args.suffix_len) for _ in range(3)]
    warmup = fresh(args.prefix_len + args.suffix_len)

    on = run(args, prompts, warmup, fresh, True, gdn_modes)
    rows = {("on", mode): rounds for mode, rounds in on.items()}
    # Printed at once: a run killed during the control keeps this row.
    for mode, rounds in on.items():
        print(f"caching on{label(mode)} (wall s, cached tokens, engine s, token): {rounds}", flush=True)
    if not args.no_control:
        off = run(args, prompts, warmup, fresh, False, gdn_modes[:1])
        rows[("off", gdn_modes[0])] = off[gdn_modes[0]]

    from vllm.platforms import current_platform

    print(
        f"\nmodel {args.model}, prompt {args.prefix_len} + {args.suffix_len} tokens, twice with a "
        f"different suffix, bf16, KV cache {args.kv_cache_dtype}, {current_platform.device_type} ({os.cpu_count()} cores), "
        f"{'upstream' if args.upstream else 'ours'}, {'graphs' if args.cuda_graphs else 'eager'}, "
        f"{args.rounds} round(s) per row (medians; a new prefix each round)\n"
    )
    print(
        "| prefix caching | TTFT 1st (s) | TTFT 2nd (s) | cached tokens 2nd | 1st / 2nd "
        "| engine 1st (s) | engine 2nd (s) | engine 1st / 2nd | floor: engine, cold, 2nd's new tokens (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    summary = {}  # per row: each round's wall ratio, the medians of the wall and engine ratios, cached
    for (caching, mode), rounds in rows.items():
        firsts, seconds, floors = zip(*rounds, strict=True)
        ratios = [f[0] / s[0] for f, s in zip(firsts, seconds, strict=True)]
        engine_ratio = median([f[2] / s[2] for f, s in zip(firsts, seconds, strict=True)])
        cached = min(s[1] for s in seconds)
        summary[caching, mode] = (ratios, median(ratios), engine_ratio, cached)
        wall1, wall2 = median([f[0] for f in firsts]), median([s[0] for s in seconds])
        engine1, engine2 = median([f[2] for f in firsts]), median([s[2] for s in seconds])
        # Without a hit the 2nd computed everything: no floor to show.
        floor = f"{median([f[2] for f in floors]):.4f}" if cached else "-"
        print(
            f"| {caching}{label(mode)} | {wall1:.3f} | {wall2:.3f} | {cached} | {median(ratios):.1f}x "
            f"| {engine1:.4f} | {engine2:.4f} | {engine_ratio:.1f}x | {floor} |"
        )
    if args.rounds > 1:
        for (caching, mode), (ratios, *_) in summary.items():
            print(f"\nper round, caching {caching}{label(mode)}: {', '.join(f'{r:.1f}x' for r in ratios)}")
    # Greedy: a hit must give the cold engine's first token (up to a near-tie).
    if ("off", gdn_modes[0]) in rows:
        cold, hit, _ = rows[("on", gdn_modes[0])][0]
        cold_off, second_off, _ = rows[("off", gdn_modes[0])][0]
        print(
            f"\nfirst tokens, caching on vs off: 1st {'same' if cold[3] == cold_off[3] else 'DIFFER'}, 2nd (hit) "
            f"{'same' if hit[3] == second_off[3] else 'DIFFER'}"
        )
    for mode in gdn_modes:
        _, ratio, engine_ratio, cached = summary["on", mode]
        verdict = "meets" if ratio >= 5 and cached > 0 else "MISSES"
        print(
            f"\nprefix caching{label(mode)}: second request {ratio:.1f}x faster ({cached} cached tokens): "
            f"{verdict} the 5x target (engine scheduled -> first token: {engine_ratio:.1f}x)"
        )


def label(mode: bool | None) -> str:
    """A row's GDN short-prefill mode, empty where the engine's own setting was left alone."""
    return "" if mode is None else f", GDN short prefill {'on' if mode else 'off'}"


if __name__ == "__main__":
    main()
