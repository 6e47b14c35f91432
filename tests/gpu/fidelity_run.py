"""Teacher-forced fidelity of the CUDA paths against transformers in float32, and where they lose it.

``python -m tests.gpu.fidelity_run --out DIR [--shapes holdout,drawn-1,CHECKPOINT_DIR,...] [--lengths 600,2500,...]
[--prompt-kind salted,repeated | --prompts FILE.json] [--init random|transformers]
[--runs upstream:eager,upstream:graphs,ours:eager,upstream:graphs+fp8+upstream-hc] [--diagnose upstream]``

Prompts: ``salted`` (shuffled corpus with random tokens, ``measure.prompts_of_lengths``), ``repeated``
(the corpus repeated exactly, ``measure.repeated_prompts``: a near-tie recurs at every copy), both
(each length twice), or a JSON file of ``{name: token ids}``. ``--init transformers`` keeps
transformers' own initialisation of generated shapes (flat distributions, many near-ties). A run's
mode may add ``+fp8`` (the FP8 E4M3 QSA cache), ``+ssm32`` (float32 GDN state), ``+upstream-hc``
(upstream's own hyper-connection gate mix, ``QWEN4EXP_HC_REFERENCE_ROUNDING=0``), ``+tp2``/``+tp4``
(tensor parallelism over that many GPUs), ``+nop2p`` (``NCCL_P2P_DISABLE=1``: all-reduce through host
memory, as on GPUs without peer access) and ``+noar`` (vLLM's custom all-reduce off, NCCL's instead).

For each shape: a random-weight checkpoint (``model.tools.checkpoints``; or a checkpoint directory of
one's own, with its tokenizer), transformers' float32 reference
and bfloat16 yardstick on the GPU (``tests.fidelity.measure``), then one engine per run in its own
process (``QWEN4EXP_CUDA_MODEL``, CUDA graphs or eager, the 3090's paths forced with
``QWEN4EXP_FORCE_SM86=1``). ``--diagnose IMPL`` also runs IMPL in-process with forward hooks on
every sublayer (GDN, QSA attention, MoE, PLE, final norm) and reports each sublayer's relative error
against float32 beside transformers-bf16's: the first sublayer far above the yardstick is where
precision is lost. Writes ``DIR/fidelity.json`` and ``DIR/fidelity.md``; ``tests/gpu/
test_fidelity_cuda.py`` asserts on them.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

from tests.fidelity import measure
from tests.gpu.engine import cuda_engine_args

SUBLAYERS = ("ple", "linear_attn", "self_attn", "mlp")
ENGINE_TIMEOUT_S = int(os.environ.get("FIDELITY_ENGINE_TIMEOUT_S", "900"))
DEVICE = os.environ.get("FIDELITY_DEVICE", "cuda")  # "cpu": try the harness itself on vLLM's CPU build
DIAGNOSIS_TOKENS = int(os.environ.get("FIDELITY_DIAGNOSIS_TOKENS", "600"))


def mode_flags(mode: str) -> list[str]:
    """The ``+`` options of a run mode (``graphs+fp8+upstream-hc`` -> ``["fp8", "upstream-hc"]``)."""
    return mode.split("+")[1:]


def engine_env(impl: str, mode: str = "eager") -> dict[str, str]:
    env = {
        "QWEN4EXP_CUDA_MODEL": impl,
        "VLLM_USE_V2_MODEL_RUNNER": "1" if impl == "upstream" else "0",
        "QWEN4EXP_FORCE_SM86": os.environ.get("QWEN4EXP_FORCE_SM86", "1"),
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }
    if "upstream-hc" in mode_flags(mode):
        env["QWEN4EXP_HC_REFERENCE_ROUNDING"] = "0"
    if "nop2p" in mode_flags(mode):
        env["NCCL_P2P_DISABLE"] = "1"
    return env


def tensor_parallel_size(mode: str) -> int:
    """The ``+tpN`` option of a run mode (1 without one)."""
    sizes = [int(flag[2:]) for flag in mode_flags(mode) if flag.startswith("tp") and flag[2:].isdigit()]
    return sizes[-1] if sizes else 1


def engine_args(mode: str, max_len: int) -> dict:
    """``mode``: ``eager`` or ``graphs``, optionally ``+ssm32`` (GDN recurrent state kept in float32
    between steps, vLLM's ``mamba_ssm_cache_dtype``) and ``+fp8`` (the FP8 E4M3 QSA cache, scales
    1.0)."""
    extra: dict = {}
    if "ssm32" in mode_flags(mode):
        extra["mamba_ssm_cache_dtype"] = "float32"
    if "fp8" in mode_flags(mode):
        extra["kv_cache_dtype"] = "fp8"
    if (tp := tensor_parallel_size(mode)) > 1:
        extra["tensor_parallel_size"] = tp
    if "noar" in mode_flags(mode):
        extra["disable_custom_all_reduce"] = True
    return cuda_engine_args(
        graphs=mode.split("+")[0] == "graphs",
        graph_sizes=(1, 2, 4, 8),
        # several engines share one GPU: each checks only that this fraction is free when it starts
        gpu_memory_utilization=float(os.environ.get("FIDELITY_GPU_UTILIZATION", "0.12")),
        max_model_len=max_len + 16,
        kv_cache_memory_bytes=4 << 30,
        max_num_seqs=8,
        **extra,
    )


def _engine_child(path: str, impl: str, mode: str, prompts, out: str) -> None:
    os.environ.update(engine_env(impl, mode))
    for name in ("VLLM_QSA_KV_SCALES", "VLLM_QSA_KV_COLLECT", "VLLM_QSA_KV_CLIP_COUNT"):
        os.environ.pop(name, None)  # FP8: scales 1.0, nothing collected
    from vllm import LLM

    llm = LLM(model=path, **engine_args(mode, max(map(len, prompts))))
    observed = []
    for ids in prompts:  # one at a time, so a slow or stuck prompt shows in the log
        t0 = time.time()
        observed += measure.vllm_token_logprobs(llm, [ids])
        print(f"[engine {impl}] {len(ids)} tokens: {time.time() - t0:.1f}s", flush=True)
    torch.save([(o.logprobs, o.top1) for o in observed], out)
    _leave(llm)


def _leave(llm) -> None:
    """Shut the engine down and end the process now: a child holding an LLM can otherwise hang at
    interpreter exit (its engine-core process outlives it), and the parent would wait for nothing."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # the result is saved already; the exit matters, not the shutdown
        print(f"engine shutdown: {type(exc).__name__}: {exc}", flush=True)
    sys.stdout.flush()
    os._exit(0)


