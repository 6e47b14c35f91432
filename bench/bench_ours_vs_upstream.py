"""Our Qwen4-Exp (vLLM plugin, V1 runner) against vLLM's own CUDA ``qwen4_exp`` on the ``qsa512``
checkpoint: greedy parity with transformers, output tok/s, TTFT and cache bytes per sequence.

Run on a CUDA host with the CUDA requirements installed, from the repository root; these child
budgets keep the whole run (checkpoint ~40 s included) under about 9 minutes on an H200:

    PYTHONPATH=. python3 bench/bench_ours_vs_upstream.py \\
        --make-checkpoint /tmp/qsa512 --out $OUT/ovu --impls upstream,ours-eager,ours-loop \\
        --timeouts reference=90,upstream=150,ours-eager=140,ours-loop=110 --phase-timeout 60

Output (three files, whatever happens): ``results.json`` (every child's results, phase times and
its last 200 log lines), ``bench_ours_vs_upstream.md`` (the table) and ``logs.tar.gz`` (the full
child logs); specs and per-child JSON stay in a temporary directory. The table and results.json
are rewritten after every child, so a run killed from outside still leaves the rows finished so far.

Why each piece is the way it is:

* ``qsa512`` (``model/tools/checkpoints.py``) is the smallest checkpoint whose QSA indexer has a real
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
* Partial results: a child writes its JSON after every phase, with each phase's wall time. Engine
  phases run cheap first: start, memory, parity on the shortest prompt, tok/s per batch size, the
  shortest TTFT, then the longer parity prompts and TTFT lengths by length. A phase whose estimate
  (the cheapest seconds per prompt token seen so far, decode steps taken off, times 1.5) exceeds
  the budget left is skipped; one that runs past ``--phase-timeout`` (or the budget left) ends the
  child, and the table marks every phase not reached as "timeout in <phase>".
* Parity margins: the reference keeps the top-5 log-probabilities of its raw logits at every step
  (the whole row for a small vocabulary), the engines return ``logprobs=5``; at the first divergent
  step a cell shows the reference's margin between its top-1 and the engine's token and the
  engine's own margin, e.g. ``4/16 (div@4, ref margin 0.031, engine margin 0.012)``. A margin
  below ~0.1 nats is a near-tie that bf16 rounding can flip; a large one is a real difference.
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
* ``served`` is what the product serves on CUDA (``QWEN4EXP_CUDA_MODEL=upstream``: upstream through
  our subclass, plugin loaded, V2, graphs); ``upstream`` is vLLM's model with our plugin off. The
  table ends with each row's output tok/s over ``ours-loop``'s (the baseline).
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
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Implementation -> (environment, enforce_eager). "ours" asks for vLLM's default (graphs); vLLM
# downgrades it when the model declares no graph support, which the cudagraph_mode column shows.
IMPLS: dict[str, tuple[dict[str, str], bool]] = {
    "ours-eager": ({"VLLM_USE_V2_MODEL_RUNNER": "0", "QWEN4EXP_CUDA_MODEL": "ours"}, True),
    # The baseline: QSA selection one query at a time (the CPU reference loop).
    "ours-loop": (
        {"VLLM_USE_V2_MODEL_RUNNER": "0", "QWEN4EXP_CUDA_MODEL": "ours", "QWEN4EXP_QSA_SELECTION": "loop"},
        True,
    ),
    "ours": ({"VLLM_USE_V2_MODEL_RUNNER": "0", "QWEN4EXP_CUDA_MODEL": "ours"}, False),
    "upstream": ({"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_PLUGINS": "none"}, False),
    # What the product serves on CUDA: upstream through our subclass (plugin loaded), V2, graphs.
    "served": ({"VLLM_USE_V2_MODEL_RUNNER": "1", "QWEN4EXP_CUDA_MODEL": "upstream"}, False),
}
# The baseline against which the chosen path's decode speed is judged (>= 3x at b64).
BASELINE = "ours-loop"
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


# --------------------------------------------------------------------------- child bookkeeping
def _label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


class Progress:
    """A child's result dict, written to its JSON after every phase (atomically), with phase times.

    The parent reads whatever is there when the child dies or runs out of time, so every finished
    phase survives. ``current_phase`` names the phase in progress (or the last one started).
    """

    def __init__(self, spec: dict, result: dict):
        self.path = Path(spec["out"])
        self.deadline = spec["deadline"]  # time.time() by which the child must have written its JSON
        self.phase_timeout = spec["phase_timeout"]
        self.min_phase_s = spec["min_phase_s"]
        self.result = result
        result.setdefault("phases", [])
        result.setdefault("notes", [])
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result))
        os.replace(tmp, self.path)

    def left(self) -> float:
        return self.deadline - time.time()

    def run(self, name: str, fn, estimate_s: float | None = None) -> bool:
        """Run one phase unless the child's remaining budget is too short; True if it completed.

        A phase that runs past ``min(phase_timeout, budget left)`` (start-up: the budget left) is
        stopped by SIGALRM: its timeout is recorded and the child exits at once (the engine cannot
        be trusted after an interrupted step), so phases are ordered cheap-first by the caller.
        """
        left = self.left()
        need = max(self.min_phase_s, estimate_s or 0.0)
        if left < need:
            why = f"skipped: {left:.0f}s of budget left" + (
                f", ~{estimate_s:.0f}s estimated" if estimate_s else ""
            )
            self.result["phases"].append({"name": name, "status": "skipped", "why": why})
            self.save()
            return False
        # Start-up (engine start, model load) is bounded by the child's budget only.
        per_phase = self.phase_timeout if name not in ("start", "load") else 0
        limit = max(1.0, min(per_phase or left, left - 1.0))
        self.result["current_phase"] = name
        self.save()
        t = time.perf_counter()

        def on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
            self.result["phases"].append(
                {"name": name, "status": "timeout", "wall_s": time.perf_counter() - t, "limit_s": limit}
            )
            self.result["timeout_in"] = name
            self.save()
            print(f"[child] phase {name!r} stopped after {limit:.0f}s", flush=True)
            os._exit(3)

        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            fn()
            status, err = "ok", None
        except Exception as exc:  # noqa: BLE001 - reported in the phase row, later phases still run
            traceback.print_exc()
            status, err = "error", last_line(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        row = {"name": name, "status": status, "wall_s": time.perf_counter() - t}
        if err:
            row["error"] = err
            self.result["notes"].append(f"{name}: {err}")
        self.result["phases"].append(row)
        self.result.pop("current_phase", None)
        self.save()
        print(f"[child] phase {name!r} {status} in {row['wall_s']:.1f}s", flush=True)
        return status == "ok"


def _top_logprobs(logits, k: int, full: bool) -> dict:
    """Top-k (token, logprob) of one step's raw logits; the whole row too when the vocab is small."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = lp.topk(k)
    out = {"top": [[int(i), round(float(v), 5)] for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]}
    if full:
        out["row"] = [round(float(v), 5) for v in lp.tolist()]
    return out


