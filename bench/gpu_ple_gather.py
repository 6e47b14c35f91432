"""Benchmark of the PLE gather kernel (pinned host tables read through UVA).

Run on a CUDA machine (no vLLM needed): ``PYTHONPATH=. python3 bench/gpu_ple_gather.py``.

The kernel's judges (bit-exactness for bf16/fp8/nvfp4, ids beyond 2**31, an 8 GiB table, prefetch in
CUDA graphs, the vLLM layer's storage paths) are ``tests/gpu/test_ple_gather*.py``; this script only
times.

Markdown tables, also written to ``$OUT/ple_bench.md``: gather throughput
from an 8 GiB pinned table (256-byte rows) for decode- and prefill-sized batches, random vs
sorted ids, against a contiguous host-to-device copy of the same bytes; launch-shape sweep;
transparent huge pages vs plain pinning; and how much of the lookup a side-stream prefetch
hides behind a realistic decode layer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from model.ple.gather_kernel import default_launch_config, ple_gather
from model.ple.host_memory import alloc_pinned_host
from model.ple.storage import make_storage

GiB = 1 << 30
DEV = torch.device("cuda", 0)
CRASHED: list[str] = []
REPORT: list[str] = []


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """Run one benchmark section; a crash is recorded and the next section still runs."""
    try:
        yield
    except Exception:
        traceback.print_exc()
        CRASHED.append(name)


def log(msg: str = "") -> None:
    print(msg, flush=True)


def emit(md: str) -> None:
    """Print a markdown block and keep it for $OUT/ple_bench.md."""
    log(md)
    REPORT.append(md)


def table(rows: list[list[str]], header: list[str]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def time_events(fn: Callable[[int], None], iters: int = 30, warmup: int = 3) -> float:
    """Median seconds of ``fn(i)`` timed with CUDA events (i rotates input sets)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) / 1e3


def meminfo(key: str) -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "n/a"


# --------------------------------------------------------------------------------------------
# Part 2: benchmark
# --------------------------------------------------------------------------------------------

SIZES = [512, 2048, 8192, 65536, 262144]
DIM = 128  # bf16: 256-byte rows


def fill_random(host_u8: torch.Tensor) -> None:
    """Fill a pinned buffer with random bytes quickly: generate on the GPU, copy down in 1 GiB chunks."""
    chunk = torch.empty(GiB, dtype=torch.uint8, device=DEV)
    for off in range(0, host_u8.numel(), GiB):
        n = min(GiB, host_u8.numel() - off)
        chunk[:n].random_(0, 256)
        host_u8[off : off + n].copy_(chunk[:n])
    torch.cuda.synchronize()
    del chunk


def id_sets(rows: int, n: int, k: int, sort: bool, window: int | None = None) -> list[torch.Tensor]:
    """``k`` sets of ``n`` random ids (each set in its own random window of ``window`` rows)."""
    sets = []
    for _ in range(k):
        if window is None or window >= rows:
            ids = torch.randint(0, rows, (n,), device=DEV)
        else:
            base = int(torch.randint(0, rows - window, ()).item())
            ids = torch.randint(base, base + window, (n,), device=DEV)
        sets.append(ids.sort().values if sort else ids)
    return sets