def _wait(proc, out: Path) -> None:
    """Until ``proc`` exits, or its result file exists and it had 30 s to exit, or the timeout."""
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    written_at = None
    while proc.is_alive() and time.monotonic() < deadline:
        proc.join(2)
        if written_at is None and out.exists():
            written_at = time.monotonic()
        if written_at is not None and time.monotonic() - written_at > 30:
            break
    if proc.is_alive():
        proc.kill()
        proc.join()


def run_engine(path: Path, impl: str, mode: str, prompts, out: Path) -> list[measure.Observed] | str:
    ctx = mp.get_context("spawn")
    out.unlink(missing_ok=True)
    proc = ctx.Process(target=_engine_child, args=(str(path), impl, mode, prompts, str(out)))
    proc.start()
    _wait(proc, out)
    if not out.exists():
        return f"engine gave no result (exit code {proc.exitcode}; timeout {ENGINE_TIMEOUT_S} s)"
    return [measure.Observed(lp, t1) for lp, t1 in torch.load(out)]


# --- per-sublayer diagnosis ---------------------------------------------------------------------

_CAPTURED: dict[str, torch.Tensor] = {}


def _hook_model(model: torch.nn.Module, tokens: int, engine: bool) -> None:
    """Forward hooks that keep each sublayer's input and output (PLE: its contribution) for a pass
    of ``tokens``: ``<name>`` and ``<name>.in``. An error that grows from input to output more than
    transformers-bf16's does is lost inside that sublayer."""

    def rows(x):
        x = x[0] if isinstance(x, tuple) else x
        if not isinstance(x, torch.Tensor):
            return None
        if x.dim() == 3:
            x = x[0]
        return x if x.shape[0] == tokens else None

    def keep(name: str, is_ple: bool):
        def hook(module, args, kwargs, output):
            inp = rows(args[0]) if args else rows(next(iter(kwargs.values()), None))
            out = rows(output)
            if out is None:
                return
            if is_ple and engine and inp is not None:  # the engines' PLE layers return streams + contribution
                out = out - inp
            _CAPTURED[name] = out.detach().float().cpu()
            if inp is not None:
                _CAPTURED[name + ".in"] = inp.detach().float().cpu()

        return hook

    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 3 and parts[-2].isdigit() and parts[-1] in SUBLAYERS and parts[-3] == "layers":
            module.register_forward_hook(
                keep(f"layers.{parts[-2]}.{parts[-1]}", parts[-1] == "ple"), with_kwargs=True
            )