# --------------------------------------------------------------------------- reference child
def reference_child(spec: dict) -> dict:
    """Greedy tokens from transformers' own Qwen4-Exp classes, the arbiter for both engines.

    Per step it keeps the top-k log-probabilities of its raw logits (and the full row for a small
    vocabulary), so a divergence can be told apart as a near-tie or a real difference.
    """
    import torch
    from transformers import Qwen4ExpForCausalLM

    result: dict = {"impl": "reference", "parity": {}}
    prog = Progress(spec, result)
    device = spec["device"]
    holder: dict = {}

    def load():
        holder["model"] = (
            Qwen4ExpForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).to(device).eval()
        )

    if not prog.run("load", load):
        result.setdefault("error", next(iter(result["notes"]), "load skipped (budget)"))
        return result
    model = holder["model"]
    full = model.config.vocab_size <= 4096
    for prompt in spec["prompts"]:

        def parity(prompt=prompt):
            ids = torch.tensor([prompt], device=device)
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=spec["parity_new"],
                    min_new_tokens=spec["parity_new"],  # suppresses EOS, like ignore_eos in vLLM
                    do_sample=False,
                    output_logits=True,  # raw logits, before min_new_tokens masks EOS
                    return_dict_in_generate=True,
                )
            _sync(device)
            result["parity"][str(len(prompt))] = {
                "prompt_tokens": len(prompt),
                "tokens": out.sequences[0, len(prompt) :].tolist(),
                "steps": [_top_logprobs(step[0], spec["logprobs"], full) for step in out.logits],
                "seconds": time.perf_counter() - t,
            }

        prog.run(f"parity {_label(len(prompt))}", parity)
    return result


