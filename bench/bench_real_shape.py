"""The real model's shape as one rank of TP=4 computes it, on one GPU: decode tok/s by batch, time
to first token at long prompts, and how much of the GPU's memory bandwidth a batch-1 step uses.

Run on a machine with vLLM's CUDA build, from the repository root:

    PYTHONPATH=. python3 bench/bench_real_shape.py --json real_shape.json [--experts bf16,int4]

Why one rank's shape: the real model serves at TP=4 on four RTX 3090s; where those are not
available, one larger GPU can run exactly what one of those ranks computes (the ``real-rank`` preset of
``model/tools/checkpoints.py``: per-rank heads, a quarter of every expert's width, the vocabulary shard),
and a batch-1 decode step of that shape reads the bytes a 3090 rank would read. ``python -m
model.tools.planner CONFIG --speed real_shape.json`` turns the JSON into a 4x3090 estimate
(``model/tools/planner_speed.py``).

The checkpoint holds only config.json, a generation config and a tokenizer, in a temporary
directory: vLLM draws the weights itself (``load_format="dummy"``), so no 30 GB of safetensors is
written. ``output_gate_type`` is written as ``"silu"``, what transformers reads for the preset's
null (``hidden_act``), so that vLLM's own model, which rejects null, runs the same model; our plugin
writes the same value for it. ``--experts int4`` adds the compressed-tensors W4A16
``quantization_config`` that ``python -m model.tools.quantize --format w4a16 --scope experts`` writes
(routed experts only, group 128): Marlin, vLLM's int4 MoE kernel on sm_86 and sm_90.

Variants, one engine per variant and expert format, each in its own process:

* ``served``: the product's CUDA path, vLLM's Qwen4-Exp through our plugin's subclasses
  (``QWEN4EXP_CUDA_MODEL=upstream``, ``QWEN4EXP_FORCE_SM86=1`` for every choice a 3090 takes, Model
  Runner V2, Triton GDN prefill, CUDA graphs);
* ``upstream``: vLLM's own Qwen4-Exp with no plugin loaded (``VLLM_PLUGINS`` set to an empty name,
  which matches no entry point), same engine arguments. Where it cannot start, its error is recorded.
  On sm_90 it selects a CuTe-DSL hyper-connection kernel that needs ``nvidia-cutlass-dsl`` and that
  an RTX 3090 never selects; ``--in-process`` runs every engine's core in its bench process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that upstream can be given the 3090's hyper-connection
  path, as the served variant has under ``QWEN4EXP_FORCE_SM86``;
* ``served-upstream-hc``: the served path with upstream's own hyper-connection gate mix
  (``QWEN4EXP_HC_REFERENCE_ROUNDING=0``) instead of ours, which rounds as transformers does: the
  cost of that rounding.

With ``--parallel`` every engine starts at once; each holds a lock file shared while it starts and
exclusively while it times (``--timing-lock``), so no engine is timed while another still starts or
times: an engine's start is minutes of compilation and CUDA-graph capture, its timing seconds.

Throughput: ``batch`` requests of a 16-token prompt, ``--new-tokens`` each (``ignore_eos``,
greedy, no detokenization: the dummy model's tokens are outside the small tokenizer), all submitted
at once; tok/s = generated tokens / wall time, median of ``--repeats`` after one warm-up. TTFT: one
request of a random ``--ttft``-token prompt with ``max_tokens=1``, wall time of the call, median of
``--repeats`` after a warm-up. Prefix caching is off so that repeats do not hit the cache. Step =
1 / tok/s at batch 1. HBM fraction = bytes a batch-1 step reads (the rank's weights without the
embedding, experts only the top-k and the shared one, in the variant's format;
``model.tools.planner_speed.decode_bytes_per_step``) / step / ``--hbm-gbps``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("served", "served-upstream-hc", "upstream")
EXPERT_FORMATS = ("bf16", "int4")
PLUGIN_ENTRY_POINT = "qwen4exp"  # pyproject.toml, [project.entry-points."vllm.general_plugins"]
H200_HBM_GBPS = 4800.0  # NVIDIA H200: 4.8 TB/s HBM3e

# Environment per variant. ``VLLM_PLUGINS`` is a comma-separated allow-list of entry-point names
# (vllm/plugins/__init__.py); the empty name matches none, so no plugin is loaded.
VARIANT_ENV: dict[str, dict[str, str]] = {
    "served": {
        "QWEN4EXP_CUDA_MODEL": "upstream",
        "QWEN4EXP_FORCE_SM86": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
    },
    "upstream": {"VLLM_PLUGINS": "", "VLLM_USE_V2_MODEL_RUNNER": "1"},
}
# The served path with upstream's own hyper-connection gate mix instead of ours (which rounds as
# transformers does): what the reference rounding costs, side by side.
VARIANT_ENV["served-upstream-hc"] = {**VARIANT_ENV["served"], "QWEN4EXP_HC_REFERENCE_ROUNDING": "0"}
VARIANT_UNSET: dict[str, tuple[str, ...]] = {
    "served": ("VLLM_PLUGINS",),
    "served-upstream-hc": ("VLLM_PLUGINS",),
    "upstream": ("QWEN4EXP_CUDA_MODEL", "QWEN4EXP_FORCE_SM86"),
}
# ``--cpu`` (a check of this script on vLLM's CPU build, not a measurement): ours serves there.
CPU_ENV: dict[str, str] = {
    "QWEN4EXP_CUDA_MODEL": "auto",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


# ------------------------------------------------------------------------------------------------
# The checkpoint: config, generation config and tokenizer, no weights
# ------------------------------------------------------------------------------------------------


def expert_w4a16_config(config) -> dict[str, Any]:
    """The ``quantization_config`` ``python -m model.tools.quantize --format w4a16 --scope experts``
    writes for this config, built with that module's own functions from one GDN and one QSA
    layer's tensor names (its regex families cover every layer and expert)."""
    from model.runtime.expert_format import DEFAULT_GROUP
    from model.tools.quantize import Plan, ignored, quantization_config, targets

    if config.moe_intermediate_size % DEFAULT_GROUP or config.hidden_size % DEFAULT_GROUP:
        raise ValueError(
            f"int4 group {DEFAULT_GROUP} does not divide hidden {config.hidden_size} / expert width "
            f"{config.moe_intermediate_size}"
        )
    types = list(config.layer_types)
    gdn, qsa = types.index("linear_attention"), types.index("indexed_attention")
    mlp = [f"mlp.experts.0.{p}_proj.weight" for p in ("gate", "up", "down")]
    mlp += [f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
    mlp += ["mlp.gate.weight", "mlp.shared_expert_gate.weight"]
    gdn_names = [f"linear_attn.{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")]
    gdn_names += ["linear_attn.out_proj.weight"]
    qsa_names = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + ["self_attn.indexer.index_qk_proj.weight"]
    names = ["lm_head.weight", "model.embed_tokens.weight"]
    names += [f"model.layers.{gdn}.{n}" for n in gdn_names + mlp]
    names += [f"model.layers.{qsa}.{n}" for n in qsa_names + mlp]
    plan = Plan("w4a16", "experts", DEFAULT_GROUP, "absmax")
    mods = targets(names, "experts")
    return quantization_config(plan, ignored(names, set(mods)), mods)