@functools.lru_cache(maxsize=2)  # float32 and bfloat16 of one shape, shared by every diagnosed engine
def _reference_sublayers(path: Path, ids: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import Qwen4ExpForCausalLM

    _CAPTURED.clear()
    model = Qwen4ExpForCausalLM.from_pretrained(str(path), dtype=dtype).to(DEVICE).eval()
    _hook_model(model, len(ids), engine=False)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids], device=DEVICE))
    found = dict(_CAPTURED)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return found


def _diagnose_child(path: str, impl: str, ids: list[int], out: str) -> None:
    impl, _, flags = impl.partition("+")  # e.g. upstream+upstream-hc
    os.environ.update(engine_env(impl, "eager+" + flags))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, **engine_args("eager", len(ids)), max_num_batched_tokens=max(len(ids), 2048))
    llm.apply_model(lambda model: _hook_model(model, len(ids), engine=True))
    _CAPTURED.clear()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    torch.save(dict(_CAPTURED), out)
    _leave(llm)


def diagnose(path: Path, impl: str, ids: list[int], workdir: Path) -> list[dict]:
    """Each sublayer's relative error against float32 for ``impl`` and for transformers-bf16."""
    out = workdir / f"sublayers-{impl}.pt"
    ctx = mp.get_context("spawn")
    out.unlink(missing_ok=True)
    proc = ctx.Process(target=_diagnose_child, args=(str(path), impl, ids, str(out)))
    proc.start()
    _wait(proc, out)
    if not out.exists():
        return [{"error": f"diagnosis engine exited with {proc.exitcode}"}]
    engine = torch.load(out)
    ref32 = _reference_sublayers(path, tuple(ids), torch.float32)
    ref16 = _reference_sublayers(path, tuple(ids), torch.bfloat16)

    def order(name: str) -> tuple[int, int]:
        layer, kind = name.split(".")[1:3]
        return int(layer), SUBLAYERS.index(kind)

    rows = []
    for name in sorted((n for n in ref32 if not n.endswith(".in")), key=order):
        row = {"sublayer": name}
        for key, label in ((name + ".in", "in"), (name, "out")):
            ref = ref32.get(key)
            if ref is None:
                continue
            norm = float(ref.norm()) or 1.0
            row[f"bf16_{label}"] = float((ref16[key] - ref).norm()) / norm
            got = engine.get(key)
            if got is None or got.shape != ref.shape:
                row[f"{impl}_{label}"] = None
                row[f"note_{label}"] = "not captured" if got is None else f"shape {tuple(got.shape)}"
            else:
                row[f"{impl}_{label}"] = float((got - ref).norm()) / norm
        rows.append(row)
    return rows


# --- main ----------------------------------------------------------------------------------------