# --------------------------------------------------------------------------- engine child
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


def _engine_logprobs(step) -> dict[str, float]:
    """One step of vLLM's sample logprobs as {token id: logprob} (dict or flat container)."""
    if step is None:
        return {}
    return {str(int(t)): float(getattr(lp, "logprob", lp)) for t, lp in step.items()}


def engine_phases(spec: dict) -> list[tuple[str, str, int]]:
    """(phase name, kind, size) in run order: cheap first, the long prompts last.

    The first (shortest) parity prompt, then every batch size, then the shortest TTFT, then the
    other parity prompts and TTFT lengths by length (parity first on a tie), so a budget or a slow
    implementation costs the long phases, never the cheap ones.
    """
    lens, ttfts = sorted(len(p) for p in spec["prompts"]), sorted(spec["ttft"])
    order = [("parity", lens[0])] if lens else []
    order += [("tps", b) for b in spec["batches"]]
    order += [("ttft", ttfts[0])] if ttfts else []
    rest = [("parity", n) for n in lens[1:]] + [("ttft", n) for n in ttfts[1:]]
    order += sorted(rest, key=lambda kv: (kv[1], kv[0] != "parity"))
    names = {"parity": "parity {}", "tps": "b{} tok/s", "ttft": "TTFT {}"}
    return [(names[k].format(_label(n) if k != "tps" else n), k, n) for k, n in order]


