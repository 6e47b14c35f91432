"""Is the ``qsa512`` 4k-prompt divergence (bench_ours_vs_upstream: 13/16, div@12) numerics or a bug?

Why it exists: on an H200 both vLLM implementations (ours and upstream) left the transformers
reference (bf16, CUDA) at step 12 of the 4,096-token parity prompt, with the same token, where the
reference preferred its own by 0.812 nats. This script redoes that comparison on the CPU and digs
into the QSA block selection of the step where the runs part:

* the prompt is built exactly as ``bench/bench_ours_vs_upstream.py`` builds it (``random.Random(0)``,
  ids ``randrange(3, len(tokenizer))``, the 4k prompt first of the sorted parity lengths);
* transformers' ``Qwen4ExpForCausalLM`` in bf16 and in fp32 (default attention implementation, CPU),
  greedy with EOS masked at the argmax (= ``generate(min_new_tokens=N)``), raw log-probabilities of
  every step; our vLLM plugin through vLLM's CPU build (``enforce_eager``, V1 runner, in-process
  engine core, ``logprobs=20``);
* in every run the last query of each QSA layer call (the prefill's last token = step 0, then one
  decode query per step) is recorded: the blocks it selected (transformers: read off the indexer's
  returned mask; vLLM: from ``select_tokens``), its full block-score row, and, for the transformers
  runs, the selection our reference ops (``model/ops/qsa_indexer.py``: ``pooled_block_keys`` +
  ``select_tokens``) make from the same index queries and keys;
* ``swap`` (optional): the bf16 reference re-run with one layer's selection at the divergent step
  forced to the one vLLM made, to see whether that block flip alone moves the argmax.

``router``: the fp32 reference over the prompt plus vLLM's first tokens, with the gap between the 2nd
and 3rd expert probability of every MoE router (top-2 of 8) at each step's query.

Run (2 CPU cores: checkpoint ~2 min, each transformers run ~2-4 min, vLLM ~2 min)::

    .venv/bin/python bench/qsa512_divergence.py --make-checkpoint /tmp/qsa512_ts30 --out /tmp/qsa512_div
    # then: --stages ref-fp32@vllm,router,report; --stages swap-fp32 --swap-key "4095-4101/*"

Each stage runs in its own interpreter and writes ``<out>/<stage>.json``; ``report`` prints, for every
run, its tokens and its agreement with the bf16 reference; at the first divergence of each pair the
margin of each side; and per QSA layer and step around it: how many selected blocks differ between
runs, whether our ops reproduce transformers' selection on the same inputs, and the score gap
between the 512th and the 513th block (the top-k boundary) in each run. The checkpoint is trained on
the CPU and that is not bit-reproducible across machines, so its draw is not the H200's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT_LEN = 4096
PARITY_LENS = (4096, 8192, 16384)  # the bench's defaults: its rng draws them in this order
ENGINE_LOGPROBS = 20
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm"),
}


def bench_prompt(model: str) -> list[int]:
    """The bench's 4k parity prompt: the first of its ``random.Random(0)`` draws."""
    from transformers import AutoTokenizer

    id_high = len(AutoTokenizer.from_pretrained(model))
    rng = random.Random(0)
    prompts = {n: [rng.randrange(3, id_high) for _ in range(n)] for n in sorted(PARITY_LENS)}
    return prompts[PROMPT_LEN]


def _boundary(scores, k: int) -> dict:
    """The top-k boundary of one score row: k-th minus (k+1)-th best score, and its neighbourhood."""
    import torch

    s = torch.as_tensor(scores, dtype=torch.float64)
    if s.numel() <= k:
        return {"blocks": s.numel(), "dense": True}
    top = s.sort(descending=True).values
    gap = float(top[k - 1] - top[k])
    return {
        "blocks": s.numel(),
        "kth": float(top[k - 1]),
        "gap": gap,
        "rel_gap": gap / max(abs(float(top[k - 1])), 1e-30),
        "within_1e-3_rel": int(((s - top[k - 1]).abs() <= 1e-3 * abs(float(top[k - 1]))).sum()),
        "zeros": int((s == 0).sum()),
    }


