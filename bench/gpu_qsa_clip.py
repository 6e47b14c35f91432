"""GPU check: FP8 QSA cache write, clip counting and kernel read, eager vs CUDA-graph replay.

Run on a CUDA machine (torch + Triton, no vLLM) from the repository root:

    PYTHONPATH=. python3 bench/gpu_qsa_clip.py [--sweep]

What it shows (exit status 1 if any check fails):

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

Result on an H200 (torch 2.11, Triton 3.6, 2026-11-29; defaults above, 6 steps of 8 real + 2 padding
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
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from prometheus_client import REGISTRY

from model.kernels import qsa_sparse_attention as K
from model.ops.qsa_sparse_attention import sparse_paged_attention_ref
from model.qsa_kv import ops
from model.qsa_kv.runtime import QSAKVRuntime, clipped_metric
from model.qsa_kv.settings import FP8_E4M3, QSAKVSettings
from model.qsa_kv.state import QSAKVState

LAYER = "model.layers.3.self_attn"


class World:
    """A uint8 paged cache of R requests, static step buffers and one layer's QSAKVState."""

    def __init__(self, args: argparse.Namespace, device: torch.device, sidecar: Path) -> None:
        self.device = device
        self.hq, self.hkv, self.d, self.index_dim = args.hq, args.hkv, args.head_dim, args.index_dim
        self.bs, self.reqs, self.ctx, self.t = args.block_size, args.reqs, args.ctx, args.tokens
        self.width = args.width
        self.kv_width = self.hkv * self.d
        self.row = 2 * self.kv_width + 2 * self.index_dim
        self.blocks_per_req = math.ceil((self.ctx + args.steps + 1) / self.bs)
        num_blocks = 1 + self.reqs * self.blocks_per_req  # block 0: vLLM's null block
        gen = torch.Generator().manual_seed(7)
        self.gen = gen
        self.cache0 = torch.randint(0, 256, (num_blocks, self.bs, self.row), generator=gen, dtype=torch.uint8)
        # Keep the codes finite (0x7F/0xFF are E4M3 NaN) so the reference comparison is meaningful.
        self.cache0[..., : 2 * self.kv_width] &= 0x77
        self.cache0[..., 2 * self.kv_width :] = (
            torch.randn(num_blocks, self.bs, self.index_dim, generator=gen)
            .to(torch.bfloat16)
            .view(torch.uint8)
        )
        self.cache = self.cache0.clone().to(device)
        perm = 1 + torch.randperm(num_blocks - 1, generator=gen)
        self.block_table = perm.view(self.reqs, self.blocks_per_req).to(torch.int32).to(device)
        self.lengths = [self.ctx] * self.reqs
        settings = QSAKVSettings(scales_path=sidecar, clip_interval_s=args.poll_s)
        self.state = QSAKVState(
            layer_name=LAYER, kv_format=FP8_E4M3, settings=settings, expected_layers=[LAYER], eager=True
        ).to(device)
        self.scale = 1.0 / math.sqrt(self.d)
        t = self.t
        self.q = torch.zeros(t, self.hq, self.d, dtype=torch.bfloat16, device=device)
        self.k = torch.zeros(t, self.hkv, self.d, dtype=torch.bfloat16, device=device)
        self.v = torch.zeros_like(self.k)
        self.index_k = torch.zeros(t, self.index_dim, dtype=torch.bfloat16, device=device)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.token_req = torch.zeros(t, dtype=torch.int32, device=device)
        self.selected = torch.full((t, self.width), -1, dtype=torch.int32, device=device)
        self.num_selected = torch.zeros(t, dtype=torch.int32, device=device)
        self.out = torch.zeros_like(self.q)
        self.num_splits = args.num_splits

    def k_view(self) -> torch.Tensor:
        return self.cache[..., : self.kv_width].unflatten(-1, (self.hkv, self.d))

    def v_view(self) -> torch.Tensor:
        return self.cache[..., self.kv_width : 2 * self.kv_width].unflatten(-1, (self.hkv, self.d))

    def step(self) -> None:
        """The layer's FP8 write path (``QSACache.write``) followed by the kernel read."""
        st = self.state
        st.observe(self.k, self.v, self.slots)
        k8, v8 = st.encode(self.k, self.v)
        ops.scatter_rows_(self.cache, self.slots, ops.fp8_rows(k8, v8, self.index_k, torch.bfloat16))
        if self.device.type == "cuda" or K._interpreting():
            K.sparse_paged_attention(
                self.q,
                self.k_view(),
                self.v_view(),
                self.block_table,
                self.token_req,
                self.selected,
                self.num_selected,
                self.scale,
                st.k_scale,
                st.v_scale,
                num_splits=self.num_splits,
                kv_format=FP8_E4M3,
                out=self.out,
            )
        else:
            self.out.copy_(self.reference())

    def reference(self) -> torch.Tensor:
        return sparse_paged_attention_ref(
            self.q,
            self.k_view(),
            self.v_view(),
            self.block_table,
            self.token_req,
            self.selected,
            self.num_selected,
            self.scale,
            self.state.k_scale,
            self.state.v_scale,
            kv_format=FP8_E4M3,
        )

    def make_inputs(self, step: int, k_scale: float, v_scale: float) -> dict[str, torch.Tensor]:
        """Host tensors of one decode step: ``t - 2`` real tokens of distinct requests, 2 padding rows.

        About 1% of real K/V elements exceed 448 * scale (the clip counter's business); padding
        rows hold 1e4 everywhere, which would clip and corrupt the cache if they were not excluded.
        """
        g = self.gen
        t, real = self.t, self.t - 2
        k = torch.randn(t, self.hkv, self.d, generator=g) * (100 * k_scale)
        v = torch.randn(t, self.hkv, self.d, generator=g) * (100 * v_scale)
        for x, s in ((k, k_scale), (v, v_scale)):
            hot = torch.rand(x.shape, generator=g) < 0.01
            x[hot] = (
                torch.sign(torch.randn(int(hot.sum()), generator=g))
                * (448 * s)
                * (1.5 + torch.rand(int(hot.sum()), generator=g))
            )
        k[real:] = 1e4
        v[real:] = 1e4
        reqs = torch.randperm(self.reqs, generator=g)[:real]
        slots = torch.full((t,), -1, dtype=torch.int64)
        token_req = torch.zeros(t, dtype=torch.int32)
        selected = torch.full((t, self.width), -1, dtype=torch.int32)
        num_selected = torch.zeros(t, dtype=torch.int32)
        for i, r in enumerate(reqs.tolist()):
            pos = self.ctx + step  # every request decodes one token per step
            page = int(self.block_table[r, pos // self.bs])
            slots[i] = page * self.bs + pos % self.bs
            token_req[i] = r
            n = min(self.width, pos + 1)
            chosen = torch.randperm(pos, generator=g)[: n - 1].sort().values
            selected[i, : n - 1] = chosen.to(torch.int32)
            selected[i, n - 1] = pos  # the token attends to itself (just written)
            num_selected[i] = n
        return {
            "q": torch.randn(t, self.hq, self.d, generator=g).to(torch.bfloat16),
            "k": k.to(torch.bfloat16),
            "v": v.to(torch.bfloat16),
            "index_k": torch.randn(t, self.index_dim, generator=g).to(torch.bfloat16),
            "slots": slots,
            "token_req": token_req,
            "selected": selected,
            "num_selected": num_selected,
        }

    def load(self, inputs: dict[str, torch.Tensor]) -> None:
        for name, value in inputs.items():
            getattr(self, name).copy_(value, non_blocking=False)

    def reset(self) -> None:
        """Back to the initial cache and zero counters, in place (graphs keep their addresses)."""
        self.cache.copy_(self.cache0)
        self.state.clip_counts.zero_()
        self.out.zero_()


def expected_clips(inputs: dict[str, torch.Tensor], k_scale: float, v_scale: float) -> list[int]:
    keep = inputs["slots"] >= 0
    counts = []
    for x, s in ((inputs["k"], k_scale), (inputs["v"], v_scale)):
        counts.append(int(((x.float()[keep] / s).abs() > 448.0).sum()))
    return counts


def run_steps(world: World, steps: list[dict], graph: torch.cuda.CUDAGraph | None) -> dict:
    counters, outs = [], []
    for inputs in steps:
        world.load(inputs)
        if graph is None:
            world.step()
        else:
            graph.replay()
        counters.append(world.state.clip_counts.tolist())
        outs.append(world.out.clone())
    return {"counters": counters, "outs": outs, "cache": world.cache.clone()}


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"[check] {name:<58} {detail}: {'PASS' if ok else 'FAIL'}")
    return ok


def part1(
    world: World, args: argparse.Namespace, ks: float, vs: float
) -> tuple[bool, torch.cuda.CUDAGraph | None]:
    steps = [world.make_inputs(i, ks, vs) for i in range(args.steps)]
    want, total = [], [0, 0]
    for inputs in steps:
        c = expected_clips(inputs, ks, vs)
        total = [total[0] + c[0], total[1] + c[1]]
        want.append(list(total))
    ok = True
    world.reset()
    eager = run_steps(world, steps, None)
    ok &= check(
        "eager: counters == host count of |x/scale| > 448",
        eager["counters"] == want,
        f"{eager['counters'][-1]} vs {want[-1]}",
    )
    ok &= check(
        "eager: null block 0 untouched by padding rows", torch.equal(eager["cache"][0].cpu(), world.cache0[0])
    )
    ref = world.reference()
    err = (ref.float() - eager["outs"][-1].float()).abs().max().item()
    ok &= check("eager: kernel output == torch reference (last step)", err < 2e-2, f"max|err| {err:.2e}")
    # Padding rows must not have written anywhere: only the real slots changed.
    changed = (eager["cache"].cpu() != world.cache0).any(dim=-1).flatten().nonzero().flatten()
    written = torch.cat([s["slots"][s["slots"] >= 0] for s in steps]).sort().values
    ok &= check(
        "eager: exactly the real rows' slots changed",
        torch.equal(changed, written),
        f"{changed.numel()} rows",
    )
    if world.device.type != "cuda":
        return ok, None

    world.reset()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    world.load(steps[0])
    with torch.cuda.stream(side):  # warm-up (Triton compile/autotune caches) outside the capture
        world.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    world.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        world.step()
    torch.cuda.synchronize()
    captured_counts = world.state.clip_counts.tolist()
    ok &= check("capture itself did not count (nothing ran)", captured_counts == [0, 0], str(captured_counts))
    replayed = run_steps(world, steps, graph)
    ok &= check(
        "graph: counters == eager counters, every step",
        replayed["counters"] == eager["counters"],
        str(replayed["counters"][-1]),
    )
    ok &= check("graph: cache bytes == eager cache bytes", torch.equal(replayed["cache"], eager["cache"]))
    same_out = all(torch.equal(a, b) for a, b in zip(replayed["outs"], eager["outs"], strict=True))
    max_diff = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(replayed["outs"], eager["outs"], strict=True)
    )
    ok &= check(
        "graph: attention outputs == eager outputs, every step",
        same_out or max_diff < 1e-3,
        f"bitwise={same_out}, max diff {max_diff:.1e}",
    )
    return ok, graph