def engine_child(spec: dict) -> dict:
    """One engine of one implementation: parity, throughput, TTFT, memory. Partial results survive."""
    result: dict = {"impl": spec["impl"], "notes": [], "tps": {}, "ttft_ms": {}, "parity": {}}
    prog = Progress(spec, result)
    if spec["impl"] == "upstream" and spec["device"] == "cuda":
        # Raw upstream (our plugin off), so the CuTe-DSL switch is ours to apply.
        from model.upstream.optional_kernels import prepare_upstream_without_plugin

        graphs = not IMPLS[spec["impl"]][1]
        if graphs:  # as vLLM's config would for Qwen4-Exp, before upstream is imported
            os.environ.setdefault("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
        note = prepare_upstream_without_plugin(graphs=graphs)
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
        max_num_seqs=max(spec["batches"] + [1]),
        seed=0,
        additional_config=dict(ADDITIONAL_CONFIG),
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        max_logprobs=max(spec["logprobs"], 5),
    )
    if spec["device"] == "cuda":
        engine_args["gpu_memory_utilization"] = spec["gpu_mem"]
        if graphs:
            sizes = sorted({1, 2, 4, 8, 16, 32, 64, *spec["batches"]})
            engine_args["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    holder: dict = {}

    def start():
        holder["llm"] = LLM(**engine_args)
        llm = holder["llm"]
        result["model_class"] = _loaded_class(llm)
        result["cudagraph_mode"] = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)

    t0 = time.perf_counter()
    ok = prog.run("start", start)
    result["start_s"] = time.perf_counter() - t0
    prog.save()
    if not ok:
        result.setdefault(
            "error", next((n for n in result["notes"] if n.startswith("start")), "start skipped")
        )
        return result
    llm = holder["llm"]

    def memory():
        result["memory"] = _memory(llm)

    prog.run("memory", memory)

    rng = random.Random(1)
    short = [rng.randrange(spec["id_low"], spec["id_high"]) for _ in range(16)]
    gen = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    greedy = SamplingParams(
        temperature=0.0, max_tokens=spec["parity_new"], ignore_eos=True, logprobs=spec["logprobs"]
    )
    greedy_plain = SamplingParams(temperature=0.0, max_tokens=spec["parity_new"], ignore_eos=True)
    prompts = {len(p): p for p in spec["prompts"]}
    ttft_prompts = {
        n: [rng.randrange(spec["id_low"], spec["id_high"]) for _ in range(n)] for n in spec["ttft"]
    }
    # (wall s, prompt tokens, generated tokens) of each finished parity/TTFT phase. A later one is
    # estimated from the smallest seconds per prompt token, after taking off the decode steps at
    # the b1 rate once it is known (short prompts are mostly decode); the smallest, because the
    # first call also pays one-time costs such as kernel compilation. A phase that still runs long
    # is stopped by the phase alarm, and the long phases come last anyway.
    walls: list[tuple[float, int, int]] = []

    def prefill_rate() -> float | None:
        step = 1.0 / result["tps"]["1"] if result["tps"].get("1") else 0.0
        rates = [max(wall - new * step, 0.1 * wall) / tokens for wall, tokens, new in walls]
        return min(rates) if rates else None

    def parity(n: int):
        t = time.perf_counter()
        try:
            out = llm.generate([{"prompt_token_ids": prompts[n]}], greedy, use_tqdm=False)[0]
        except Exception as exc:  # noqa: BLE001 - tokens without the engine's margins still count
            result["notes"].append(f"parity {_label(n)} without logprobs ({last_line(exc)})")
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompts[n]}], greedy_plain, use_tqdm=False)[0]
        walls.append((time.perf_counter() - t, n, spec["parity_new"]))
        result["parity"][str(n)] = {
            "prompt_tokens": len(out.prompt_token_ids),
            "tokens": list(out.outputs[0].token_ids),
            "logprobs": [_engine_logprobs(s) for s in (out.outputs[0].logprobs or [])],
        }

    def tps(b: int):
        runs = _timed(llm, [{"prompt_token_ids": short}] * b, gen, spec["repeats"], spec["device"])
        result["tps"][str(b)] = statistics.median(n / dt for dt, n in runs)

    def ttft(n: int):
        t = time.perf_counter()
        runs = _timed(llm, [{"prompt_token_ids": ttft_prompts[n]}], one, spec["repeats"], spec["device"])
        walls.append((time.perf_counter() - t, n * (1 + spec["repeats"]), 1 + spec["repeats"]))
        result["ttft_ms"][str(n)] = statistics.median(dt * 1e3 for dt, _ in runs)

    fns = {"parity": parity, "tps": tps, "ttft": ttft}
    for name, kind, n in engine_phases(spec):
        estimate, rate = None, prefill_rate()
        if kind != "tps" and rate:  # linear in prompt length, with a 1.5x margin
            estimate = 1.5 * rate * n * (1 + spec["repeats"] if kind == "ttft" else 1)
        prog.run(name, lambda f=fns[kind], n=n: f(n), estimate)
    return result


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = reference_child(spec) if spec["impl"] == "reference" else engine_child(spec)
    except BaseException as exc:  # noqa: BLE001 - reported as the row's error
        traceback.print_exc()
        out = Path(spec["out"])
        result = json.loads(out.read_text()) if out.exists() else {}
        result["error"] = last_line(exc)
    Path(spec["out"]).write_text(json.dumps(result))
    sys.stdout.flush()
    # Skip interpreter teardown: vLLM's engine shutdown at exit can hang or crash after the work
    # is done, and the JSON is already written.
    os._exit(0)


# --------------------------------------------------------------------------- parent
TAIL_LINES = 200


