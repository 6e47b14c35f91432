"""Judges of the PLE gather kernel on a GPU (pinned host tables read through UVA).

The pass/fail logic (``bench/gpu_ple_gather.py`` only times): the UVA kernel reading pinned
host memory must equal the torch reference bit for bit for bf16, fp8 and nvfp4, in dequantize and
raw modes, for several launch shapes; a side-stream prefetch must give identical rows, also when
captured in a CUDA graph and replayed with new ids; the storage paths the vLLM layer uses
(checkpoint-style loading, ETP raw-byte sums, raw prefetch in a graph); ids beyond 2**31.
"""

from __future__ import annotations

import torch

from model.ple.gather_kernel import is_supported, ple_gather
from model.ple.storage import check_uva_support, make_storage, storage_from_table
from model.ple.tables import (
    FORMATS,
    dequantize_rows,
    lookup_raw_ref,
    lookup_ref,
    make_table,
    raw_row_bytes,
    shard_bounds,
    slice_table,
    split_row_bytes,
)

DEV = torch.device("cuda", 0)
FAILURES: list[str] = []
PASSED: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)


def check(name: str, ok: bool, detail: str = "") -> None:
    (PASSED if ok else FAILURES).append(name + (f" {detail}" if detail else ""))


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def correctness() -> None:
    log("== correctness ==")
    check_uva_support(DEV)
    check("is_supported(cuda)", is_supported(DEV))
    g = torch.Generator().manual_seed(0)
    total = 6000
    for fmt in FORMATS:
        for dim in (128, 96, 1024):
            w = (
                torch.randn(total, dim, generator=g) * 0.05 * torch.logspace(-3, 0, total)[:, None]
            ).bfloat16()
            full = make_table(fmt, w, vocab_start=0)
            a, b = shard_bounds(total, 1, 3)
            shard = slice_table(full, a, b)
            huge = dim == 96
            st = storage_from_table("pinned", full, a, b, device=DEV, huge_pages=huge)
            tag = f"{fmt} D={dim}{' thp' if huge else ''}"
            check(f"{tag} pinned_bytes", st.pinned_bytes() == shard.nbytes() and st.fully_loaded)
            ids_cpu = torch.randint(-10, total + 10, (4, 777), generator=g)
            ids_cpu[0, :4] = torch.tensor([a - 1, a, b - 1, b])
            ids = ids_cpu.to(DEV)
            ref = lookup_ref(shard, ids_cpu)
            ref_raw, ref_s = lookup_raw_ref(shard, ids_cpu)

            got = st.lookup(ids)
            torch.cuda.synchronize()
            check(f"{tag} dequant == ref", same(got, ref))
            raw, raw_s = st.lookup_raw(ids)
            check(f"{tag} raw == ref", same(raw, ref_raw) and (ref_s is None or same(raw_s, ref_s)))
            out32 = torch.empty((4, 777, dim), dtype=torch.float32, device=DEV)
            st.lookup(ids, out=out32)
            check(f"{tag} fp32 out == ref", same(out32, lookup_ref(shard, ids_cpu, out_dtype=torch.float32)))

            cfgs = [dict(rows_per_program=8, max_programs=7), dict(max_rows_per_launch=1000)]
            if dim == 128:
                cfgs += [
                    dict(rows_per_program=1, num_warps=1),
                    dict(rows_per_program=4, num_warps=2),
                    dict(rows_per_program=64, num_warps=8),
                ]
            for cfg in cfgs:
                o = torch.full_like(got, 5.0)
                ple_gather(
                    fmt, st.data, ids, a, o, block_scales=st.block_scales, global_scale=st.global_scale, **cfg
                )
                ro = torch.full_like(raw, 3)
                ros = None if raw_s is None else torch.full_like(raw_s, 3)
                ple_gather(
                    fmt,
                    st.data,
                    ids,
                    a,
                    ro,
                    block_scales=st.block_scales,
                    global_scale=st.global_scale,
                    raw=True,
                    out_scales=ros,
                    **cfg,
                )
                check(
                    f"{tag} cfg {cfg}",
                    same(o, ref) and same(ro, ref_raw) and (ref_s is None or same(ros, ref_s)),
                )

            if fmt == "nvfp4":
                check(f"{tag} scales interleaved in rows", st.data.stride(0) == dim // 2 + dim // 16)
                sep = storage_from_table("pinned", full, a, b, device=DEV, interleave_scales=False)
                r2, r2s = sep.lookup_raw(ids)
                check(
                    f"{tag} separate-scales storage == ref",
                    same(sep.lookup(ids), ref) and same(r2, ref_raw) and same(r2s, ref_s),
                )
                del sep

            # Device-resident storage (torch path on the GPU) agrees with the CPU reference too.
            dst = storage_from_table("device", full, a, b, device=DEV)
            check(f"{tag} device storage == ref", same(dst.lookup(ids), ref))

            if dim != 128:
                continue
            # Side-stream prefetch, eager.
            st.reserve_prefetch(ids.numel())
            x = torch.randn(512, 2048, device=DEV, dtype=torch.bfloat16)
            wm = torch.randn(2048, 2048, device=DEV, dtype=torch.bfloat16)
            st.start_prefetch(ids)
            y = x @ wm
            pf = st.wait_prefetch().clone()
            torch.cuda.synchronize()
            check(f"{tag} prefetch == ref", same(pf, ref))
            del y

            # Prefetch + direct lookup captured in a CUDA graph, replayed with new ids.
            static_ids = ids.clone()
            res_pf = torch.empty_like(got)
            res_direct = torch.empty_like(got)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture (compiles, allocator)
                for _ in range(2):
                    st.start_prefetch(static_ids)
                    _ = x @ wm
                    res_pf.copy_(st.wait_prefetch())
                    st.lookup(static_ids, out=res_direct)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                st.start_prefetch(static_ids)
                _ = x @ wm
                res_pf.copy_(st.wait_prefetch())
                st.lookup(static_ids, out=res_direct)
            for rep in range(3):
                new_ids = torch.randint(-10, total + 10, (4, 777), generator=g)
                static_ids.copy_(new_ids.to(DEV))
                graph.replay()
                torch.cuda.synchronize()
                want = lookup_ref(shard, new_ids)
                check(f"{tag} graph replay {rep}", same(res_pf, want) and same(res_direct, want))
            del graph

    model_paths(g)

    # Global ids beyond 2**31 (int64 id arithmetic) on a small shard.
    full = make_table("bf16", torch.randn(300, 128).bfloat16(), vocab_start=3_000_000_000)
    st = storage_from_table("pinned", full, device=DEV)
    ids_cpu = torch.randint(3_000_000_000 - 5, 3_000_000_000 + 305, (1000,))
    check("ids > 2**31", same(st.lookup(ids_cpu.to(DEV)), lookup_ref(full, ids_cpu)))


def model_paths(g: torch.Generator) -> None:
    """The storage paths the vLLM layer (``NgramTable``) uses, on the GPU.

    Checkpoint-style loading (rows, block scales and the global scale as separate tensors, the
    scale last) into pinned storage; ETP with quantized tables (each rank gathers raw bytes, the
    bytes are summed over ranks, dequantized once); and raw prefetches, eager and replayed in a
    CUDA graph with the prefetch buffer reserved before capture.
    """
    total, dim, tp = 5000, 128, 3
    for fmt in ("fp8_e4m3", "nvfp4"):
        w = (torch.randn(total, dim, generator=g) * 0.05 * torch.logspace(-3, 0, total)[:, None]).bfloat16()
        full = make_table(fmt, w, vocab_start=0)
        ids_cpu = torch.randint(-10, total + 10, (333, 4), generator=g)
        ids = ids_cpu.to(DEV)
        ref = lookup_ref(full, ids_cpu)
        shards = []
        for r in range(tp):
            a, b = shard_bounds(total, r, tp)
            st = make_storage("pinned", fmt, a, b, dim, global_scale=None, device=DEV)
            for lo in range(0, total, 1700):  # checkpoint pieces unaligned with the rank's range
                part = slice_table(full, lo, min(total, lo + 1700))
                st.load_data_rows(lo, part.data)
                if part.block_scales is not None:
                    st.load_block_scale_rows(lo, part.block_scales)
            st.set_global_scale(full.global_scale)
            shards.append(st)
        check(f"{fmt} checkpoint-style load complete", all(s.fully_loaded for s in shards))
        acc = None
        for st in shards:
            part = raw_row_bytes(*st.lookup_raw(ids)).to(torch.int32)
            acc = part if acc is None else acc + part
        torch.cuda.synchronize()
        check(f"{fmt} ETP raw bytes: one owner per row", int(acc.max()) <= 255)
        data, scales = split_row_bytes(fmt, acc.to(torch.uint8), dim)
        check(
            f"{fmt} ETP raw-sum dequantized == ref",
            same(dequantize_rows(fmt, data, scales, full.global_scale), ref),
        )
        total_deq = sum(st.lookup(ids).float() for st in shards)
        check(f"{fmt} ETP dequantized sum == ref", torch.equal(total_deq.cpu(), ref.float()))

        st = shards[1]
        want_d, want_s = lookup_raw_ref(st.table, ids_cpu)
        st.reserve_prefetch(ids.numel(), raw=True)
        st.start_prefetch(ids, raw=True)
        y = torch.randn(256, 2048, device=DEV, dtype=torch.bfloat16) @ torch.randn(
            2048, 2048, device=DEV, dtype=torch.bfloat16
        )
        d, s_ = st.wait_prefetch_raw()
        torch.cuda.synchronize()
        check(f"{fmt} raw prefetch == lookup_raw", same(d, want_d) and (want_s is None or same(s_, want_s)))
        del y

        static_ids = ids.clone()
        res_d = torch.empty_like(d)
        res_s = None if s_ is None else torch.empty_like(s_)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                st.start_prefetch(static_ids, raw=True)
                dd, ss = st.wait_prefetch_raw()
                res_d.copy_(dd)
                if res_s is not None:
                    res_s.copy_(ss)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            st.start_prefetch(static_ids, raw=True)
            dd, ss = st.wait_prefetch_raw()
            res_d.copy_(dd)
            if res_s is not None:
                res_s.copy_(ss)
        for rep in range(2):
            new_ids = torch.randint(-10, total + 10, (333, 4), generator=g)
            static_ids.copy_(new_ids.to(DEV))
            graph.replay()
            torch.cuda.synchronize()
            wd, ws = lookup_raw_ref(st.table, new_ids)
            check(
                f"{fmt} raw prefetch graph replay {rep}", same(res_d, wd) and (ws is None or same(res_s, ws))
            )
        del graph
