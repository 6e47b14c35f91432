"""GPU check: FP8 QSA cache write, clip counting and kernel read, eager vs CUDA-graph replay.

Run on a CUDA machine (torch + Triton, no vLLM) from the repository root:

    PYTHONPATH=. python3 bench/gpu_qsa_clip.py [--sweep]

What it runs (the checks themselves are the judges in ``tests/gpu/test_qsa_clip.py``, whose
code in ``tests/gpu/qsa_clip_cases.py`` this script reuses; exit status 1 if any fails):

1. One QSA "step" exactly as the layer runs it with ``--kv-cache-dtype fp8`` and clip counting on:
   ``QSAKVState.observe`` (device-side clip counters), ``QSAKVState.encode`` (E4M3 codes of
   value/scale, clamped to +-448), ``fp8_rows`` + ``scatter_rows_`` into a uint8 paged cache of
   ``[K | V | bf16 index key bytes]`` rows, then the Triton sparse paged kernel reading the codes
   with the layer's tensor scales. Several steps run eagerly, then the same steps are replayed
   from one captured CUDA graph with fresh inputs copied into the static buffers. Counters after
   every step, the cache bytes and the attention outputs must be identical, and the counters must
   equal a host-side count of ``|x / scale| > 448`` over the real rows. Padding rows (slot -1)
   carry huge values: they must neither be counted nor written (the null block stays intact).
2. The clip-counter reader thread (side stream, pinned memory, event) polls every few ms while
   the graph replays in a loop: its readings must be monotonic, the last one exact, and the
   Prometheus counter must end at the device total. Replay time with and without the reader is
   printed.
3. ``--sweep``: E4M3 vs BF16 decode at the real shape (Hq 16, Hkv 2, D 256, 2048+3 selected keys,
   T=64, block 16) over a few tile configurations, to see whether the E4M3 path can catch up.

``--smoke`` runs everything but the graph capture on the CPU (kernel under ``TRITON_INTERPRET=1``).

Result on an H200 (torch 2.11, Triton 3.6; defaults above, 6 steps of 8 real + 2 padding
rows): every check PASSED; eager and replayed counters equal after every step ([245, 221] K/V
clips = host count), cache bytes and outputs bitwise equal; 2,000 replays added exactly
2,000 x [41, 27]; the reader (68 polls at 2 ms) matched the device total and the Prometheus
counter; replay time 83.5 us with and without the reader polling. E4M3 decode T=64 (2051 keys,
block 16): default tiles (32/8 warps/2 stages) 168.8 us, BLOCK_N 16 / 4 warps / 4 stages 140.5 us,
16/2/3 with 8 splits 134.3 us; BF16 default 153.0 us (134.0 us with 8 splits).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from model.kernels import qsa_sparse_attention as K
from tests.gpu.qsa_clip_cases import LAYER, World, part1, part2


def sweep(device: torch.device) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_qsa_kernels as G

    hq, hkv, d, ctx, t = 16, 2, 256, 32768, 64
    timer = G.Timer(device, 1 << 30)
    world = G.make_world(t, ctx, 16, hkv, d, device)
    q = torch.randn((t, hq, d), device=device, dtype=torch.bfloat16)
    req = torch.arange(t, dtype=torch.int32, device=device)
    sel, cnt = G.sparse_selection(t, torch.full((t,), ctx - 2, device=device), 2048, 4, device)
    rows = []
    configs = [("bf16", None, None, None)] + [
        ("fp8_e4m3", bn, nw, ns)
        for bn, nw, ns in [(None, None, None), (16, 4, 3), (16, 4, 4), (32, 4, 3), (16, 2, 3), (32, 4, 4)]
    ]
    for kv, bn, nw, ns in configs:
        kc, vc = (world.k_bf16, world.v_bf16) if kv == "bf16" else (world.k_fp8, world.v_fp8)
        for splits in (None, 8):

            def fn(kc=kc, vc=vc, kv=kv, bn=bn, nw=nw, ns=ns, splits=splits):
                return K.sparse_paged_attention(
                    q,
                    kc,
                    vc,
                    world.block_table,
                    req,
                    sel,
                    cnt,
                    1 / 16,
                    num_splits=splits,
                    kv_format=kv,
                    block_n=bn,
                    num_warps=nw,
                    num_stages=ns,
                )

            try:
                us = timer(fn, 20)
                info = K.last_launch_info()
                rows.append(
                    f"| {kv} | {info['block_n']} | {info['num_warps']} | {info['num_stages']} | {info['num_splits']} | "
                    f"{us:,.1f} | {info['shared_bytes']} | {info['n_regs']} |"
                )
            except Exception as exc:
                rows.append(f"| {kv} | {bn} | {nw} | {ns} | {splits} | {type(exc).__name__} | - | - |")
            print("[sweep] " + rows[-1], flush=True)
    print(
        "\n| KV | BLOCK_N | warps | stages | splits | decode T=64 (us) | smem (B) | regs |\n|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reqs", type=int, default=12)
    p.add_argument("--ctx", type=int, default=700)
    p.add_argument("--tokens", type=int, default=10, help="rows per step (the last 2 are padding)")
    p.add_argument("--width", type=int, default=515, help="selected positions per token")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--num-splits", type=int, default=None)
    p.add_argument("--replays", type=int, default=2000)
    p.add_argument("--poll-s", type=float, default=0.002)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--smoke", action="store_true", help="small shapes, eager only; CPU works")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.hq, args.hkv, args.head_dim, args.index_dim = 4, 2, 64, 32
        args.reqs, args.ctx, args.tokens, args.width, args.steps = 3, 40, 4, 24, 2
        args.replays, args.poll_s = 100, 0.001
    elif device.type != "cuda":
        print("no CUDA device: use --smoke on a CPU")
        return 2
    import triton

    print(
        f"torch {torch.__version__}, triton {triton.__version__}, device {device}"
        + (
            f" ({torch.cuda.get_device_name()}, sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
            if device.type == "cuda"
            else ""
        )
    )
    ks, vs = 0.0123, 0.0047
    with tempfile.TemporaryDirectory() as tmp:
        sidecar = Path(tmp) / "scales.json"
        sidecar.write_text(json.dumps({LAYER: {"k_scale": ks, "v_scale": vs}}))
        world = World(args, device, sidecar)  # validates and loads the sidecar like the server
    # What QSAKVState.apply() does after weight loading, minus starting the process-wide reader
    # (part 2 runs its own, so the Prometheus counter is fed by exactly one reader).
    world.state.k_scale.fill_(world.state.k_scale_value)
    world.state.v_scale.fill_(world.state.v_scale_value)
    ks, vs = world.state.k_scale_value, world.state.v_scale_value
    print(
        f"shape: Hq {args.hq}, Hkv {args.hkv}, D {args.head_dim}, index {args.index_dim} bf16, block {args.block_size}, "
        f"{args.tokens} rows/step (2 padding), {args.width} selected, k_scale {ks}, v_scale {vs}, row {world.row} B"
    )
    t0 = time.time()
    ok, graph = part1(world, args, ks, vs)
    ok &= part2(world, graph, args)
    print(f"[check] {'ALL PASSED' if ok else 'FAILED'} in {time.time() - t0:.1f} s")
    if args.sweep and device.type == "cuda":
        sweep(device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