def run_child(name: str, spec: dict, workdir: Path, timeout: int) -> dict:
    """Run one child; partial results survive any failure (exception, crash, timeout)."""
    env = dict(os.environ, **COMMON_ENV)
    if name != "reference":
        env.update(IMPLS[name][0])
    out = workdir / f"{name}.json"
    # The child stops starting phases, and times out the running one, a few seconds before the
    # parent's hard kill, so its own "timeout in <phase>" record is what the parent reads.
    spec = dict(spec, impl=name, out=str(out), deadline=time.time() + timeout - 5)
    spec_path = workdir / f"{name}_spec.json"
    spec_path.write_text(json.dumps(spec))
    log = workdir / f"{name}.log"
    print(f"[{name}] running (log {log}, timeout {timeout}s)", flush=True)
    t = time.perf_counter()
    rc: int | str
    with log.open("w") as fh:
        # Its own process group, so a hard kill also ends anything the child started (compile
        # workers, helpers) and nothing keeps holding the GPU for the next child.
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(spec_path)],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    try:
        result = json.loads(out.read_text()) if out.exists() else {}
    except json.JSONDecodeError as exc:
        result = {"notes": [f"unreadable child JSON: {exc}"]}
    result.setdefault("notes", [])
    result.setdefault("phases", [])
    if rc == "timeout" or rc == 3:
        phase = result.get("timeout_in") or result.get("current_phase") or "start"
        result["timeout_in"] = phase
        result["error"] = f"timeout in {phase} (child budget {timeout}s): {_tail(log, 1)}"
    elif rc != 0 and "error" not in result:
        result["error"] = f"rc {rc}: {_tail(log, 1)}"
    result["rc"] = rc
    result["wall_s"] = time.perf_counter() - t
    result["log_tail"] = _tail(log, TAIL_LINES)
    done = ", ".join(
        f"{p['name']} {p.get('wall_s', 0):.0f}s" for p in result["phases"] if p["status"] == "ok"
    )
    print(
        f"[{name}] done in {result['wall_s']:.0f}s (phases: {done or 'none'})"
        + (f": {result['error']}" if "error" in result else ""),
        flush=True,
    )
    return result