def graph_time(launch: Callable[[int], None], k: int, replays: int = 8) -> float:
    """Seconds per call of ``launch(i)``: ``k`` calls (rotating inputs) captured in one CUDA graph.

    Graph replay removes the Python/launcher overhead (~20-40 us per eager Triton launch), which
    otherwise dominates decode-sized gathers when timed with events around eager calls.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(k):
            launch(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for i in range(k):
            launch(i)
    t = time_events(lambda i: gr.replay(), iters=replays, warmup=2)
    return t / k


def bench_gather(
    data: torch.Tensor,
    n: int,
    sort: bool = False,
    k: int = 8,
    window: int | None = None,
    same_ids: bool = False,
    **cfg,
) -> float:
    rows = data.shape[0]
    sets = id_sets(rows, n, 1 if same_ids else k, sort, window)
    out = torch.empty((n, data.shape[1]), dtype=data.dtype, device=DEV)
    fmt = "bf16" if data.dtype == torch.bfloat16 else "fp8_e4m3"

    def run(i: int) -> None:
        ple_gather(fmt, data, sets[i % len(sets)], 0, out, raw=True, assume_pinned=True, **cfg)

    return graph_time(run, k, replays=8 if n <= 8192 else 4)


def bench_h2d(host_u8: torch.Tensor, nbytes: int) -> float:
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    span = host_u8.numel() - nbytes
    offs = [(i * 7919 * 4096 * 37) % max(span, 1) // 4096 * 4096 for i in range(8)]

    def run(i: int) -> None:
        o = offs[i % 8]
        dst.copy_(host_u8[o : o + nbytes], non_blocking=True)

    return graph_time(run, 8, replays=8)


def ptx_loads() -> str:
    """Global load/store forms in the last compiled gather kernel's PTX (are row loads 16 B wide?)."""
    from collections import Counter

    from model.ple import gather_kernel as pg

    k = pg._LAST_KERNEL
    try:
        ptx = k.asm["ptx"]
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return f"n/a ({type(e).__name__})"
    ops = Counter(
        line.split()[0] if not line.strip().startswith("@") else line.split()[1]
        for line in ptx.splitlines()
        if "ld.global" in line or "st.global" in line
    )
    return ", ".join(f"{op} x{c}" for op, c in sorted(ops.items()))


def fmt_us(s: float) -> str:
    return f"{s * 1e6:,.1f}"


def gbps(nbytes: int, s: float) -> str:
    return f"{nbytes / s / 1e9:.1f}"


