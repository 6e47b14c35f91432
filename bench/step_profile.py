"""Where a batch-1 decode step goes: one profiled request, its GPU kernels split by component.

Used by ``bench/bench_real_shape.py --profile DIR`` (the engine's core must run in the bench's own
process, ``--in-process``, so that the profiler sees the model's kernels). One request of a 16-token
prompt generates ``new_tokens`` tokens under ``torch.profiler`` (CPU and CUDA activity; CUPTI
reports the kernels a CUDA graph replays one by one). From the trace:

* **components**: every GPU kernel's time, summed by the first pattern of ``COMPONENTS`` its name
  matches (vLLM's and our kernels keep their op in their names; torch.compile's fused Triton
  kernels carry the ops they fuse, ``triton_red_fused_..._rsqrt_...`` for a norm). GEMMs are a
  component of their own: a projection's kernel does not say whose projection it is;
* **host gaps**: the decode span (first to last kernel of the decode steps) less the time the GPU
  was busy (the union of kernel intervals): time the GPU waited for the host between graph
  replays, for launches outside graphs, for the scheduler and the sampler's host work;
* **launches outside graphs**: ``cudaLaunchKernel``-like runtime calls per step (a graph replay is
  one ``cudaGraphLaunch``).

Per step: two requests are profiled, of ``new_tokens`` and ``2 * new_tokens`` new tokens; their
totals' difference over ``new_tokens`` is what one decode step adds, with the prefill of the
16-token prompt and each request's fixed costs cancelled.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from pathlib import Path
from typing import Any

# First match wins: order from the most specific names to the most general.
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("collectives", r"nccl|all_?reduce|allgather|cross_device_reduce"),
    ("sampler", r"argmax|sampl|gumbel|topk_topp|penalt|logsoftmax|log_softmax|_compute_logprobs"),
    ("moe", r"fused_moe|marlin|moe|topk_softmax|grouped_topk|expert|router"),
    ("hyper-connections", r"\bhc_|_hc_|hyper|mhc|sinkhorn"),
    ("ple", r"ple_|_ple|ngram|uva"),
    ("qsa", r"indexer|qsa|flash|fmha|attn|attention|paged|reshape_and_cache|sparse|block_select"),
    ("gdn", r"gated_delta|delta_rule|recurrent|chunk_|causal_conv|conv1d|gdn|l2norm|sigmoid_gating"),
    ("gemm", r"gemm|cutlass|cublas|xmma|nvjet|splitk|sm80_|sm90_|ampere_|wgmma|matmul|_mm_"),
    ("norm", r"rms_?norm|layer_?norm|rsqrt"),
    ("embedding", r"embedding|index_select"),
)
_COMPILED = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in COMPONENTS)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def component(kernel: str) -> str:
    """The component a kernel's name belongs to; ``other`` (elementwise, copies) when none matches."""
    for name, pattern in _COMPILED:
        if pattern.search(kernel):
            return name
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one kernel ran."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals (microseconds) of one profiled request from its chrome-trace events."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    by_name: dict[str, list[float]] = {}
    by_component: dict[str, float] = {}
    for k in kernels:
        by_name.setdefault(k["name"], []).append(float(k["dur"]))
        c = component(k["name"])
        by_component[c] = by_component.get(c, 0.0) + float(k["dur"])
    spans = [(float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in kernels]
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    busy = busy_time(spans)
    return {
        "span_us": span,
        "busy_us": busy,
        "gap_us": span - busy,
        "kernels": len(kernels),
        "graph_launches": sum(
            1 for e in runtime if e["name"].startswith(("cudaGraphLaunch", "cuGraphLaunch"))
        ),
        "kernel_launches": sum(1 for e in runtime if e["name"] in LAUNCH_CALLS),
        "components_us": dict(sorted(by_component.items(), key=lambda kv: -kv[1])),
        "by_kernel": {n: [len(d), sum(d)] for n, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))},
    }


def per_step(short: dict[str, Any], long: dict[str, Any], steps: int) -> dict[str, Any]:
    """What one decode step adds: the longer request's totals less the shorter one's, over the
    ``steps`` tokens it generated more (the prefill and the request's fixed costs cancel)."""

    def diff(key: str) -> float:
        return (long[key] - short[key]) / steps

    components = {
        c: (long["components_us"].get(c, 0.0) - short["components_us"].get(c, 0.0)) / steps
        for c in long["components_us"]
    }
    return {
        "step_us": diff("span_us"),
        "busy_us": diff("busy_us"),
        "gap_us": diff("gap_us"),
        "kernels": diff("kernels"),
        "graph_launches": diff("graph_launches"),
        "kernel_launches": diff("kernel_launches"),
        "components_us": dict(sorted(components.items(), key=lambda kv: -kv[1])),
    }


def profiled_request(llm, prompt: list[int], new_tokens: int, trace: Path) -> tuple[dict[str, Any], float]:
    """One greedy request under the profiler: its summary and wall seconds; the trace, gzipped."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm-up at this length
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        sync()
        wall = time.perf_counter() - t
    raw = trace.with_suffix("")
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text()).get("traceEvents", [])
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": [e for e in events if e.get("cat") in ("kernel", "cuda_runtime")]}, fh)
    raw.unlink()
    return summarize(events), wall


def profile_decode(llm, out_dir: str, new_tokens: int) -> dict[str, Any]:
    """Batch-1 decode step split by component (see the module's docstring); written to
    ``out_dir/profile.json`` with both requests' kernel tables."""
    import random

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(16)]
    short, wall_short = profiled_request(llm, prompt, new_tokens, out / f"trace-{new_tokens}.json.gz")
    long, wall_long = profiled_request(llm, prompt, 2 * new_tokens, out / f"trace-{2 * new_tokens}.json.gz")
    step = per_step(short, long, new_tokens)
    step["wall_step_us"] = (wall_long - wall_short) / new_tokens * 1e6
    result = {"new_tokens": new_tokens, "per_step": step, "short": short, "long": long}
    (out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    return step


def render(step: dict[str, Any]) -> str:
    """The per-step split as a markdown table (microseconds and share of the wall step)."""
    wall = step["wall_step_us"]
    rows = [("GPU busy", step["busy_us"]), ("GPU idle between kernels (host gaps)", step["gap_us"])]
    rows += [(f"  {c}", us) for c, us in step["components_us"].items()]
    lines = [
        f"wall step {wall:,.0f} us; {step['kernels']:.0f} kernels, {step['graph_launches']:.1f} graph "
        f"replays and {step['kernel_launches']:.1f} launches outside graphs per step",
        "",
        "| part | us/step | share of wall step |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {us:,.0f} | {us / wall:.1%} |" for name, us in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python3 bench/step_profile.py DIR/profile.json``: the table again (or after ``COMPONENTS``
    changed: it reclassifies the kernel tables kept in the JSON)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("profile", help="profile.json written by bench_real_shape.py --profile")
    args = p.parse_args(argv)
    data = json.loads(Path(args.profile).read_text())
    for key in ("short", "long"):
        comps: dict[str, float] = {}
        for name, (_, total) in data[key]["by_kernel"].items():
            comps[component(name)] = comps.get(component(name), 0.0) + total
        data[key]["components_us"] = comps
    step = per_step(data["short"], data["long"], data["new_tokens"])
    step["wall_step_us"] = data["per_step"]["wall_step_us"]
    print(render(step))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