def _tail(log: Path, n: int) -> str:
    if not log.exists():
        return "(no output)"
    lines = [ln.rstrip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return "\n".join(lines[-n:]) if lines else "(no output)"


def _margin_text(ref_step: dict, ref_tok: int, got_tok: int, got_lps: dict | None) -> str:
    """Reference margin logp(ref top-1) - logp(engine's token); the engine's own margin if known."""
    top = dict(ref_step["top"])
    parts = []
    if "row" in ref_step:
        parts.append(f"ref margin {ref_step['row'][ref_tok] - ref_step['row'][got_tok]:.3f}")
    elif got_tok in top:
        parts.append(f"ref margin {top[ref_tok] - top[got_tok]:.3f}")
    else:  # below the reference's top-k
        parts.append(f"ref margin > {top[ref_tok] - min(top.values()):.3f}")
    if got_lps:
        if str(ref_tok) in got_lps and str(got_tok) in got_lps:
            parts.append(f"engine margin {got_lps[str(got_tok)] - got_lps[str(ref_tok)]:.3f}")
        elif str(got_tok) in got_lps:
            parts.append(f"engine margin > {got_lps[str(got_tok)] - min(got_lps.values()):.3f}")
    return ", ".join(parts)


def parity_cell(ref: dict | None, got: dict | None) -> tuple[str, dict]:
    """``equal/total (div@i, ref margin m, engine margin e)`` and the same facts as a dict."""
    if got is None:
        return "", {}
    if ref is None:
        return "no reference", {}
    r, g = ref["tokens"], got["tokens"]
    info: dict = {
        "equal": sum(a == b for a, b in zip(r, g, strict=False)),
        "of": len(r),
        "prompt_tokens": [ref.get("prompt_tokens"), got.get("prompt_tokens")],
    }
    first = next((i for i, (a, b) in enumerate(zip(r, g, strict=False)) if a != b), None)
    text = f"{info['equal']}/{info['of']}"
    if first is not None:
        info["div"] = first
        lps = got.get("logprobs") or []
        margins = _margin_text(
            ref["steps"][first], r[first], g[first], lps[first] if first < len(lps) else None
        )
        info["margins"] = margins
        text += f" (div@{first}, {margins})"
    if info["prompt_tokens"][0] != info["prompt_tokens"][1]:
        text += f" [prompt tokens ref {info['prompt_tokens'][0]} vs {info['prompt_tokens'][1]}]"
    return text, info


def _missing(r: dict, phase: str) -> str:
    """Why a cell is empty: the phase's own status, or the timeout that ended the child."""
    for row in r.get("phases", []):
        if row["name"] == phase:
            if row["status"] == "skipped":
                return "skipped (budget)"
            if row["status"] == "timeout":
                return f"timeout in {phase} ({row.get('wall_s', 0):.0f}s)"
            if row["status"] == "error":
                return "error"
    if r.get("timeout_in"):
        return f"timeout in {r['timeout_in']}"
    return "-" if r.get("error") else ""


def render(args, results: dict, ref: dict, device_name: str, lens: list[int]) -> str:
    batches, ttfts = args.batch_list, args.ttft_list
    header = [
        "impl",
        "model class",
        "cudagraph_mode",
        "start (s)",
        *[f"parity {_label(n)}" for n in lens],
        *[f"b{b} tok/s" for b in batches],
        *[f"TTFT {_label(n)} (ms)" for n in ttfts],
        "cache KiB/token",
        f"cache MiB/{args.max_model_len:,}-token seq",
        "notes",
    ]
    ref_parity = ref.get("parity", {})
    lines = [
        f"qsa512 ({args.model}), {device_name}; {args.new_tokens} new tokens per request, median of "
        f"{args.repeats}; parity = greedy tokens equal to transformers (bf16, {args.device}) out of "
        f"{args.parity_new} on random prompts of {', '.join(str(n) for n in lens)} tokens; at the first "
        "divergence: ref margin = reference logprob of its top-1 minus that of the engine's token "
        f"(< ~0.1 nats: a near-tie), engine margin = the same from the engine's top-{args.logprobs}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    if "error" in ref or len(ref_parity) < len(lens):
        lines.insert(
            1, f"reference (transformers): {ref.get('error', 'incomplete')}; has {sorted(ref_parity)}"
        )
    for name, r in results.items():
        mem = r.get("memory") or {}

        def cell(value, fmt, phase, r=r):
            if value is None:
                return _missing(r, phase)
            return fmt.format(value) if abs(value) >= 10 else f"{value:.2g}"

        parity_cells = []
        for n in lens:
            got = r.get("parity", {}).get(str(n))
            text = parity_cell(ref_parity.get(str(n)), got)[0] if got else _missing(r, f"parity {_label(n)}")
            parity_cells.append(text)
        notes = list(r.get("notes", []))
        if "error" in r and r["error"] not in notes:
            notes.append(f"error: {r['error']}")
        cells = [
            name,
            r.get("model_class", ""),
            r.get("cudagraph_mode", ""),
            cell(r.get("start_s") if "model_class" in r else None, "{:.0f}", "start"),
            *parity_cells,
            *[cell(r.get("tps", {}).get(str(b)), "{:,.0f}", f"b{b} tok/s") for b in batches],
            *[cell(r.get("ttft_ms", {}).get(str(n)), "{:,.1f}", f"TTFT {_label(n)}") for n in ttfts],
            f"{mem['bytes_per_token'] / 1024:.2f}" if mem else _missing(r, "memory"),
            f"{mem['bytes_per_seq'] / 2**20:.1f}" if mem else _missing(r, "memory"),
            "; ".join(notes),
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " / ") for c in cells) + " |")
    base = results.get(BASELINE, {}).get("tps", {})
    ratios = [
        f"{name} {r['tps'][str(b)] / base[str(b)]:.1f}x at b{b}"
        for name, r in results.items()
        if name != BASELINE
        for b in batches
        if r.get("tps", {}).get(str(b)) and base.get(str(b))
    ]
    if ratios:
        lines += ["", f"Output tok/s over {BASELINE} (the baseline, same run): " + ", ".join(ratios)]
    lines += ["", "Phase wall times (s), in run order:", ""]
    for name, r in {"reference": ref, **results}.items():
        rows = [
            f"{p['name']} {p.get('wall_s', 0):.1f}" + ("" if p["status"] == "ok" else f" [{p['status']}]")
            for p in r.get("phases", [])
        ]
        lines.append(f"- {name} (total {r.get('wall_s', 0):.0f}s, rc {r.get('rc')}): " + ", ".join(rows))
    return "\n".join(lines)


def _device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception as exc:  # noqa: BLE001
        return f"cuda ({last_line(exc)})"