def write_checkpoint(preset: str, out: Path, experts: str, overrides: dict[str, Any] | None = None) -> Path:
    """``out`` with config.json (the preset with ``overrides``, ``experts`` format), generation
    config and tokenizer."""
    from model.tools.checkpoints import preset_spec, text_config

    out.mkdir(parents=True, exist_ok=True)
    spec = {**preset_spec(preset), **(overrides or {})}
    if spec.get("output_gate_type") is None:
        spec["output_gate_type"] = "silu"  # transformers' reading of null (hidden_act): same model
    config, generation = text_config(spec, out)
    raw = config.to_dict()
    raw["architectures"] = ["Qwen4ExpForCausalLM"]
    raw["dtype"] = "bfloat16"
    if experts == "int4":
        raw["quantization_config"] = expert_w4a16_config(config)
    elif experts != "bf16":
        raise ValueError(f"unknown expert format {experts!r}; expected one of {EXPERT_FORMATS}")
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    generation.save_pretrained(out)
    return out


def step_bytes(checkpoint: Path, experts: str) -> int:
    """Bytes a batch-1 decode step reads at this checkpoint's shape (TP=1: it is one rank)."""
    from model.tools.planner import load_config, weights_per_rank
    from model.tools.planner_speed import decode_bytes_per_step

    config = load_config(checkpoint)
    return decode_bytes_per_step(config, 1, experts, weights_per_rank=weights_per_rank).total


def child_env(variant: str, cpu: bool) -> tuple[dict[str, str], list[str]]:
    """(variables to set, variables to remove) for one variant's engine process."""
    env = dict(VARIANT_ENV[variant])
    unset = list(VARIANT_UNSET[variant])
    if cpu:
        env.update(CPU_ENV)
        if variant.startswith("served"):
            env.pop("QWEN4EXP_FORCE_SM86", None)
            unset.append("QWEN4EXP_FORCE_SM86")
    return env, unset


