"""Where vLLM-on-CUDA and transformers part ways: tokens, engine variants and per-layer errors.

Run on the lent GPU with vLLM's CUDA build importable, from the repository root:

    PYTHONPATH=. python3 bench/gpu_parity_probe.py --out DIR [--checkpoints tiny=checkpoints/tiny,...]

For every checkpoint it

1. runs transformers' reference greedy loop on the CPU (the parity tests' reference) and on CUDA
   for the 8 parity prompts (24 new tokens, full log-probabilities kept);
2. runs our plugin through vLLM on CUDA (one engine per child process, V1 runner, eager) in
   variants that each swap one CUDA-specific part for another: the QSA Triton kernel for the torch
   reference, PLE prefetch off, PLE tables in GPU memory, an fp32 GDN state cache;
3. for the longest prompts, records every decoder layer's output streams and each sub-module's
   input/output (PLE, GDN/QSA mixer, MoE) in the prefill, and the QSA selections, and compares
   them (a) with the reference's on the CPU and on CUDA (the CUDA-vs-CPU difference of the
   reference itself is the bf16 noise floor), (b) sub-module by sub-module, feeding *our* captured
   input to the reference's module on CUDA, so each error is local to that module.

Everything printed also lands in DIR/probe.log; DIR/probe.json holds the token lists.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NEW_TOKENS = 24
LOG_FILE: list[Path] = []


def log(msg: str = "") -> None:
    """Print and append to DIR/probe.log at once (a run cut short still leaves its log)."""
    print(msg, flush=True)
    for f in LOG_FILE:
        with f.open("a") as fh:
            fh.write(msg + "\n")


# ------------------------------------------------------------------------------------ reference


def load_ref(path: str, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    model.eval()
    return model


@torch.no_grad()
def ref_greedy(model, prompt: list[int], n: int, device: str) -> tuple[list[int], list[torch.Tensor]]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt], device=device)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    out, lps = [], []
    for _ in range(n):
        step = logits[0, -1].float().log_softmax(-1)
        token = int(step.argmax())
        out.append(token)
        lps.append(step.cpu())
        logits = model(
            input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True
        ).logits
    return out, lps


@torch.no_grad()
def ref_capture(model, prompt: list[int], device: str) -> dict[str, torch.Tensor]:
    """Every decoder layer's output and each sub-module's input/output for one prefill (no cache)."""
    cap: dict[str, torch.Tensor] = {}
    handles = []

    def record(key):
        def hook(mod, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            o = out[0] if isinstance(out, tuple) else out
            cap[key + ".in"] = x.detach().float().cpu()[0]
            cap[key + ".out"] = o.detach().float().cpu()[0]

        return hook

    def record_mask(key):
        def hook(mod, args, kwargs, out):
            cap.setdefault(key, []).append(out.detach().cpu()[0, 0])

        return hook

    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(record(f"layer{i}"), with_kwargs=True))
        for sub in ("ple", "linear_attn", "self_attn", "mlp"):
            m = getattr(layer, sub, None)
            if m is not None:
                handles.append(m.register_forward_hook(record(f"layer{i}.{sub}"), with_kwargs=True))
        if getattr(layer, "self_attn", None) is not None:
            handles.append(
                layer.self_attn.indexer.register_forward_hook(record_mask("selected_mask"), with_kwargs=True)
            )
    # The indexer ranks blocks with ``scores.topk(k, dim=0)`` on 1-D scores, one call per query
    # (in query order); record the scores to measure selection margins.
    original_topk = torch.Tensor.topk
    scores_log: list[torch.Tensor] = []

    def topk(self, k, dim=-1, largest=True, sorted=True):
        if self.dim() == 1:
            scores_log.append(self.detach().float().cpu())
        return original_topk(self, k, dim=dim, largest=largest, sorted=sorted)

    torch.Tensor.topk = topk
    try:
        model(input_ids=torch.tensor([prompt], device=device), use_cache=False)
    finally:
        torch.Tensor.topk = original_topk
        for h in handles:
            h.remove()
    cap["block_scores"] = scores_log
    return cap


def selection_margin(scores: torch.Tensor, ours_only: set[int], ref_only: set[int], ratio: int) -> str:
    """Reference block scores of the blocks only one side selected, relative to the score scale."""
    ob = sorted({t // ratio for t in ours_only})
    rb = sorted({t // ratio for t in ref_only})
    scale = float(scores.abs().max()) or 1.0
    so = [float(scores[b]) for b in ob if b < scores.numel()]
    sr = [float(scores[b]) for b in rb if b < scores.numel()]
    gap = (min(sr) - max(so)) / scale if so and sr else float("nan")
    return f"ref scores ours-only {[f'{x:.4g}' for x in so]} ref-only {[f'{x:.4g}' for x in sr]} (gap/max {gap:.2e})"


def rel_err_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token ||a - b|| / ||b||."""
    a, b = a.float().reshape(a.shape[0], -1), b.float().reshape(b.shape[0], -1)
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def buckets(err: torch.Tensor, size: int = 64) -> str:
    parts = []
    for s in range(0, err.shape[0], size):
        parts.append(f"{float(err[s : s + size].max()):.1e}")
    return " ".join(parts) + f" | last {float(err[-1]):.1e}"


