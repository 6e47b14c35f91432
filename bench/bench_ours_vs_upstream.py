"""Our Qwen4-Exp (vLLM plugin, V1 runner) against vLLM's own CUDA ``qwen4_exp`` on the ``qsa512``
checkpoint: greedy parity with transformers, output tok/s, TTFT and cache bytes per sequence.

Run on the GPU machine, from the repository root (vLLM's CUDA build in /tmp/site):

    PYTHONPATH=$PWD:/tmp/site python3 bench/bench_ours_vs_upstream.py \\
        --make-checkpoint /tmp/qsa512 --out /tmp/ours_vs_upstream

Why each piece is the way it is:

* ``qsa512`` (``model/checkpoints.py``) is the smallest checkpoint whose QSA indexer has a real
  shape (2048-token budget / ratio 4 = 512 blocks); upstream's top-k kernels take only 512/1024/2048
  blocks, and a toy budget would never exercise the sparse path at all.
* One engine per child process (``subprocess`` of a fresh interpreter, never fork), because the
  implementation is picked at import time by the environment: ours is registered by the package's
  ``vllm.general_plugins`` entry point (``model.plugin:register``) under the same architecture names
  as upstream, so ``VLLM_PLUGINS=none`` (a name no plugin has) is what gives upstream's model.
  Upstream needs the V2 model runner (under V1 it stops with "PLE inputs were not prepared"); ours
  runs on V1. Every row prints which model class was actually loaded.
* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in the child's own process: a failure
  raises the real exception (its last line goes into the error row) instead of "engine core
  initialization failed", and the scheduler's KV-cache config is readable for the memory column.
* The transformers reference runs once, in its own child (bf16, same device), so its tokens are
  shared by every engine row. Its QSA indexer is a per-query Python loop; 4k+8k+16k prompts take a
  few tens of seconds on an H200, which is why the parity prompts stop at 16k.
* Throughput: ``batch`` copies of a short prompt, ``ignore_eos``, ``--new-tokens`` each; tok/s =
  generated tokens / wall time, median of ``--repeats`` after a warm-up. TTFT: one random prompt,
  ``max_tokens=1``, wall time of the call, median of ``--repeats`` after a warm-up.
* Memory: bytes of the KV/state pool the engine allocated divided by vLLM's own
  ``get_max_concurrency_for_kv_cache_config`` (the number behind its "Maximum concurrency for N
  tokens per request" log line) = bytes one ``max_model_len`` (32k + 64) sequence holds, over every
  layer (QSA K/V and indexer caches, GDN and PLE states); per token = that / ``max_model_len``. Both
  engines get the same fixed ``kv_cache_memory_bytes``, so their pools are comparable.
* CUDA graphs: upstream runs with its default (graphs on); ours runs eager and with default
  settings. Ours declares no CUDA-graph support, so vLLM runs its "graphs" row without graphs; the
  effective ``compilation_config.cudagraph_mode`` is printed for every row so this is visible.
* Upstream on Hopper dispatches its HC down-projection (M <= 48) to a CuTe-DSL kernel that imports
  ``cutlass`` and ``quack``; if those packages are missing the child turns that one fused kernel off
  (vLLM's GEMM path computes the same product) and says so in the notes column.

Dry run on a CPU box: ``--device cpu --quick`` (short prompts, batches 1/2, one repeat) runs the
reference and our engine through vLLM's CPU build; the upstream row fails (CUDA only) as an error row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Implementation -> (environment, enforce_eager). "ours" asks for vLLM's default (graphs); vLLM
# downgrades it when the model declares no graph support, which the cudagraph_mode column shows.
IMPLS: dict[str, tuple[dict[str, str], bool]] = {
    "ours-eager": ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, True),
    "ours": ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, False),
    "upstream": ({"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_PLUGINS": "none"}, False),
}
COMMON_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
}
# The path an RTX 3090 takes (tests/gpu/engine.py); on an H200 vLLM would otherwise pick FlashInfer's
# CuTe-DSL GDN prefill. Given to both implementations so the GDN prefill kernel is the same.
ADDITIONAL_CONFIG = {"gdn_prefill_backend": "triton"}


def last_line(exc: BaseException) -> str:
    """The exception as one table-safe line (pydantic and vLLM messages span several lines)."""
    text = "".join(traceback.format_exception_only(type(exc), exc))
    flat = " / ".join(ln.strip() for ln in text.splitlines() if ln.strip())
    return flat if len(flat) <= 400 else flat[:397] + "..."


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------- reference child
def reference_child(spec: dict) -> dict:
    """Greedy tokens from transformers' own Qwen4-Exp classes, the arbiter for both engines."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    device = spec["device"]
    model = Qwen4ExpForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).to(device).eval()
    tokens, seconds = [], []
    for prompt in spec["prompts"]:
        ids = torch.tensor([prompt], device=device)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=spec["parity_new"],
                min_new_tokens=spec["parity_new"],  # suppresses EOS, like ignore_eos in vLLM
                do_sample=False,
            )
        _sync(device)
        seconds.append(time.perf_counter() - t)
        tokens.append(out[0, len(prompt) :].tolist())
    return {"tokens": tokens, "seconds": seconds}