# --------------------------------------------------------------------------- transformers runs
def run_reference(args, dtype_name: str, force: dict | None = None, follow: list[int] | None = None) -> dict:
    """Greedy tokens, log-probabilities and per-step QSA selections of transformers' model.

    ``follow``: feed these tokens instead of the argmax (teacher forcing), so this run's
    log-probabilities are read at another run's steps; ``tokens`` then holds its own argmaxes.
    """
    import torch
    from transformers import DynamicCache, Qwen4ExpForCausalLM
    from transformers.cache_utils import Cache
    from transformers.models.qwen4_exp import modeling_qwen4_exp as ref

    from model.ops.qsa_indexer import pooled_block_keys, select_tokens

    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    model = Qwen4ExpForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    cfg = model.config
    prompt = bench_prompt(args.model)
    inv_freq = model.model.rotary_emb.inv_freq.float()
    ratio, budget = cfg.indexer_compress_ratio, cfg.indexer_budget
    top_k = budget // ratio
    records: dict[str, dict] = {}  # "<position>/<layer>" -> record of that query's selection
    stash: dict = {}

    orig_forward = ref.Qwen4ExpTextQSAIndexer.forward

    def patched_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values):
        mask = orig_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values)
        raw_keys = stash.pop("keys")[0]  # [L, D], this layer's keys after the update
        seq = hidden_states.shape[1]
        pos = raw_keys.shape[0] - 1  # the last query's absolute position
        # The last query's index q, computed with the reference's own ops.
        cos, sin = position_embeddings
        qk = self.index_qk_proj(hidden_states[:, -1:])
        q = qk[..., : self.index_n_heads * self.index_head_dim].reshape(1, 1, -1, self.index_head_dim)
        q = self.q_layernorm(q)
        q = ref.apply_rotary_pos_emb(q, cos=cos[:, -1:], sin=sin[:, -1:], unsqueeze_dim=2)[0, 0]
        complete = (pos + 1) // ratio
        blocks_ref_keys = raw_keys[: complete * ratio].view(complete, ratio, -1).float().mean(1)
        pooled = self.k_layernorm(blocks_ref_keys.to(raw_keys.dtype))
        starts = torch.arange(complete) * ratio
        bk = ref.apply_rotary_pos_emb(
            pooled.unsqueeze(1), cos=cos[0].index_select(0, starts), sin=sin[0].index_select(0, starts)
        ).squeeze(1)
        scores = torch.matmul(q.float(), bk.float().transpose(-1, -2)).transpose(-1, -2)
        scores = torch.relu(scores).sum(dim=-1) / (self.index_head_dim**0.5)
        row = mask[0, 0, -1]
        chosen = row if row.dtype == torch.bool else row == 0
        tokens = torch.nonzero(chosen[: complete * ratio]).flatten()
        ref_blocks = sorted(set((tokens // ratio).tolist()))
        # Our reference ops on the same index queries and raw keys.
        our_bk = pooled_block_keys(raw_keys, ratio, self.k_layernorm.weight, self.k_layernorm.eps, inv_freq)
        sel, count = select_tokens(q.unsqueeze(0), torch.tensor([pos]), our_bk, budget, ratio)
        our_tokens = sel[0, : int(count[0])]
        our_blocks = sorted(set((our_tokens[our_tokens < complete * ratio] // ratio).tolist()))
        key = f"{pos}/{self.layer_idx}"
        records[key] = {
            "position": pos,
            "layer": self.layer_idx,
            "seq": seq,
            "blocks": ref_blocks,
            "ours_blocks": our_blocks,
            "ours_block_keys_equal": bool(torch.equal(our_bk, bk)),
            "scores": [float(x) for x in scores.tolist()],
            "boundary": _boundary(scores, top_k),
        }
        if force and key in force:  # replace this query's selection by the given blocks
            wanted = torch.tensor(force[key], dtype=torch.long)
            toks = (wanted.unsqueeze(1) * ratio + torch.arange(ratio)).flatten()
            new_row = torch.zeros_like(chosen)
            new_row[toks] = True
            new_row[complete * ratio : pos + 1] = True
            mask = mask.clone()
            if mask.dtype == torch.bool:
                mask[0, 0, -1] = new_row
            else:
                mask[0, 0, -1] = torch.where(new_row, 0.0, torch.finfo(mask.dtype).min).to(mask.dtype)
            records[key]["forced"] = True
        return mask

    cache = DynamicCache(config=cfg)
    orig_update = Cache.update_indexer  # the indexer calls past_key_values.update_indexer(raw, idx)

    def patched_update(self, raw_keys, layer_idx):
        out = orig_update(self, raw_keys, layer_idx)
        stash["keys"] = out
        return out

    Cache.update_indexer = patched_update
    ref.Qwen4ExpTextQSAIndexer.forward = patched_forward
    eos = cfg.eos_token_id
    t = time.perf_counter()
    tokens: list[int] = []
    steps: list[dict] = []
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
            for _ in range(args.new_tokens):
                lp = logits[0, -1].float().log_softmax(-1)
                masked = lp.clone()
                masked[eos] = float("-inf")  # min_new_tokens in the bench's generate()
                token = int(masked.argmax())
                tokens.append(token)
                if follow is not None:
                    token = follow[len(tokens) - 1]
                steps.append(
                    {"row": [round(float(v), 6) for v in lp.tolist()], "eos_top": int(lp.argmax()) == eos}
                )
                print(
                    f"[ref {dtype_name}] step {len(tokens) - 1}: {token} ({time.perf_counter() - t:.0f}s)",
                    flush=True,
                )
                logits = model(
                    input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True
                ).logits
    finally:
        ref.Qwen4ExpTextQSAIndexer.forward = orig_forward
        Cache.update_indexer = orig_update
    return {
        "impl": f"transformers {dtype_name}",
        "attn_implementation": cfg._attn_implementation,
        "prompt_tokens": len(prompt),
        "tokens": tokens,
        "steps": steps,
        "selection": records,
        "seconds": time.perf_counter() - t,
    }


def run_router(args, out: Path) -> dict:
    """fp32 reference, one forward over prompt + vLLM's first ``--router-steps`` tokens: per MoE
    router, the gap between the 2nd and 3rd expert probability (top-2 boundary) at every position."""
    import torch
    from transformers import Qwen4ExpForCausalLM
    from transformers.models.qwen4_exp import modeling_qwen4_exp as ref

    torch.set_num_threads(args.threads)
    model = Qwen4ExpForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    fed = json.loads((out / "vllm.json").read_text())["tokens"][: args.router_steps]
    ids = bench_prompt(args.model) + fed
    gaps: list = []

    def hook(mod, inp, outs):
        top = torch.softmax(outs[0].float(), -1).topk(3, -1).values
        gaps.append(top[:, 1] - top[:, 2])

    for mod in model.modules():
        if isinstance(mod, ref.Qwen4ExpTextTopKRouter):
            mod.register_forward_hook(hook)
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    tail = len(fed) + 1  # the prefill's last query (step 0) and one query per fed token
    return {
        "impl": "transformers fp32, router top-2 boundary",
        "tokens": [],
        "selection": {},
        "fed": fed,
        "router_gaps_tail": [[round(float(x), 5) for x in g[-tail:]] for g in gaps],
        "router_prompt_near_ties_1e-3": [int((g[:-tail] < 1e-3).sum()) for g in gaps],
        "seconds": time.perf_counter() - t,
    }


# --------------------------------------------------------------------------- our vLLM engine
def run_vllm(args) -> dict:
    """Our plugin through vLLM's CPU build; the QSA selection of each call's last query recorded."""
    import torch
    from vllm import LLM, SamplingParams

    import model.vllm_adapter.qsa_attention as qa

    prompt = bench_prompt(args.model)
    records: dict[str, dict] = {}
    seen: dict[int, int] = {}
    orig_select = qa.select_tokens
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    qsa_layers = [
        i for i, kind in enumerate(cfg.get("layer_types", [])) if str(kind) in ("indexed_attention", "qsa")
    ]

    def recording_select(index_q, positions, block_keys, budget, ratio):
        sel, count = orig_select(index_q, positions, block_keys, budget, ratio)
        pos = int(positions[-1])
        nth = seen.get(pos, 0)
        seen[pos] = nth + 1
        complete = (pos + 1) // ratio
        scores = torch.matmul(index_q[-1].float(), block_keys[:complete].float().transpose(-1, -2))
        scores = torch.relu(scores.transpose(-1, -2)).sum(dim=-1) / (index_q.shape[-1] ** 0.5)
        toks = sel[-1, : int(count[-1])]
        layer = qsa_layers[nth] if nth < len(qsa_layers) else nth
        records[f"{pos}/{layer}"] = {
            "position": pos,
            "layer": layer,
            "seq": int(index_q.shape[0]),
            "blocks": sorted(set((toks[toks < complete * ratio] // ratio).tolist())),
            "scores": [float(x) for x in scores.tolist()],
            "boundary": _boundary(scores, budget // ratio),
        }
        return sel, count

    qa.select_tokens = recording_select
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=PROMPT_LEN + 64,
        max_num_seqs=1,
        # 512-token prefill chunks: a whole 4k prefill's gathered K/V (the CPU reference attention)
        # was killed for memory on a 24 GiB host.
        max_num_batched_tokens=512,
        enable_chunked_prefill=True,
        seed=0,
        max_logprobs=ENGINE_LOGPROBS,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=ENGINE_LOGPROBS
    )
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - t
    comp = out.outputs[0]
    lps = [{str(int(k)): float(getattr(v, "logprob", v)) for k, v in s.items()} for s in comp.logprobs or []]
    try:
        cls = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")[0]
    except Exception as exc:  # noqa: BLE001 - informative only
        cls = f"? ({exc})"
    return {
        "impl": "vllm ours (cpu, eager)",
        "model_class": cls,
        "prompt_tokens": len(out.prompt_token_ids),
        "tokens": list(comp.token_ids),
        "logprobs": lps,
        "selection": records,
        "seconds": seconds,
    }


# --------------------------------------------------------------------------- report
def _first_div(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _margin(run: dict, step: int, own: int, other: int) -> str:
    """logp(own) - logp(other) at one step, from the full row or the engine's top logprobs."""
    if "steps" in run:
        row = run["steps"][step]["row"]
        return f"{row[own] - row[other]:+.3f}"
    lp = run["logprobs"][step]
    if str(own) in lp and str(other) in lp:
        return f"{lp[str(own)] - lp[str(other)]:+.3f}"
    return f"> {lp[str(own)] - min(lp.values()):+.3f} (other not in top-{len(lp)})"


def report(out: Path, prompt_len: int) -> str:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem != "summary"}
    lines = []
    router = runs.pop("router", None)
    for name, r in runs.items():
        extra = r.get("attn_implementation") or r.get("model_class") or ""
        lines.append(f"{name:9s} {r['tokens']}  ({r['seconds']:.0f}s, {extra})")
    names = [n for n in ("ref-bf16", "ref-fp32", "vllm", "swap-bf16", "swap-fp32") if n in runs]
    divs: set[int] = set()
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ta, tb = runs[a]["tokens"], runs[b]["tokens"]
            d = _first_div(ta, tb)
            eq = sum(x == y for x, y in zip(ta, tb, strict=False))
            if d is None:
                lines.append(f"{a} vs {b}: {eq}/{len(ta)} equal")
                continue
            divs.add(d)
            lines.append(
                f"{a} vs {b}: {eq}/{len(ta)} equal, div@{d} ({ta[d]} vs {tb[d]}): "
                f"{a} prefers {ta[d]} by {_margin(runs[a], d, ta[d], tb[d])}, "
                f"{b} prefers {tb[d]} by {_margin(runs[b], d, tb[d], ta[d])}"
            )
    for name, r in runs.items():
        if "followed" not in r:
            continue
        own, fed = r["tokens"], r["followed_tokens"]
        off = [
            f"{i}: {own[i]} over {fed[i]} by {r['steps'][i]['row'][own[i]] - r['steps'][i]['row'][fed[i]]:.3f}"
            for i in range(len(own))
            if own[i] != fed[i]
        ]
        lines.append(
            f"{name} (fed {r['followed']}'s tokens): argmax == fed token at {len(own) - len(off)}/{len(own)} "
            "steps" + (f"; elsewhere (step: own over fed by nats) {'; '.join(off)}" if off else "")
        )
        for a in names:
            for b in names:
                if a >= b or a == r["followed"] and b == r["followed"]:
                    continue
                d = _first_div(runs[a]["tokens"], runs[b]["tokens"])
                if d is None or runs[a]["tokens"][:d] != fed[:d]:
                    continue
                ta, tb = runs[a]["tokens"][d], runs[b]["tokens"][d]
                row = r["steps"][d]["row"]
                lines.append(
                    f"  at {a} vs {b} div@{d}: {name} logp({ta}) - logp({tb}) = {row[ta] - row[tb]:+.3f}"
                )
    for name in names:
        if "steps" in runs[name] and any(s["eos_top"] for s in runs[name]["steps"]):
            lines.append(
                f"{name}: EOS was the raw argmax at some step (masked, as the bench's generate does)"
            )
    sel_runs = [n for n in names if runs[n].get("selection")]
    for name in sel_runs:
        recs = runs[name]["selection"].values()
        if "ours_blocks" in next(iter(recs), {}):
            bad = [f"{r['position']}/{r['layer']}" for r in recs if r["ours_blocks"] != r["blocks"]]
            lines.append(
                f"{name}: our ops' selection == transformers' on the same inputs for "
                f"{len(recs) - len(bad)}/{len(recs)} recorded queries" + (f" (differ: {bad})" if bad else "")
            )
    steps = sorted({s for d in divs for s in (d - 1, d)} | ({0} if not divs else set()))
    base = sel_runs[0] if sel_runs else None
    for step in steps:
        if base is None or step < 0:
            continue
        pos = prompt_len - 1 + step
        for key in sorted(k for k in runs[base]["selection"] if int(k.split("/")[0]) == pos):
            cells = []
            for name in sel_runs:
                rec = runs[name]["selection"].get(key)
                if rec is None:
                    continue
                b = rec["boundary"]
                diff = len(set(runs[base]["selection"][key]["blocks"]) ^ set(rec["blocks"])) // 2
                cells.append(
                    f"{name}: gap {b.get('gap', float('nan')):.3g} (rel {b.get('rel_gap', float('nan')):.2g}, "
                    f"{b.get('within_1e-3_rel', '-')} within 1e-3)"
                    + (f", {diff} blocks != {base}" if name != base else "")
                )
            lines.append(f"step {step} (pos {pos}) layer {key.split('/')[1]}: " + "; ".join(cells))
    if router:
        first = prompt_len - 1
        for li, (g, n) in enumerate(
            zip(router["router_gaps_tail"], router["router_prompt_near_ties_1e-3"], strict=True)
        ):
            lines.append(
                f"router {li} (fp32, top-2 prob gap) at steps 0..{len(g) - 1} (pos {first}..): "
                f"{' '.join(f'{x:.4f}' for x in g)}; prompt positions with gap < 1e-3: {n}"
            )
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n")
    return text


# --------------------------------------------------------------------------- driver
def stage_main(args) -> int:
    out = Path(args.out)
    if args.stage == "ref-bf16":
        result = run_reference(args, "bf16")
    elif args.stage == "ref-fp32":
        result = run_reference(args, "fp32")
    elif "@" in args.stage:  # e.g. ref-fp32@vllm: fp32 reference teacher-forced on vllm's tokens
        kind, other = args.stage.split("@")
        follow = json.loads((out / f"{other}.json").read_text())["tokens"]
        result = run_reference(args, kind.removeprefix("ref-"), follow=follow)
        result["followed"] = other
        result["followed_tokens"] = follow
    elif args.stage == "vllm":
        result = run_vllm(args)
    elif args.stage == "router":
        result = run_router(args, out)
    elif args.stage.startswith("swap-"):  # swap-bf16 / swap-fp32
        result = run_swap(args, out, args.stage.removeprefix("swap-"))
    else:
        raise SystemExit(f"unknown stage {args.stage}")
    result["selection"] = {k: v for k, v in result["selection"].items()}
    (out / f"{args.stage}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's engine teardown at exit


def run_swap(args, out: Path, dtype_name: str) -> dict:
    """The reference with the selections at ``--swap-key`` (``pos/layer,...``) forced to vLLM's.

    ``pos`` may be a range ``a-b`` (inclusive) and ``layer`` ``*`` (every QSA layer vLLM recorded).
    """
    vllm = json.loads((out / "vllm.json").read_text())
    keys = []
    for item in args.swap_key.split(","):
        pos, layer = item.split("/")
        lo, _, hi = pos.partition("-")
        for p in range(int(lo), int(hi or lo) + 1):
            keys += [
                k for k in vllm["selection"] if k.split("/")[0] == str(p) and layer in ("*", k.split("/")[1])
            ]
    force = {k: vllm["selection"][k]["blocks"] for k in keys}
    result = run_reference(args, dtype_name, force=force)
    result["impl"] = f"transformers {dtype_name}, selection at {args.swap_key} forced to vLLM's"
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/qsa512_ts30")
    p.add_argument(
        "--make-checkpoint", metavar="DIR", help="build qsa512 in DIR if missing (the bench's way)"
    )
    p.add_argument("--train-steps", type=int, default=30, help="the bench's --make-checkpoint default")
    p.add_argument("--out", default="/tmp/qsa512_div")
    p.add_argument("--stages", default="ref-bf16,ref-fp32,vllm,report")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--router-steps", type=int, default=6, help="router stage: vLLM tokens fed after the prompt"
    )
    p.add_argument("--swap-key", help="for the swap stage: pos/layer[,pos/layer] to force to vLLM's blocks")
    args = p.parse_args()
    if args.make_checkpoint:
        args.model = args.make_checkpoint
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.stage:
        return stage_main(args)
    if args.make_checkpoint and not (Path(args.model) / "model.safetensors").exists():
        from model.checkpoints import make_checkpoint

        make_checkpoint("qsa512", args.model, train_steps=args.train_steps)
    for stage in args.stages.split(","):
        if stage == "report":
            print(report(Path(args.out), PROMPT_LEN))
            continue
        cmd = [sys.executable, __file__, "--stage", stage, "--model", args.model, "--out", args.out]
        cmd += ["--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
        if args.swap_key:
            cmd += ["--swap-key", args.swap_key]
        cmd += ["--router-steps", str(args.router_steps)]
        t = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **ENV)).returncode
        print(f"[{stage}] rc {rc} in {time.perf_counter() - t:.0f}s", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