# ------------------------------------------------------------------------------------ engine child


def child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.update(spec.get("env", {}))
    from vllm import LLM, SamplingParams

    from tests.gpu import probe

    kwargs = dict(
        model=spec["path"],
        dtype="bfloat16",
        enforce_eager=spec.get("eager", True),
        enable_prefix_caching=False,
        max_model_len=2048,
        seed=0,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=2 << 30,
        additional_config={"gdn_prefill_backend": "triton"},
    )
    kwargs.update(spec.get("engine", {}))
    t0 = time.time()
    llm = LLM(**kwargs)
    result: dict = {"start_s": round(time.time() - t0, 1)}
    result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    if "qsa_kernel" in spec:
        llm.apply_model(functools.partial(probe.set_qsa_kernel, enabled=spec["qsa_kernel"]))
    result["describe"] = llm.apply_model(probe.describe)[0]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = spec["prompts"]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts.values()], params, use_tqdm=False)
    result["tokens"] = {name: list(o.outputs[0].token_ids) for name, o in zip(prompts, outs, strict=True)}
    for name in spec.get("capture", []):
        ids = prompts[name]
        llm.apply_model(functools.partial(probe.install_capture, num_tokens=len(ids)))
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
        cap = llm.apply_model(probe.fetch_capture)[0]
        llm.apply_model(probe.remove_capture)
        torch.save(cap, Path(spec["out"]).with_suffix(f".{name}.pt"))
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


