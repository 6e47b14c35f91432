"""Peak host memory while vLLM loads large PLE tables: the tables are copied into their storage
allocation shard by shard, so the peak stays near one table plus one checkpoint shard.

Builds a synthetic checkpoint (the tiny preset with a much larger n-gram vocabulary, so nearly all
bytes are PLE tables; random values), converts it to fp8_e4m3 and nvfp4 with ``model.tools.ple_quantize``,
then, for each format, builds the vLLM model in a fresh process with vLLM's own loader (default
lazy safetensors iterator) and samples ``/proc/self/status`` every millisecond. For contrast it
also loads the bf16 checkpoint with vLLM's ``--safetensors-load-strategy eager``, which reads each
file into memory first.

Usage (CPU, ~2-3 min): ``.venv/bin/python bench/ple_load_memory.py [--base 2000000] [--md out.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def build_checkpoint(src: Path, out: Path, base: int) -> Path:
    """``src`` with ``ngram_vocab_size_base = base``: big random PLE tables, matching hash buffers."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from model.ple.ngram_hash import layout_from_config

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["ngram_vocab_size_base"] = base
    (out / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    ple_layers = sorted(hf.ple_layer_ids)
    for ple_index, layer_id in enumerate(ple_layers):
        layout = layout_from_config(hf, ple_index)
        owner = f"model.layers.{layer_id - 1}.ple.ple_embedding"
        tensors[f"{owner}.ngram_heads_vocab_sizes"] = torch.tensor(layout.head_vocab_sizes)
        tensors[f"{owner}.ngram_heads_offsets"] = torch.tensor(layout.head_offsets)
        dim = hf.ple_embed_dim // layout.num_heads
        shard_rows = -(-layout.padded_rows // hf.split_ngram_parts)
        for i in range(hf.split_ngram_parts):
            rows = min(shard_rows, layout.padded_rows - i * shard_rows)
            w = torch.empty(rows, dim, dtype=torch.bfloat16)
            for r0 in range(0, rows, 1 << 20):
                n = min(1 << 20, rows - r0)
                w[r0 : r0 + n] = (torch.randn(n, dim, generator=gen) * 0.05).bfloat16()
            tensors[f"{owner}.ngram_embedding.shard_{i}.weight"] = w
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def measure(path: str, strategy: str | None) -> dict:
    """Runs in a fresh process: build + load the vLLM model, return memory figures."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()
    kw = {"safetensors_load_strategy": strategy} if strategy else {}
    cfg = EngineArgs(
        model=path, dtype="bfloat16", enforce_eager=True, max_model_len=512, **kw
    ).create_engine_config()
    peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            s = _status()
            for k in peaks:
                peaks[k] = max(peaks[k], s[k])
            time.sleep(0.001)

    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method="tcp://127.0.0.1:29713",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        loader = get_model_loader(cfg.load_config)
        base = _status()
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        t0 = time.perf_counter()
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
        after_alloc = _status()
        loader.load_weights(model, cfg.model_config)
        seconds = time.perf_counter() - t0
        stop.set()
        thread.join()
        end = _status()
    tables = [layer.ple.ple_embedding for layer in model.model.layers if layer.ple is not None]
    return {
        "format": tables[0].format,
        "table_bytes": sum(t.storage.table_bytes() for t in tables),
        "largest_shard_bytes": max(t.storage.table_bytes() // t.split_parts for t in tables),
        "file_bytes": sum(p.stat().st_size for p in Path(path).glob("*.safetensors")),
        "rss_peak": max(peaks["VmRSS"], end["VmHWM"]) - base["VmRSS"],
        "anon_peak": peaks["RssAnon"] - base["RssAnon"],
        "anon_after_alloc": after_alloc["RssAnon"] - base["RssAnon"],
        "anon_end": end["RssAnon"] - base["RssAnon"],
        "file_peak": peaks["RssFile"] - base["RssFile"],
        "seconds": seconds,
    }


def _run_measure(path: Path, strategy: str | None) -> dict:
    cmd = [sys.executable, __file__, "--measure", str(path)] + (["--strategy", strategy] if strategy else [])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MEASURE ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(line[len("MEASURE ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base", type=int, default=2_000_000, help="ngram_vocab_size_base (rows ~ 4x per table)"
    )
    parser.add_argument("--md", help="also write the markdown table here")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print("MEASURE " + json.dumps(measure(args.measure, args.strategy)), flush=True)
        return

    sys.path.insert(0, str(REPO))
    from model.tools.ple_quantize import convert_checkpoint

    tiny = REPO / "checkpoints" / "tiny"
    if not (tiny / "model.safetensors").exists():
        subprocess.run(
            [sys.executable, "-m", "model.tools.checkpoints", "--preset", "tiny", "--out", str(tiny)],
            check=True,
            cwd=REPO,
        )
    with tempfile.TemporaryDirectory(prefix="ple_mem_") as tmp:
        root = Path(tmp)
        bf16 = build_checkpoint(tiny, root / "bf16", args.base)
        runs = [("bf16", bf16, None)]
        for fmt in ("fp8_e4m3", "nvfp4"):
            runs.append((fmt, convert_checkpoint(bf16, root / fmt, fmt), None))
        runs.append(("bf16", bf16, "eager"))
        rows = []
        for fmt, path, strategy in runs:
            r = _run_measure(path, strategy)
            rows.append(
                f"| {fmt} | {strategy or 'lazy (default)'} | {r['table_bytes'] / MiB:,.0f} "
                f"| {r['largest_shard_bytes'] / MiB:,.0f} | {r['anon_peak'] / MiB:,.0f} "
                f"| {r['anon_peak'] / r['table_bytes']:.2f} | {r['anon_end'] / MiB:,.0f} "
                f"| {r['file_peak'] / MiB:,.0f} | {r['rss_peak'] / MiB:,.0f} | {r['seconds']:.1f} |"
            )
            print(rows[-1], flush=True)
    md = "\n".join(
        [
            f"PLE tables loaded by vLLM's loader on CPU (tiny model, ngram_vocab_size_base={args.base:,}, "
            "2 PLE layers x 4 checkpoint shards; MiB over the pre-load baseline)",
            "",
            "| format | safetensors load | tables | largest shard | peak anon | peak anon / tables "
            "| anon after load | peak file-backed | peak RSS | seconds |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print("\n" + md)
    if args.md:
        Path(args.md).write_text(md + "\n")


if __name__ == "__main__":
    main()
