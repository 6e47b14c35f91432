"""Judges of the FP8 QSA cache write, clip counting and kernel read on a GPU, eager vs graph replay.

What they judge (the E4M3 vs BF16 tile sweep is ``bench/gpu_qsa_kernels.py``, timing only):

1. One QSA step exactly as the layer runs it with ``--kv-cache-dtype fp8`` and clip counting on
   (``QSAKVState.observe``/``encode``, ``fp8_rows`` + ``scatter_rows_`` into a uint8 paged cache,
   the Triton kernel reading the codes with tensor scales), eagerly and replayed from one captured
   CUDA graph: counters after every step, cache bytes and outputs identical; counters equal to a
   host count of ``|x / scale| > 448`` over the real rows; padding rows neither counted nor written.
2. The clip-counter reader thread polling while the graph replays: monotonic readings, the last
   one exact, the Prometheus counter at the device total.
"""

from __future__ import annotations

import argparse
import math
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
                *self.attention_args(), num_splits=self.num_splits, kv_format=FP8_E4M3, out=self.out
            )
        else:
            self.out.copy_(self.reference())

    def attention_args(self) -> tuple:
        """The positional arguments the kernel and its reference share."""
        st = self.state
        return (
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
        )

    def reference(self) -> torch.Tensor:
        return sparse_paged_attention_ref(*self.attention_args(), kv_format=FP8_E4M3)

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