def main() -> int:
    from model.tools.checkpoints import make_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--shapes", default="holdout,drawn-1,drawn-8", help="presets, drawn-<seed> or checkpoint directories"
    )
    parser.add_argument("--lengths", default="4,600,2500,6000,16000")
    parser.add_argument("--prompt-kind", default="salted", choices=("salted", "repeated", "both"))
    parser.add_argument("--prompts", default="", help="JSON file {name: token ids}; replaces --lengths")
    parser.add_argument("--init", default="random", choices=("random", "transformers"))
    parser.add_argument("--seed", type=int, default=0, help="weights of generated shapes")
    parser.add_argument("--runs", default="upstream:eager,upstream:graphs,ours:eager")
    parser.add_argument(
        "--references",
        default="",
        help="file of transformers' float32 and bfloat16 results for these prompts (one shape): loaded if it "
        "exists and holds the same prompts and weights, else computed and written (to share them between runs)",
    )
    parser.add_argument(
        "--diagnose",
        default="",
        help="implementations (comma-separated, each optionally +upstream-hc) to hook per sublayer on the "
        "first prompt of at least 600 tokens (cut to 600)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    given = json.loads(Path(args.prompts).read_text()) if args.prompts else None
    labels = list(given) if given else prompt_labels(lengths, args.prompt_kind)
    results: dict = {"lengths": labels, "shapes": {}}
    for shape in args.shapes.split(","):
        t0 = time.time()
        if Path(shape).is_dir():  # a checkpoint of one's own (config, weights and tokenizer)
            ckpt, shape = Path(shape), Path(shape).name
        else:
            ckpt = out / "ckpt" / shape
            if not (ckpt / "model.safetensors").exists():
                make_checkpoint(shape, ckpt, seed=args.seed, train_steps=0, device=DEVICE, init=args.init)
        prompts = list(given.values()) if given else make_prompts(ckpt, lengths, args.prompt_kind)
        ref32, ref16 = references(ckpt, prompts, Path(args.references) if args.references else None)
        entry: dict = {"transformers-bf16": {}, "runs": {}}
        if args.diagnose:  # first: it names the sublayer to look at while the full runs go on
            longest = max(prompts, key=len)
            ids = next((p for p in prompts if len(p) >= DIAGNOSIS_TOKENS), longest)[:DIAGNOSIS_TOKENS]
            for impl in args.diagnose.split(","):
                entry.setdefault("diagnosis", {})[impl] = diagnose(ckpt, impl, ids, out)
                for row in entry["diagnosis"][impl]:
                    print(f"[{shape}] diag {impl} {json.dumps(row)}", flush=True)
        for i, n in enumerate(labels):
            entry["transformers-bf16"][n] = measure.as_dict(
                measure.fidelity([ref32[i]], measure.as_observed([ref16[i]]))
            )
        entry["transformers-bf16"]["all"] = measure.as_dict(
            measure.fidelity(ref32, measure.as_observed(ref16))
        )
        print(f"[{shape}] references in {time.time() - t0:.0f}s", flush=True)
        for run in filter(None, args.runs.split(",")):  # none: references and diagnosis only
            impl, mode = run.split(":")
            got = run_engine(ckpt, impl, mode, prompts, out / f"{shape}-{impl}-{mode}.pt")
            if isinstance(got, str):
                entry["runs"][run] = {"error": got}
            else:
                per = {
                    n: measure.as_dict(measure.fidelity([ref32[i]], [got[i]])) for i, n in enumerate(labels)
                }
                per["all"] = measure.as_dict(measure.fidelity(ref32, got))
                entry["runs"][run] = per
            print(
                f"[{shape}] {run}: {json.dumps(entry['runs'][run].get('all', entry['runs'][run]))}",
                flush=True,
            )
        results["shapes"][shape] = entry
        (out / "fidelity.json").write_text(json.dumps(results, indent=1))
    (out / "fidelity.md").write_text(render(results))
    print(render(results))
    return 0


def references(ckpt: Path, prompts: list[list[int]], cache: Path | None):
    """transformers' float32 reference and bfloat16 yardstick for ``prompts``, from ``cache`` when it
    holds these prompts (the references of one checkpoint are the same for every run of it, and
    transformers' reference GDN is slow on a GPU without its optional kernels)."""
    weights = weights_digest(ckpt)
    if cache is not None and cache.exists():
        saved = torch.load(cache, weights_only=False)
        if saved["prompts"] == prompts and saved.get("weights") == weights:
            print(f"references from {cache} (computed on {saved['device']})", flush=True)
            return saved["ref32"], saved["ref16"]
        print(f"{cache} holds other prompts or weights: computing the references again", flush=True)
    ref32 = measure.transformers_token_logprobs(ckpt, prompts, torch.float32, DEVICE)
    ref16 = measure.transformers_token_logprobs(ckpt, prompts, torch.bfloat16, DEVICE)
    if cache is not None:
        saved = {"prompts": prompts, "weights": weights, "device": DEVICE, "ref32": ref32, "ref16": ref16}
        torch.save(saved, cache)
    return ref32, ref16


def weights_digest(ckpt: Path) -> str:
    """SHA-256 of the checkpoint's weight files: references are reused only for the same weights (a
    checkpoint regenerated under another torch or transformers may draw other values)."""
    digest = hashlib.sha256()
    for path in sorted(ckpt.glob("*.safetensors")):
        with path.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def prompt_labels(lengths: list[int], kind: str) -> list[str | int]:
    """Result keys of the prompts :func:`make_prompts` makes: the length, ``r<length>`` if repeated."""
    salted = lengths if kind in ("salted", "both") else []
    return [*salted, *(f"r{n}" for n in lengths if kind in ("repeated", "both"))]


def make_prompts(ckpt: Path, lengths: list[int], kind: str) -> list[list[int]]:
    prompts = measure.prompts_of_lengths(ckpt, lengths) if kind in ("salted", "both") else []
    return prompts + (measure.repeated_prompts(ckpt, lengths) if kind in ("repeated", "both") else [])


def render(results: dict) -> str:
    lines = [
        "mean |delta| nats / p99 / top-1 agreement on decisive positions, vs transformers float32",
        "",
        "| " + " | ".join(["shape", "prompt tokens", "transformers bf16", *_runs(results)]) + " |",
        "|---|---|---|" + "---|" * len(_runs(results)),
    ]
    for shape, entry in results["shapes"].items():
        for n in [*results["lengths"], "all"]:
            cells = [_cell(entry["transformers-bf16"].get(n) or entry["transformers-bf16"].get(str(n)))]
            for run in _runs(results):
                r = entry["runs"].get(run, {})
                cells.append(r["error"] if "error" in r else _cell(r.get(n) or r.get(str(n))))
            lines.append(f"| {shape} | {n} | " + " | ".join(cells) + " |")
    for shape, entry in results["shapes"].items():
        lines += render_diagnosis(shape, entry.get("diagnosis") or {})
    return "\n".join(lines) + "\n"


def render_diagnosis(shape: str, diagnosis: dict[str, list[dict]]) -> list[str]:
    """Each sublayer's relative error against float32, input -> output, for transformers-bf16 and
    every diagnosed implementation side by side (one table per shape)."""
    impls = [impl for impl, rows in diagnosis.items() if rows and "error" not in rows[0]]
    if not impls:
        return [f"\n{shape}: diagnosis failed: {rows[0]['error']}" for rows in diagnosis.values() if rows]
    lines = [
        "",
        f"{shape}: per-sublayer relative error vs float32, input -> output",
        "",
        "| sublayer | transformers bf16 | " + " | ".join(impls) + " |",
        "|---|---|" + "---|" * len(impls),
    ]
    by_impl = {impl: {row["sublayer"]: row for row in diagnosis[impl]} for impl in impls}
    for name, first in by_impl[impls[0]].items():
        cells = [f"{first['bf16_in']:.4f} -> {first['bf16_out']:.4f}"]
        for impl in impls:
            row = by_impl[impl].get(name)
            cells.append(f"{row[f'{impl}_in']:.4f} -> {row[f'{impl}_out']:.4f}" if row else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _runs(results: dict) -> list[str]:
    seen: list[str] = []
    for entry in results["shapes"].values():
        seen += [r for r in entry["runs"] if r not in seen]
    return seen


def _cell(f: dict | None) -> str:
    if not f:
        return "-"
    agree = "n/a" if f["decisive"] == 0 else f"{100 * f['top1_agreement']:.0f}%"
    return f"{f['mean_abs']:.4f} / {f['p99_abs']:.3f} / {agree}"


if __name__ == "__main__":
    sys.exit(main())