def benchmark() -> None:
    log("== benchmark ==")
    props = torch.cuda.get_device_properties(DEV)
    thp = "n/a"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    emit(
        f"\n## Setup\n\n{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}, THP: `{thp}`\n"
    )

    nbytes = 8 * GiB
    rows = nbytes // (2 * DIM)
    t0 = time.perf_counter()
    host = alloc_pinned_host(nbytes)  # mmap + cudaHostRegister, exact size (the storage's allocator)
    t_reg = time.perf_counter() - t0
    fill_random(host)
    table_bf16 = host.view(torch.bfloat16).view(rows, DIM)
    log(f"registered 8 GiB in {t_reg:.2f}s")

    log(f"PTX loads/stores of the bf16 gather: {ptx_loads()}")

    # ---- launch-shape sweep -------------------------------------------------------------------
    with section("sweep"):
        d_rpp, d_w = default_launch_config("bf16", DIM, raw=True)
        sweep_rows = []
        sweep_sizes = (512, 2048, 8192, 65536)
        for rpp, warps, cap in (
            (1, 1, None),
            (4, 4, None),
            (8, 4, None),
            (16, 4, None),
            (16, 8, None),
            (32, 8, None),
            (64, 8, None),
            (16, 4, 8),
            (16, 4, 16),
            (16, 4, 32),
            (16, 4, 66),
            (16, 4, 132),
            (16, 4, 264),
        ):
            r = [f"{rpp}", f"{warps}", "-" if cap is None else str(cap)]
            for n in sweep_sizes:
                s = bench_gather(table_bf16, n, rows_per_program=rpp, num_warps=warps, max_programs=cap)
                r.append(f"{fmt_us(s)} ({gbps(n * 2 * DIM, s)})")
            sweep_rows.append(r)
        emit(
            f"\n## Launch shape sweep (8 GiB pinned bf16 table, 256 B rows, random ids, CUDA-graph timed; "
            f"us (GB/s)); default = {d_rpp} rows/program, {d_w} warps, no grid cap\n\n"
            + table(
                sweep_rows,
                ["rows/program", "warps", "max programs"] + [f"{n:,} rows" for n in sweep_sizes],
            )
        )

    # ---- locality: what limits random gathers --------------------------------------------------
    with section("locality"):
        loc_rows = []
        for label, kw in (
            ("random over 8 GiB, new ids each launch", {}),
            ("same ids every launch", {"same_ids": True}),
            ("random within 2 MiB windows", {"window": (2 << 20) // 256}),
            ("random within 64 MiB windows", {"window": (64 << 20) // 256}),
            ("random within 1 GiB windows", {"window": GiB // 256}),
        ):
            r = [label]
            for n in (8192, 65536):
                s = bench_gather(table_bf16, n, **kw)
                r.append(f"{fmt_us(s)} ({gbps(n * 2 * DIM, s)})")
            loc_rows.append(r)
        emit(
            "\n## Locality (bf16, 256 B rows, default launch; us (GB/s))\n\n"
            + table(loc_rows, ["ids", "8,192 rows", "65,536 rows"])
        )

    # ---- chunked launches -------------------------------------------------------------------
    with section("chunks"):
        ch_rows = []
        chunk_sizes = (None, 1024, 2048, 4096)
        for n in (8192, 65536, 262144):
            r = [f"{n:,}"]
            for c in chunk_sizes:
                s = bench_gather(table_bf16, n, max_rows_per_launch=c)
                r.append(f"{fmt_us(s)} ({gbps(n * 2 * DIM, s)})")
            ch_rows.append(r)
        emit(
            "\n## Large batches split into consecutive launches (max_rows_per_launch; bf16, random ids; "
            "us (GB/s))\n\n"
            + table(
                ch_rows, ["rows"] + ["one launch" if c is None else f"{c} rows/launch" for c in chunk_sizes]
            )
        )

    # ---- throughput vs contiguous copy -----------------------------------------------------
    with section("throughput"):
        tp_rows = []
        for n in SIZES:
            nb = n * 2 * DIM
            t_copy = bench_h2d(host, nb)
            for sort in (False, True):
                s = bench_gather(table_bf16, n, sort=sort)
                tp_rows.append(
                    [
                        f"{n:,}",
                        "sorted" if sort else "random",
                        fmt_us(s),
                        gbps(nb, s),
                        fmt_us(t_copy),
                        gbps(nb, t_copy),
                        f"{t_copy / s:.2f}",
                    ]
                )
        emit(
            "\n## UVA gather vs contiguous H2D copy of the same bytes (8 GiB pinned bf16 table, 256 B rows)\n\n"
            + table(
                tp_rows,
                ["rows", "ids", "gather us", "gather GB/s", "H2D copy us", "copy GB/s", "gather/copy speed"],
            )
        )

    # ---- formats on the same bytes ---------------------------------------------------------
    with section("formats"):
        fmt_rows = []
        fp8 = host.view(-1, 256)  # fp8 D=256: 256-byte rows
        n4 = nbytes // 144
        packed = host[: n4 * 128].view(n4, 128)  # nvfp4 D=256: 128 B packed + 16 B scales
        scales = host[n4 * 128 : n4 * 144].view(n4, 16)
        fused = host[: n4 * 144].view(n4, 144)  # the storage's default: scales inside each row
        f_packed, f_scales = fused[:, :128], fused[:, 128:]
        for n in (8192, 65536):
            bf = torch.bfloat16
            u8 = torch.uint8
            variants = [
                # name, format, data, block scales, raw, bytes/row, out width, out dtype, launch cfg
                ("bf16 D=128", "bf16", table_bf16, None, False, 256, 128, bf, {}),
                ("fp8 D=256 -> bf16", "fp8_e4m3", fp8, None, False, 256, 256, bf, {}),
                (
                    "fp8 D=256 -> bf16, 16 rows/prog",
                    "fp8_e4m3",
                    fp8,
                    None,
                    False,
                    256,
                    256,
                    bf,
                    {"rows_per_program": 16},
                ),
                ("fp8 D=256 raw", "fp8_e4m3", fp8, None, True, 256, 256, u8, {}),
                ("nvfp4 D=256 -> bf16, separate scales", "nvfp4", packed, scales, False, 144, 256, bf, {}),
                ("nvfp4 D=256 raw, separate scales", "nvfp4", packed, scales, True, 144, 128, u8, {}),
                ("nvfp4 D=256 -> bf16, interleaved", "nvfp4", f_packed, f_scales, False, 144, 256, bf, {}),
                ("nvfp4 D=256 raw, interleaved", "nvfp4", f_packed, f_scales, True, 144, 128, u8, {}),
            ]
            for name, fmt, data, bs, raw, row_b, out_w, out_dt, cfg in variants:
                sets = id_sets(data.shape[0], n, 8, False)
                o = torch.empty((n, out_w), dtype=out_dt, device=DEV)
                os_ = (
                    torch.empty((n, 16), dtype=torch.uint8, device=DEV) if (raw and bs is not None) else None
                )

                def run(i: int, fmt=fmt, data=data, bs=bs, raw=raw, o=o, os_=os_, sets=sets, cfg=cfg) -> None:
                    ple_gather(
                        fmt,
                        data,
                        sets[i % 8],
                        0,
                        o,
                        block_scales=bs,
                        global_scale=0.01,
                        raw=raw,
                        out_scales=os_,
                        assume_pinned=True,
                        **cfg,
                    )

                s = graph_time(run, 8, replays=4)
                fmt_rows.append(
                    [f"{n:,}", name, f"{row_b}", fmt_us(s), gbps(n * row_b, s), f"{n * 256 / s / 1e9:.1f}"]
                )
        emit(
            "\n## Formats (random ids, same 8 GiB pinned buffer reinterpreted)\n\n"
            + table(
                fmt_rows, ["rows", "format", "bytes/row", "us", "GB/s read", "values*1e9/s (D=256 equiv)"]
            )
        )

    # ---- THP vs plain pinning -------------------------------------------------------------
    with section("thp"):
        thp_rows = []
        anon_before = meminfo("AnonHugePages")
        variants: list[tuple[str, torch.Tensor]] = [("storage alloc: mmap + cudaHostRegister", host)]
        t0 = time.perf_counter()
        plain = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        t_plain = time.perf_counter() - t0
        variants.append(("torch pin_memory (cudaHostAlloc)", plain))
        t0 = time.perf_counter()
        huge = alloc_pinned_host(nbytes, huge_pages=True)
        t_huge = time.perf_counter() - t0
        variants.append(("mmap + MADV_HUGEPAGE + cudaHostRegister", huge))
        anon_after = meminfo("AnonHugePages")
        log(
            f"pin_memory 8 GiB: {t_plain:.2f}s; THP mmap+register 8 GiB: {t_huge:.2f}s; "
            f"AnonHugePages {anon_before} -> {anon_after}"
        )
        for name, buf in variants:
            tb = buf.view(torch.bfloat16).view(rows, DIM)
            r = [name]
            for n in SIZES:
                s = bench_gather(tb, n)
                r.append(f"{fmt_us(s)} ({gbps(n * 2 * DIM, s)})")
            thp_rows.append(r)
        emit(
            f"\n## Host page backing (random ids, us (GB/s)); AnonHugePages {anon_before} -> {anon_after}; "
            f"alloc+pin 8 GiB: register {t_reg:.1f}s, pin_memory {t_plain:.1f}s, THP {t_huge:.1f}s\n\n"
            + table(thp_rows, ["backing"] + [f"{n:,} rows" for n in SIZES])
        )
        del plain, huge, variants, tb

    # ---- decode step: prefetch overlap -------------------------------------------------------
    with section("decode"):
        decode_overlap(host, rows)


def decode_overlap(host: torch.Tensor, rows: int) -> None:
    """Sequential (lookup, then layer) vs overlapped (prefetch on a side stream during the layer).

    Each variant is one CUDA graph; ids are redrawn inside the graph (``random_``) so every replay
    reads new rows, as a decode step would. Layer = 2x (up [T,2048]x[2048,8192], down back to
    2048) in bf16, 128 MiB of weights, so it is memory-bound like a decode layer.
    """
    # A small storage re-pointed at the already-filled 8 GiB buffer: the real prefetch code path
    # without pinning and loading another 8 GiB (bench-only shortcut into the storage's fields).
    st = make_storage("pinned", "bf16", 0, 16, DIM, device=DEV)
    st.vocab_end = rows
    st.data = host.view(torch.bfloat16).view(rows, DIM)
    st._loaded = [(0, rows)]
    w_up = [torch.randn(2048, 8192, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    w_dn = [torch.randn(8192, 2048, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    res_rows = []
    for tokens, n in ((64, 512), (256, 2048), (1024, 8192)):
        res_rows += _decode_case(st, rows, tokens, n, w_up, w_dn)
    emit(
        "\n## Decode step: lookup hidden by side-stream prefetch (CUDA graphs, new random ids each replay; "
        "layer = 2x([T,2048]x[2048,8192], [T,8192]x[8192,2048]) bf16; times exclude the ids draw; "
        "sequential = lookup then layer on one stream, default grid)\n\n"
        + table(
            res_rows,
            [
                "tokens",
                "rows",
                "prefetch max programs",
                "lookup us (default grid)",
                "lookup us (this grid)",
                "layer us",
                "sequential us",
                "overlapped us",
                "saved us",
                "saved / lookup",
            ],
        )
    )


def _graph_time(st, fn: Callable[[], None], cfg: dict) -> float:
    """Capture ``fn`` in a CUDA graph (after a side-stream warm-up) and time its replays."""
    saved = (st.kernel_config, st.prefetch_kernel_config)
    st.kernel_config, st.prefetch_kernel_config = cfg, {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    t = time_events(lambda i: gr.replay(), iters=50, warmup=5)
    st.kernel_config, st.prefetch_kernel_config = saved
    return t


def _decode_case(st, rows: int, tokens: int, n: int, w_up: list, w_dn: list) -> list[list[str]]:
    x0 = torch.randn(tokens, 2048, device=DEV, dtype=torch.bfloat16)
    x = torch.empty_like(x0)
    ids = torch.zeros(n, dtype=torch.int64, device=DEV)
    buf = torch.empty((n, DIM), dtype=torch.bfloat16, device=DEV)
    res = torch.empty_like(buf)
    st.reserve_prefetch(n)

    def layer() -> None:
        h = x0
        for up, dn in zip(w_up, w_dn, strict=True):
            h = (h @ up) @ dn
        x.copy_(h)

    def v_ids() -> None:
        ids.random_(0, rows)

    def v_lookup() -> None:
        ids.random_(0, rows)
        st.lookup(ids, out=buf)

    def v_layer() -> None:
        ids.random_(0, rows)
        layer()

    def v_seq() -> None:
        ids.random_(0, rows)
        st.lookup(ids, out=buf)
        layer()
        res.copy_(buf)

    def v_ovl() -> None:
        ids.random_(0, rows)
        st.start_prefetch(ids)
        layer()
        res.copy_(st.wait_prefetch())

    t_ids = _graph_time(st, v_ids, {})
    t_look = _graph_time(st, v_lookup, {}) - t_ids
    t_layer = _graph_time(st, v_layer, {}) - t_ids
    t_seq = _graph_time(st, v_seq, {}) - t_ids
    out = []
    for cap in (None, 8, 16, 32, 64):
        cfg = {} if cap is None else {"max_programs": cap}
        t_look_cap = t_look if cap is None else _graph_time(st, v_lookup, cfg) - t_ids
        t_ovl = _graph_time(st, v_ovl, cfg) - t_ids
        saved = t_seq - t_ovl
        out.append(
            [
                f"{tokens}",
                f"{n:,}",
                "default" if cap is None else f"{cap}",
                fmt_us(t_look),
                fmt_us(t_look_cap),
                fmt_us(t_layer),
                fmt_us(t_seq),
                fmt_us(t_ovl),
                fmt_us(saved),
                f"{100 * saved / t_look:.0f}%" if t_look > 0 else "n/a",
            ]
        )
    torch.cuda.synchronize()
    return out


def main() -> int:
    if not torch.cuda.is_available():
        log("CUDA is not available")
        return 2
    log(
        f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}, mmap.MADV_HUGEPAGE="
        f"{getattr(mmap, 'MADV_HUGEPAGE', None)}"
    )
    t0 = time.perf_counter()
    try:
        benchmark()
    except Exception:
        traceback.print_exc()
        CRASHED.append("benchmark")
    log(f"benchmark done at {time.perf_counter() - t0:.1f}s")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "ple_bench.md"), "w") as f:
            f.write("# PLE gather benchmark\n" + "\n".join(REPORT) + "\n")
            f.write(f"\nCrashed sections: {CRASHED or 'none'}\n")
    if CRASHED:
        log(f"\ncrashed sections (tracebacks above): {CRASHED}")
    return 1 if CRASHED else 0


if __name__ == "__main__":
    sys.exit(main())