# ------------------------------------------------------------------------------------------------
# One engine (child process)
# ------------------------------------------------------------------------------------------------


def effective_cudagraph_mode(worker) -> str:
    """Run in each worker: the graph mode the engine core settled on (the front end keeps what
    was asked for; a worker may lower it)."""
    return str(worker.vllm_config.compilation_config.cudagraph_mode)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(spec["env"])
    for k in spec["unset"]:
        os.environ.pop(k, None)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

    from vllm import LLM

    graphs = spec["graphs"]
    sizes = sorted(set([1, 2, 4, 8, 16, 32, 64] + spec["batches"]))
    if spec.get("sm86_hc"):
        # vLLM's own model with the hyper-connection path an RTX 3090 takes, as the served variant
        # has under QWEN4EXP_FORCE_SM86 (the CuTe-DSL kernel is sm_90+ only): this engine's core
        # runs in this process, so the switch reaches the model it builds.
        from model.upstream.optional_kernels import prepare_upstream_without_plugin

        if graphs:  # as vLLM's config would for Qwen4-Exp, before upstream is imported
            os.environ.setdefault("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
        prepare_upstream_without_plugin(graphs, force_sm86=True)
    turn = TimingTurn(spec.get("timing_lock"))
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        load_format="dummy",
        dtype="bfloat16",
        enforce_eager=not graphs,
        enable_prefix_caching=False,
        max_model_len=max(spec["ttft"]) + 64,
        max_num_seqs=max(spec["batches"]),
        gpu_memory_utilization=spec["gpu_memory_utilization"],
        **({"kv_cache_memory_bytes": spec["kv_cache_bytes"]} if spec.get("kv_cache_bytes") else {}),
        seed=0,
        additional_config={"gdn_prefill_backend": "triton"},
        **({"compilation_config": {"cudagraph_capture_sizes": sizes}} if graphs else {}),
    )
    config = llm.llm_engine.vllm_config
    result: dict[str, Any] = {
        "ok": True,
        "start_s": time.perf_counter() - t0,
        "cudagraph_mode": ",".join(sorted(set(llm.collective_rpc(effective_cudagraph_mode)))),
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "quantization": str(config.model_config.quantization),
    }
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench's timing loop
    from bench_engine_gpu import time_engine

    with turn.timing():
        result["tps"], result["ttft_ms"] = time_engine(
            llm, spec["batches"], spec["ttft"], spec["new_tokens"], spec["repeats"]
        )
        if spec.get("profile"):
            from step_profile import profile_decode

            result["profile"] = profile_decode(llm, spec["profile"], spec["new_tokens"])
    return result


class TimingTurn:
    """A lock file held shared from the process's start and exclusively while it times.

    Several engines on one GPU then start side by side, and none is timed while any other holder
    still starts (or runs anything else holding the file shared, e.g. ``flock -s FILE cmd``):
    taking the exclusive lock waits for every shared holder, so the timings run one after
    another, each on an otherwise idle GPU. Without a path it does nothing.
    """

    def __init__(self, lock_path: str | None) -> None:
        self._fh = open(lock_path, "a") if lock_path else None  # noqa: SIM115 - held for the process's life
        if self._fh:
            fcntl.flock(self._fh, fcntl.LOCK_SH)

    @contextlib.contextmanager
    def timing(self):
        if not self._fh:
            yield
            return
        fcntl.flock(self._fh, fcntl.LOCK_EX)  # gives up the shared lock first, then waits for all others'
        try:
            yield
        finally:
            fcntl.flock(self._fh, fcntl.LOCK_UN)