def _capture_warnings() -> list[str]:
    """Collect the runtime's log records instead of printing one per poll."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    log = logging.getLogger("vllm.qwen4exp.qsa_kv")
    log.addHandler(Keep())
    log.propagate = False
    return records


def part2(world: World, graph: torch.cuda.CUDAGraph | None, args: argparse.Namespace) -> bool:
    """The reader thread (side stream + pinned memory + event) against a replaying graph.

    Without a graph (``--smoke`` on the CPU) the eager step is repeated instead.
    """
    replay = graph.replay if graph is not None else world.step
    sync = torch.cuda.synchronize if world.device.type == "cuda" else (lambda: None)
    runtime = QSAKVRuntime()
    runtime.add(world.state)
    warnings = _capture_warnings()
    base = world.state.clip_counts.tolist()
    sync()
    n = args.replays

    def timed_replays() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            replay()
        sync()
        return (time.perf_counter() - t0) / n * 1e6

    before = world.state.clip_counts.tolist()
    alone_us = timed_replays()
    after = world.state.clip_counts.tolist()
    per_replay = [(a - b) // n for a, b in zip(after, before, strict=True)]
    runtime.start_clip_reader(args.poll_s)  # exports the device totals so far, then polls
    readings: list[list[int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            totals = runtime.poll_clips()
            readings.append(totals[LAYER])
            time.sleep(args.poll_s)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start_total = world.state.clip_counts.tolist()
    with_reader_us = timed_replays()
    stop.set()
    watcher.join()
    runtime.stop()
    sync()
    final_dev = world.state.clip_counts.tolist()
    last = runtime.poll_clips()[LAYER]
    expected = [s + n * p for s, p in zip(start_total, per_replay, strict=True)]
    clipped_metric()  # registered in this process's default registry
    metric = [
        REGISTRY.get_sample_value(
            "qwen4exp_qsa_kv_clipped_total", {"layer": LAYER, "rank": runtime.rank, "tensor": t}
        )
        or 0.0
        for t in ("k", "v")
    ]
    mono = all(
        all(b >= a for a, b in zip(r0, r1, strict=True))
        for r0, r1 in zip(readings, readings[1:], strict=False)
    )
    ok = True
    ok &= check(
        "replay adds the same count every time", per_replay[0] > 0, f"{per_replay} per replay, base {base}"
    )
    ok &= check(
        "device total == start + replays x per-replay count",
        final_dev == expected,
        f"{final_dev} vs {expected}",
    )
    ok &= check(
        "reader readings monotonic while replaying", mono and len(readings) > 3, f"{len(readings)} readings"
    )
    ok &= check("reader's last reading == device total", last == final_dev, str(last))
    ok &= check("Prometheus counter == device total", [int(m) for m in metric] == final_dev, str(metric))
    print(f"[log] {len(warnings)} clip warnings while polling; first: {warnings[0] if warnings else None}")
    ok &= check("clip warnings logged", bool(warnings))
    print(
        f"[timing] graph replay: {alone_us:.1f} us alone, {with_reader_us:.1f} us with the reader polling every "
        f"{args.poll_s * 1e3:.0f} ms ({len(readings)} reads)"
    )
    return ok


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