# --------------------------------------------------------------------------- engine child
def _disable_upstream_cute_dsl_if_missing() -> str | None:
    """Turn off upstream's CuTe-DSL HC down+SiLU kernel when its packages are not installed.

    Upstream selects it on sm_90+ for hyper-hidden sizes divisible by 8 and 1..48 tokens, and both
    its warm-up and its first call import ``cutlass.cute`` and ``quack``. Without them the engine
    cannot start; with the flag off the same merged projection runs through vLLM's linear layer.
    """
    import importlib.util

    missing = [name for name in ("cutlass", "quack") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    from vllm.models.qwen4_exp.nvidia import hyperconnection, model

    init = hyperconnection.GatedResidual.__init__

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if hasattr(self, "_use_hc_down_silu"):
            self._use_hc_down_silu = False

    hyperconnection.GatedResidual.__init__ = patched_init
    model.request_hc_down_silu_warmup = lambda *args, **kwargs: None
    return f"CuTe-DSL HC down+SiLU off ({', '.join(missing)} not installed)"


def _loaded_class(llm) -> str:
    try:
        names = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")
        return names[0]
    except Exception as exc:  # noqa: BLE001 - informative only
        return f"? ({last_line(exc)})"


def _memory(llm) -> dict:
    """Cache bytes per max_model_len sequence and per token, from the in-process engine core."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore (multiprocessing off)
    kv = core.scheduler.kv_cache_config
    total = sum(t.size for t in kv.kv_cache_tensors) if kv.kv_cache_tensors else None
    if not total:
        total = engine.vllm_config.cache_config.kv_cache_memory_bytes
    concurrency = get_max_concurrency_for_kv_cache_config(engine.vllm_config, kv)
    max_len = engine.vllm_config.model_config.max_model_len
    per_seq = total / concurrency
    return {
        "pool_bytes": total,
        "num_blocks": kv.num_blocks,
        "groups": [
            f"{type(g.kv_cache_spec).__name__}x{len(g.layer_names)}(block {g.kv_cache_spec.block_size})"
            for g in kv.kv_cache_groups
        ],
        "max_concurrency": concurrency,
        "max_model_len": max_len,
        "bytes_per_seq": per_seq,
        "bytes_per_token": per_seq / max_len,
    }


def _timed(llm, prompts, params, repeats: int, device: str) -> list[float]:
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (and compile for this shape)
    runs = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        runs.append((time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)))
    return runs


def engine_child(spec: dict) -> dict:
    """One engine of one implementation: parity, throughput, TTFT, memory. Partial results survive."""
    result: dict = {"impl": spec["impl"], "notes": [], "tps": {}, "ttft_ms": {}}
    if spec["impl"] == "upstream" and spec["device"] == "cuda":
        note = _disable_upstream_cute_dsl_if_missing()
        if note:
            result["notes"].append(note)

    from vllm import LLM, SamplingParams

    graphs = not IMPLS[spec["impl"]][1]
    engine_args: dict = dict(
        model=spec["model"],
        dtype="bfloat16",
        enforce_eager=not graphs,
        enable_prefix_caching=False,
        max_model_len=spec["max_model_len"],
        max_num_seqs=max(spec["batches"] + [len(spec["prompts"])]),
        seed=0,
        additional_config=dict(ADDITIONAL_CONFIG),
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
    )
    if spec["device"] == "cuda":
        engine_args["gpu_memory_utilization"] = 0.8
        if graphs:
            sizes = sorted({1, 2, 4, 8, 16, 32, 64, *spec["batches"]})
            engine_args["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    result["start_s"] = time.perf_counter() - t0
    result["model_class"] = _loaded_class(llm)
    result["cudagraph_mode"] = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    try:
        result["memory"] = _memory(llm)
    except Exception as exc:  # noqa: BLE001 - keep the other measurements
        result["notes"].append(f"memory: {last_line(exc)}")

    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=spec["parity_new"], ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], greedy, use_tqdm=False)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    except Exception as exc:  # noqa: BLE001
        result["notes"].append(f"parity: {last_line(exc)}")

    rng = random.Random(1)
    short = [rng.randrange(spec["id_low"], spec["id_high"]) for _ in range(16)]
    gen = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    for b in spec["batches"]:
        runs = _timed(llm, [{"prompt_token_ids": short}] * b, gen, spec["repeats"], spec["device"])
        result["tps"][b] = statistics.median(n / dt for dt, n in runs)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for n in spec["ttft"]:
        prompt = [{"prompt_token_ids": [rng.randrange(spec["id_low"], spec["id_high"]) for _ in range(n)]}]
        runs = _timed(llm, prompt, one, spec["repeats"], spec["device"])
        result["ttft_ms"][n] = statistics.median(dt * 1e3 for dt, _ in runs)
    return result


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = reference_child(spec) if spec["impl"] == "reference" else engine_child(spec)
    except BaseException as exc:  # noqa: BLE001 - reported as the row's error
        traceback.print_exc()
        result = {"error": last_line(exc)}
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- parent
def run_child(name: str, spec: dict, workdir: Path, timeout: int) -> dict:
    """Run one child; any failure (exception, crash, timeout) comes back as {"error": ...}."""
    env = dict(os.environ, **COMMON_ENV)
    if name != "reference":
        env.update(IMPLS[name][0])
    spec = dict(spec, impl=name, out=str(workdir / f"{name}.json"))
    spec_path = workdir / f"{name}_spec.json"
    spec_path.write_text(json.dumps(spec))
    log = workdir / f"{name}.log"
    print(f"[{name}] running (log {log}, timeout {timeout}s)", flush=True)
    t = time.perf_counter()
    try:
        with log.open("w") as fh:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", str(spec_path)],
                cwd=ROOT,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        out = Path(spec["out"])
        result = (
            json.loads(out.read_text()) if out.exists() else {"error": f"rc {proc.returncode}: {_tail(log)}"}
        )
    except subprocess.TimeoutExpired:
        result = {"error": f"timeout after {timeout}s: {_tail(log)}"}
    result["wall_s"] = time.perf_counter() - t
    print(f"[{name}] done in {result['wall_s']:.0f}s" + (f": {result['error']}" if "error" in result else ""))
    return result


def _tail(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _parity(ref: list[list[int]], got: list[list[int]] | None) -> str:
    if got is None:
        return "n/a"
    cells = []
    for r, g in zip(ref, got, strict=True):
        equal = sum(a == b for a, b in zip(r, g, strict=False))
        first = next((i for i, (a, b) in enumerate(zip(r, g, strict=False)) if a != b), None)
        cells.append(f"{equal}/{len(r)}" + ("" if first is None else f" (div@{first})"))
    return ", ".join(cells)


def render(args, results: dict, ref: dict, device_name: str, lens: list[int]) -> str:
    batches, ttfts = args.batch_list, args.ttft_list
    header = [
        "impl",
        "model class",
        "cudagraph_mode",
        "start (s)",
        "parity " + "/".join(f"{n // 1024}k" if n >= 1024 else str(n) for n in lens),
        *[f"b{b} tok/s" for b in batches],
        *[f"TTFT {n / 1024:g}k (ms)" for n in ttfts],
        "cache KiB/token",
        f"cache MiB/{args.max_model_len:,}-token seq",
        "notes",
    ]
    lines = [
        f"qsa512 ({args.model}), {device_name}; {args.new_tokens} new tokens per request, median of "
        f"{args.repeats}; parity = greedy tokens equal to transformers (bf16, {args.device}) out of "
        f"{args.parity_new}, first divergence index",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    if "error" in ref:
        lines.insert(1, f"reference (transformers) failed: {ref['error']}")
    for name, r in results.items():
        if "error" in r and "tps" not in r:
            cells = [name, "ERROR: " + r["error"].replace("|", "/").replace("\n", " / ")]
            cells += [""] * (len(header) - 2)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        mem = r.get("memory") or {}
        cls = r.get("model_class", "?")
        cells = [
            name,
            cls,
            r.get("cudagraph_mode", "?"),
            f"{r.get('start_s', 0):.0f}",
            _parity(ref["tokens"], r.get("tokens")) if "tokens" in ref else "no reference",
            *[f"{r['tps'][str(b)]:,.0f}" if str(b) in r["tps"] else "" for b in batches],
            *[f"{r['ttft_ms'][str(n)]:,.1f}" if str(n) in r["ttft_ms"] else "" for n in ttfts],
            f"{mem['bytes_per_token'] / 1024:.2f}" if mem else "",
            f"{mem['bytes_per_seq'] / 2**20:.1f}" if mem else "",
            "; ".join(r.get("notes", []) + ([f"error: {r['error']}"] if "error" in r else [])).replace(
                "|", "/"
            ),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "qsa512"))
    p.add_argument(
        "--make-checkpoint", metavar="DIR", help="generate the qsa512 checkpoint in DIR if missing"
    )
    p.add_argument(
        "--train-steps", type=int, default=30, help="for --make-checkpoint (~4 s each on 2 CPU cores)"
    )
    p.add_argument("--impls", default="ours-eager,ours,upstream")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="CPU dry run: short prompts, batches 1,2, 1 repeat")
    p.add_argument("--parity-lens", default="4096,8192,16384")
    p.add_argument("--parity-new", type=int, default=16)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--ttft", default="8192,32768")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=float, default=8.0, help="same cache pool for every engine")
    p.add_argument("--timeout", type=int, default=300, help="seconds per child")
    p.add_argument("--out", help="directory for results.json, the table and the child logs")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args.child)

    if args.quick:
        args.parity_lens, args.parity_new, args.batches = "96,200", 8, "1,2"
        args.ttft, args.new_tokens, args.repeats, args.kv_cache_gib = "256", 8, 1, 0.5
    if args.make_checkpoint:
        args.model = args.make_checkpoint
        if not (Path(args.model) / "config.json").exists():
            from model.checkpoints import make_checkpoint

            t = time.perf_counter()
            make_checkpoint("qsa512", args.model, train_steps=args.train_steps)
            print(f"made qsa512 in {args.model} ({time.perf_counter() - t:.0f}s)", flush=True)
    args.batch_list = [int(x) for x in args.batches.split(",")]
    args.ttft_list = [int(x) for x in args.ttft.split(",")]
    lens = [int(x) for x in args.parity_lens.split(",")]
    args.max_model_len = max(args.ttft_list + lens) + 64

    from transformers import AutoTokenizer

    # Random ids below the tokenizer's size (vLLM rejects ids it cannot detokenize), above the
    # special tokens (ids 0-2), the same for every child.
    id_high = len(AutoTokenizer.from_pretrained(args.model))
    rng = random.Random(0)
    spec = {
        "model": args.model,
        "device": args.device,
        "prompts": [[rng.randrange(3, id_high) for _ in range(n)] for n in lens],
        "parity_new": args.parity_new,
        "batches": args.batch_list,
        "ttft": args.ttft_list,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "max_model_len": args.max_model_len,
        "kv_cache_bytes": int(args.kv_cache_gib * 2**30),
        "id_low": 3,
        "id_high": id_high,
    }
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ours_vs_upstream_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ref = run_child("reference", spec, out_dir, args.timeout)
    results = {name: run_child(name, spec, out_dir, args.timeout) for name in args.impls.split(",")}

    device_name = "cpu"
    if args.device == "cuda":
        try:
            import torch

            device_name = torch.cuda.get_device_name(0)
        except Exception as exc:  # noqa: BLE001
            device_name = f"cuda ({last_line(exc)})"
    text = render(args, results, ref, device_name, lens)
    text += f"\n\nTotal {time.perf_counter() - t0:.0f}s; logs and JSON in {out_dir}"
    print(text)
    (out_dir / "bench_ours_vs_upstream.md").write_text(text + "\n")
    ref_summary = {k: v for k, v in ref.items()}
    (out_dir / "results.json").write_text(
        json.dumps(
            {"args": {k: v for k, v in vars(args).items()}, "reference": ref_summary, "engines": results},
            indent=1,
        )
    )
    return 0 if "error" not in ref and all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