def write_outputs(out_dir: Path, workdir: Path, args, lens, ref, results, device_name, t0) -> str:
    """The three output files: the table, every result (with log tails), all child logs."""
    text = render(args, results, ref, device_name, lens)
    text += f"\n\nTotal {time.perf_counter() - t0:.0f}s; full child logs in {out_dir / 'logs.tar.gz'}"
    (out_dir / "bench_ours_vs_upstream.md").write_text(text + "\n")
    summary = {
        "args": {k: v for k, v in vars(args).items()},
        "parity_prompt_tokens": lens,
        "reference": ref,
        "engines": results,
        "parity": {
            name: {
                str(n): parity_cell(ref.get("parity", {}).get(str(n)), r.get("parity", {}).get(str(n)))[1]
                for n in lens
            }
            for name, r in results.items()
        },
    }
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
    with tarfile.open(out_dir / "logs.tar.gz", "w:gz") as tar:
        for log in sorted(workdir.glob("*.log")):
            tar.add(log, arcname=log.name)
    return text


def _timeouts(args, names: list[str]) -> dict[str, int]:
    """Per-child timeouts: --timeout, overridden by --timeouts name=seconds,..."""
    out = {name: args.timeout for name in names}
    for item in filter(None, (args.timeouts or "").split(",")):
        key, _, value = item.partition("=")
        if key not in out:
            raise SystemExit(f"--timeouts: unknown child {key!r} (known: {', '.join(names)})")
        out[key] = int(value)
    return out


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
    p.add_argument("--logprobs", type=int, default=5, help="top-k logprobs kept per parity step")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--ttft", default="8192,32768")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=float, default=8.0, help="same cache pool for every engine")
    p.add_argument(
        "--gpu-mem", type=float, default=0.8, help="gpu_memory_utilization (lower it beside other GPU jobs)"
    )
    p.add_argument("--timeout", type=int, default=300, help="seconds per child (hard kill)")
    p.add_argument(
        "--timeouts", help="per-child overrides, e.g. reference=120,ours-eager=150 (names of --impls)"
    )
    p.add_argument(
        "--phase-timeout", type=float, default=0, help="seconds one phase may run (0: the child's budget)"
    )
    p.add_argument(
        "--min-phase-s",
        type=float,
        default=5,
        help="start no phase with less budget left than this (or than its estimate from earlier phases)",
    )
    p.add_argument("--out", help="directory for results.json, the table and logs.tar.gz")
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
            from model.tools.checkpoints import make_checkpoint

            t = time.perf_counter()
            make_checkpoint("qsa512", args.model, train_steps=args.train_steps)
            print(f"made qsa512 in {args.model} ({time.perf_counter() - t:.0f}s)", flush=True)
    args.batch_list = [int(x) for x in args.batches.split(",")]
    args.ttft_list = [int(x) for x in args.ttft.split(",")]
    lens = sorted(int(x) for x in args.parity_lens.split(","))
    args.max_model_len = max(args.ttft_list + lens) + 64
    impls = args.impls.split(",")
    timeouts = _timeouts(args, ["reference", *impls])

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
        "logprobs": args.logprobs,
        "batches": args.batch_list,
        "ttft": args.ttft_list,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "max_model_len": args.max_model_len,
        "kv_cache_bytes": int(args.kv_cache_gib * 2**30),
        "gpu_mem": args.gpu_mem,
        "id_low": 3,
        "id_high": id_high,
        "phase_timeout": args.phase_timeout,
        "min_phase_s": args.min_phase_s,
    }
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ours_vs_upstream_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ours_vs_upstream_work_"))  # specs, child JSON, logs
    device_name = _device_name(args.device)
    t0 = time.perf_counter()
    results: dict = {}
    ref = run_child("reference", spec, workdir, timeouts["reference"])
    text = write_outputs(out_dir, workdir, args, lens, ref, results, device_name, t0)
    for name in impls:
        results[name] = run_child(name, spec, workdir, timeouts[name])
        # Rewritten after every child, so a run killed from outside still leaves its rows.
        text = write_outputs(out_dir, workdir, args, lens, ref, results, device_name, t0)
    print(text)
    ok = "error" not in ref and all("error" not in r for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