def run_child(spec: dict, workdir: Path, timeout: float) -> dict | None:
    spec_path = workdir / f"spec_{spec['tag']}.json"
    spec["out"] = str(workdir / f"res_{spec['tag']}.json")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    t0 = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(spec_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        log(f"  [{spec['tag']}] TIMEOUT after {timeout:.0f} s")
        return None
    (workdir / f"child_{spec['tag']}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        log(f"  [{spec['tag']}] FAILED rc={proc.returncode}; tail:\n" + (proc.stdout + proc.stderr)[-3000:])
        return None
    res = json.loads(Path(spec["out"]).read_text())
    res["wall_s"] = round(time.time() - t0, 1)
    return res


# ------------------------------------------------------------------------------------ comparisons


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def describe_tokens(tag: str, got: dict, ref: dict, ref_lps: dict) -> int:
    same = 0
    cells = []
    for name, r in ref.items():
        i = first_diff(got[name], r)
        if i is None:
            same += 1
            continue
        lp = ref_lps[name][i]
        gap = float(lp[r[i]] - lp[got[name][i]])
        top2 = lp.topk(2).values
        cells.append(f"{name}@{i} (ref gap {gap:.3f} nats, ref top-2 margin {float(top2[0] - top2[1]):.3f})")
    log(f"  {tag}: {same}/{len(ref)} identical" + ("; " + "; ".join(cells) if cells else ""))
    return same


def selection_sets(sel: torch.Tensor, count: torch.Tensor) -> list[set[int]]:
    return [set(int(x) for x in sel[i, : int(count[i])].tolist() if x >= 0) for i in range(sel.shape[0])]


def mask_sets(mask: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(mask[i]).flatten().tolist()) for i in range(mask.shape[0])]


@torch.no_grad()
def isolated(
    ref_model, ours: dict, layer: int, sub: str, prompt: list[int], device: str
) -> torch.Tensor | None:
    """The reference's sub-module on OUR captured input (CUDA), vs our output: per-token error."""
    key = f"layer{layer}.{sub}"
    if key + ".in" not in ours:
        return None
    mod = getattr(ref_model.model.layers[layer], sub)
    x = ours[key + ".in"].to(device, torch.bfloat16)[None]
    T = x.shape[1]
    if sub == "linear_attn":
        out = mod(x)
        mine = ours[key + ".out"]
    elif sub == "mlp":
        out = mod(x)
        mine = ours[key + ".out"]
    elif sub == "ple":
        out = mod(x, torch.tensor([prompt], device=device), None)
        mine = ours[key + ".out"] - ours[key + ".in"]
    elif sub == "self_attn":
        pos = torch.arange(T, device=device)[None]
        pe = ref_model.model.rotary_emb(x, pos)
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
        out = mod(x, pe, attention_mask=mask, past_key_values=None)[0]
        mine = ours[key + ".out"]
    else:
        return None
    return rel_err_rows(mine, out[0].float().cpu())


# ------------------------------------------------------------------------------------ main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child")
    p.add_argument("--out", default="probe_out")
    p.add_argument("--checkpoints", default="tiny=checkpoints/tiny,wide=tests/data/checkpoints/wide")
    p.add_argument("--variants", default="base,qsa_ref", help="engine variants for every checkpoint")
    p.add_argument(
        "--extra-variants",
        default="prefetch0,offload0,ssm_fp32,graphs",
        help="variants run afterwards for the first checkpoint only (tokens only)",
    )
    p.add_argument("--work", default="/tmp/probe_work", help="children's specs, logs and captures")
    p.add_argument("--capture", default="very_long_sparse,long_sparse")
    p.add_argument("--child-timeout", type=float, default=240)
    p.add_argument("--ours-cpu", default=None, help="dir of captures from a --device cpu run (ours on CPU)")
    p.add_argument("--device", default="cuda", help="cpu: dry run of this script on vLLM's CPU build")
    args = p.parse_args()
    if args.child:
        return child(args.child)

    from transformers import AutoTokenizer

    from tests.parity.prompts import parity_prompts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    LOG_FILE.append(out / "probe.log")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    device = args.device
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}")
    variants_env = {
        "base": {},
        "qsa_ref": {},
        "prefetch0": {"env": {"VLLM_PLE_PREFETCH": "0"}},
        "offload0": {"env": {"VLLM_PLE_CPU_OFFLOAD": "0"}},
        "ple_sync": {"env": {"VLLM_PLE_PREFETCH": "0", "VLLM_PLE_CPU_OFFLOAD": "0"}},
        "ssm_fp32": {"engine": {"mamba_ssm_cache_dtype": "float32"}},
        "graphs": {"eager": False},
    }
    summary: dict = {}
    saved: dict = {}
    for item in args.checkpoints.split(","):
        preset, path = item.split("=")
        tok = AutoTokenizer.from_pretrained(path)
        prompts = parity_prompts(tok)
        log(f"\n=== {preset} ({path}); prompt lengths { ({k: len(v) for k, v in prompts.items()}) }")
        t0 = time.time()
        refs = {}
        for dev in ("cpu", device):
            m = load_ref(path, dev)
            res = {n: ref_greedy(m, ids, NEW_TOKENS, dev) for n, ids in prompts.items()}
            refs[dev] = ({n: r[0] for n, r in res.items()}, {n: r[1] for n, r in res.items()})
            del m
        log(f"reference greedy on cpu and cuda: {time.time() - t0:.0f} s")
        ref_cpu, lps_cpu = refs["cpu"]
        ref_cuda, lps_cuda = refs[device]
        describe_tokens("transformers cuda vs transformers cpu", ref_cuda, ref_cpu, lps_cpu)
        summary[preset] = {"ref_cpu": ref_cpu, "ref_cuda": ref_cuda, "vllm": {}}

        capture = [c for c in args.capture.split(",") if c]
        names = [v for v in args.variants.split(",") if v]
        saved.setdefault("first", (preset, path, prompts, ref_cpu, lps_cpu, ref_cuda, lps_cuda))
        results = {}
        for v in names:
            spec = {"tag": f"{preset}_{v}", "path": path, "prompts": prompts, **variants_env[v]}
            if v == "qsa_ref":
                spec["qsa_kernel"] = False
            if v == "base":
                spec["capture"] = capture
            res = run_child(spec, work, args.child_timeout)
            if res is None:
                continue
            results[v] = res
            summary[preset]["vllm"][v] = res["tokens"]
            log(f"- vLLM {v}: start {res['start_s']} s, block_size {res['block_size']}, {res['describe']}")
            describe_tokens(f"vLLM {v} vs transformers cpu", res["tokens"], ref_cpu, lps_cpu)
            describe_tokens(f"vLLM {v} vs transformers cuda", res["tokens"], ref_cuda, lps_cuda)

        for name in capture:
            f = work / f"res_{preset}_base.{name}.pt"
            if not f.exists():
                continue
            ours = torch.load(f)
            ours_cpu = None
            if args.ours_cpu:
                g = Path(args.ours_cpu) / f.name
                ours_cpu = torch.load(g) if g.exists() else None
            ratio = json.loads((Path(path) / "config.json").read_text())["indexer_compress_ratio"]
            log(f"\n--- {preset}/{name}: per-token relative error, max per 64-token bucket")
            m_cpu = load_ref(path, "cpu")
            cap_cpu = ref_capture(m_cpu, prompts[name], "cpu")
            del m_cpu
            m_cuda = load_ref(path, device)
            cap_cuda = ref_capture(m_cuda, prompts[name], device)
            n_layers = len(m_cuda.model.layers)
            for i in range(n_layers):
                key = f"layer{i}.out"
                floor = rel_err_rows(cap_cuda[key], cap_cpu[key])
                mine = rel_err_rows(ours[key], cap_cpu[key])
                kind = "QSA" if f"layer{i}.self_attn.out" in ours else "GDN"
                log(f"  layer {i} ({kind}) ours-vs-ref(cpu): {buckets(mine)}")
                log(f"  layer {i} ({kind}) ref(cuda)-vs-ref(cpu) floor: {buckets(floor)}")
                if ours_cpu is not None:
                    log(
                        f"  layer {i} ({kind}) ours(cuda)-vs-ours(cpu): {buckets(rel_err_rows(ours[key], ours_cpu[key]))}"
                    )
                    log(
                        f"  layer {i} ({kind}) ours(cpu)-vs-ref(cpu): {buckets(rel_err_rows(ours_cpu[key], cap_cpu[key]))}"
                    )
                for sub in ("ple", "linear_attn", "self_attn", "mlp"):
                    err = isolated(m_cuda, ours, i, sub, prompts[name], device)
                    if err is None:
                        continue
                    # noise floor of the same sub-module: reference on cuda vs cpu, same (our) input
                    log(f"    {sub:11s} local err (ref module on our input, cuda): {buckets(err)}")
            # QSA selections
            sel_ours = ours.get("selected", [])
            sel_ref = cap_cpu.get("selected_mask", [])
            scores = cap_cpu.get("block_scores", [])
            n_q = len(prompts[name])
            for j, (s_o, s_r) in enumerate(zip(sel_ours, sel_ref, strict=False)):
                a = selection_sets(*s_o)
                b = mask_sets(s_r)
                # the reference calls topk once per query that sees a complete block (t >= ratio - 1)
                n_calls = n_q - (ratio - 1)
                layer_scores = {
                    t: scores[j * n_calls + t - (ratio - 1)]
                    for t in range(ratio - 1, n_q)
                    if j * n_calls + t - (ratio - 1) < len(scores)
                }
                diff = [t for t in range(min(len(a), len(b))) if a[t] != b[t]]
                log(f"  QSA layer #{j}: selection differs from ref(cpu) at {len(diff)}/{len(a)} queries")
                for t in diff[:6] + diff[-3:]:
                    margin = ""
                    if t in layer_scores:
                        margin = selection_margin(layer_scores[t], a[t] - b[t], b[t] - a[t], ratio)
                    log(
                        f"    pos {t}: ours-only {sorted(a[t] - b[t])[:8]} ref-only {sorted(b[t] - a[t])[:8]} {margin}"
                    )
            # logits of the last position: ours vs ref
            del m_cuda
            if device == "cuda":
                torch.cuda.empty_cache()

        (out / "probe.json").write_text(json.dumps(summary))

    preset, path, prompts, ref_cpu, lps_cpu, ref_cuda, lps_cuda = saved["first"]
    log(f"\n=== extra variants on {preset}")
    for v in [v for v in args.extra_variants.split(",") if v]:
        spec = {"tag": f"{preset}_{v}", "path": path, "prompts": prompts, **variants_env[v]}
        res = run_child(spec, work, args.child_timeout)
        if res is None:
            continue
        summary[preset]["vllm"][v] = res["tokens"]
        log(f"- vLLM {v}: start {res['start_s']} s, block_size {res['block_size']}")
        describe_tokens(f"vLLM {v} vs transformers cpu", res["tokens"], ref_cpu, lps_cpu)
        describe_tokens(f"vLLM {v} vs transformers cuda", res["tokens"], ref_cuda, lps_cuda)
        (out / "probe.json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