def run_child(spec: dict[str, Any], spec_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run one engine process; its result, or ``ok: false`` with the error it died of.

    stderr is passed through live and its tail kept: an engine that cannot start usually says why
    in the engine-core process's log, not in the exception the front end raises.
    """
    spec_path.write_text(json.dumps(spec))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(spec_path)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    deadline = time.monotonic() + timeout_s
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        tail.append(line.rstrip())
        if time.monotonic() > deadline:
            proc.kill()
            break
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    out = Path(spec["out"])
    if out.exists():
        result = json.loads(out.read_text())
        if result.get("ok"):
            return result
    else:
        result = {"ok": False}
    errors = [t for t in tail if "Error" in t or "error:" in t.lower()]
    result["error"] = result.get("error") or (errors[-1] if errors else f"engine process exited rc {rc}")
    result["stderr_tail"] = list(tail)[-15:]
    result["rc"] = rc
    return result


# ------------------------------------------------------------------------------------------------
# Table
# ------------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def render(report: dict[str, Any]) -> str:
    """One markdown table (variant x experts) plus served/upstream ratio rows, with the command."""
    batches = [str(b) for b in report["batches"]]
    ttfts = [str(n) for n in report["ttft"]]
    header = [
        "variant",
        "experts",
        *[f"b{b} (tok/s)" for b in batches],
        *[f"TTFT {int(n) / 1024:g}k (ms)" for n in ttfts],
        "step b1 (ms)",
        "bytes/step (GB)",
        "HBM fraction",
    ]
    lines = [
        f"`{report['command']}`",
        "",
        f"GPU: {report['gpu']}; bandwidth used for the HBM fraction: {report['hbm_gbps']:,.0f} GB/s; "
        f"preset {report['preset']}{' (one rank of TP=4)' if report['preset'] == 'real-rank' else ''}"
        f"{''.join(f', {k}={v}' for k, v in report.get('overrides', {}).items())}, dummy weights, {report['new_tokens']} new tokens "
        f"per request, median of {report['repeats']}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    by_key = {(r["variant"], r["experts"]): r for r in report["results"]}
    for r in report["results"]:
        head = f"| {r['variant']} | {r['experts']} | "
        if not r.get("ok"):
            err = " ".join(str(r.get("error", "failed")).split()).replace("|", "/")[:160]
            lines.append(head + f"failed: {err} |" + " |" * (len(header) - 3))
            continue
        cells = [f"{r['tps'][b]:,.1f}" for b in batches] + [f"{r['ttft_ms'][n]:,.1f}" for n in ttfts]
        step, frac = r.get("step_ms"), r.get("hbm_fraction")
        cells += [
            f"{step:.2f}" if step else "-",
            f"{r['bytes_per_step'] / 1e9:.2f}",
            f"{frac:.1%}" if frac else "-",
        ]
        lines.append(head + " | ".join(cells) + " |")
    for experts in report["experts"]:
        for base in ("upstream", "served-upstream-hc"):
            served, other = by_key.get(("served", experts)), by_key.get((base, experts))
            lines += ratio_row(served, other, base, experts, batches, ttfts)
    for r in report["results"]:
        if r.get("profile"):
            from step_profile import render as render_profile

            lines += [
                "",
                f"Batch-1 decode step of {r['variant']}/{r['experts']} (bench/step_profile.py):",
                "",
            ]
            lines.append(render_profile(r["profile"]))
    return "\n".join(lines)


def ratio_row(
    served: dict | None, base: dict | None, base_name: str, experts: str, batches: list[str], ttfts: list[str]
) -> list[str]:
    """The served variant's numbers over ``base``'s, one table row (none where either failed)."""
    if not (served and base and served.get("ok") and base.get("ok")):
        return []
    cells = [_ratio(served["tps"][b], base["tps"][b]) for b in batches]
    cells += [_ratio(served["ttft_ms"][n], base["ttft_ms"][n]) for n in ttfts]
    cells += [
        _ratio(served.get("step_ms"), base.get("step_ms")),
        "",
        _ratio(served.get("hbm_fraction"), base.get("hbm_fraction")),
    ]
    return [f"| served / {base_name} | {experts} | " + " | ".join(cells) + " |"]


def gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    p.add_argument("--experts", default="bf16", help=f"comma-separated expert formats, of {EXPERT_FORMATS}")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--ttft", default="8192,32768", help="prompt lengths (tokens) for time to first token")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--hbm-gbps", type=float, default=H200_HBM_GBPS, help="the GPU's memory bandwidth (H200: 4800)"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        help="reserve this many bytes of KV cache instead of profiling free memory (a GPU shared with "
        "other jobs: vLLM's profiling fails when another process's memory changes meanwhile)",
    )
    p.add_argument(
        "--timing-lock",
        metavar="FILE",
        help="engines hold FILE shared while they start and exclusively while they time: benches (and other "
        "jobs under flock -s FILE) started side by side then build in parallel and time in turn on an idle GPU",
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        help="start every engine at once and time them in turn once all have started (needs "
        "--kv-cache-bytes; a lock file in the temporary directory unless --timing-lock names one)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="every engine's core in its front end's process, and upstream with the hyper-connection "
        "kernels an RTX 3090 takes (its CuTe-DSL one is sm_90+ only and needs nvidia-cutlass-dsl)",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after timing, profile batch-1 decode steps (bench/step_profile.py) into DIR/<variant>-<experts>; "
        "implies --in-process (the profiler must see the engine core's kernels)",
    )
    p.add_argument("--child-timeout", type=float, default=1800.0, help="seconds per engine process")
    p.add_argument("--json", help="write every number here (input of python -m model.tools.planner --speed)")
    p.add_argument("--keep-checkpoints", help=argparse.SUPPRESS)  # a directory to write them to instead
    p.add_argument("--preset", default="real-rank", help=argparse.SUPPRESS)  # a smaller shape, for checks
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="override a config field of the preset, e.g. indexer_n_heads=4 (the widest index vLLM's own "
        "indexer prefill launcher fits on an H200, for a served/upstream ratio where upstream cannot "
        "launch the real 16 heads)",
    )
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)  # vLLM's CPU build: ours, eager
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(Path(args.child).read_text())
        try:
            result = child(spec)
        except Exception as exc:  # noqa: BLE001 - recorded for the table, then the process fails
            Path(spec["out"]).write_text(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
            raise
        Path(spec["out"]).write_text(json.dumps(result))
        return 0

    variants = [v for v in args.variants.split(",") if v]
    experts = [e for e in args.experts.split(",") if e]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {VARIANTS}")
    for e in experts:
        if e not in EXPERT_FORMATS:
            p.error(f"unknown expert format {e!r}; choose from {EXPERT_FORMATS}")
    overrides: dict[str, Any] = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item!r}: expected FIELD=JSON, e.g. indexer_n_heads=4")
        try:
            overrides[field] = json.loads(value)
        except json.JSONDecodeError as exc:
            p.error(f"--set {item!r}: the value is not JSON ({exc})")
    if args.parallel and not args.kv_cache_bytes:
        p.error("--parallel needs --kv-cache-bytes: vLLM's memory profiling fails while other engines start")
    if args.profile:
        args.in_process = True
    batches = [int(x) for x in args.batches.split(",")]
    ttft = [int(x) for x in args.ttft.split(",")]
    report: dict[str, Any] = {
        "command": "python3 bench/bench_real_shape.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "gpu": gpu_name(),
        "hbm_gbps": args.hbm_gbps,
        "preset": args.preset,
        "overrides": overrides,
        "tp_of_preset": 4,
        "batches": batches,
        "ttft": ttft,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "experts": experts,
        "results": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.keep_checkpoints) if args.keep_checkpoints else Path(tmp)
        lock = args.timing_lock or (str(Path(tmp) / "timing.lock") if args.parallel else None)
        jobs: list[tuple[dict[str, Any], int]] = []
        for fmt in experts:
            ckpt = write_checkpoint(args.preset, base / f"{args.preset}-{fmt}", fmt, overrides)
            nbytes = step_bytes(ckpt, fmt)
            for variant in variants:
                env, unset = child_env(variant, args.cpu)
                if args.in_process:
                    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
                spec = {
                    "variant": variant,
                    "experts": fmt,
                    "model": str(ckpt),
                    "env": env,
                    "unset": unset,
                    "graphs": not args.cpu,
                    "batches": batches,
                    "ttft": ttft,
                    "new_tokens": args.new_tokens,
                    "repeats": args.repeats,
                    "gpu_memory_utilization": args.gpu_memory_utilization,
                    "kv_cache_bytes": args.kv_cache_bytes,
                    "timing_lock": lock,
                    "sm86_hc": args.in_process and variant == "upstream",
                    "profile": str(Path(args.profile) / f"{variant}-{fmt}") if args.profile else None,
                    "out": str(Path(tmp) / f"{variant}-{fmt}.json"),
                }
                jobs.append((spec, nbytes))

        def one(job: tuple[dict[str, Any], int]) -> dict[str, Any]:
            spec, nbytes = job
            r = run_child(spec, Path(spec["out"]).with_suffix(".spec.json"), args.child_timeout)
            r.update(variant=spec["variant"], experts=spec["experts"], bytes_per_step=nbytes, env=spec["env"])
            if r.get("ok"):
                step = 1.0 / r["tps"]["1"] if r["tps"].get("1") else None
                r["step_ms"] = step * 1e3 if step else None
                r["hbm_fraction"] = nbytes / step / (args.hbm_gbps * 1e9) if step else None
            else:
                print(f"{spec['variant']}/{spec['experts']}: engine failed: {r['error']}", file=sys.stderr)
            return r

        if args.parallel:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                report["results"] = list(pool.map(one, jobs))
        else:
            report["results"] = [one(job) for job in jobs]

    text = render(report)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_real_shape.md").write_text(text + "\n")
        Path(out, "bench_real_shape.json").write_text(json.dumps(report, indent=2) + "\n")
    # Benches only measure: vLLM's own model failing to start is a finding, not a failure.
    return 1 if any(not r.get("ok") and r["variant"] == "served" for r in report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
