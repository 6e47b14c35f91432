"""Cases that judge the QSA sparse paged attention kernel and its FP8 decode on a GPU.

The pass/fail logic (``bench/gpu_qsa_kernels.py`` only times): the E4M3 byte decode bit-exact on
all 254 finite codes, and the kernel against the torch reference (``model.ops.qsa_sparse_attention``)
over BF16/FP16/FP32, E4M3 and E5M2 caches, GQA groups 1..8, head_dim 64..256, split-K on/off/auto,
ragged and empty rows, page numbers > 100000 in caches whose byte offsets pass 2**32, and CUDA-graph
replay with tensor scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from model.kernels import qsa_sparse_attention as K
from model.ops.fp8_e4m3 import decode_e4m3, encode_e4m3, encode_e5m2
from model.ops.qsa_sparse_attention import sparse_paged_attention_ref


def encode(x: torch.Tensor, kv_format: str, scale: float) -> torch.Tensor:
    if kv_format == "fp8_e4m3":
        return encode_e4m3(x, scale)
    if kv_format == "fp8_e5m2":
        return encode_e5m2(x, scale)
    return x


def check_decode(device: torch.device) -> tuple[bool, str]:
    """The kernel's E4M3 byte decode (integer bit moves) against torch's float8_e4m3fn, all codes."""
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    ours = K.decode_e4m3_triton(codes)
    expected = codes.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(expected)
    exact = torch.equal(ours[finite].view(torch.int32), expected[finite].view(torch.int32))
    torch_side = torch.equal(decode_e4m3(codes, torch.float32)[finite], expected[finite])
    nan_codes = (ours[0x7F].item(), ours[0xFF].item())
    ok = exact and torch_side and int(finite.sum()) == 254 and nan_codes == (480.0, -480.0)
    msg = (
        f"E4M3 via Triton helper on {device}: {int(finite.sum())} finite codes bit-exact={exact}, "
        f"torch-side decode equal={torch_side}, NaN codes 0x7F/0xFF -> {nan_codes}"
    )
    return ok, msg


@dataclass
class ValCase:
    name: str
    kv_format: str = "bf16"
    q_dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype = torch.bfloat16
    num_tokens: int = 8
    num_q_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 256
    block_size: int = 16
    num_reqs: int = 3
    ctx: int = 600
    width: int = 300
    num_splits: int | None = 1
    num_blocks: int = 0  # 0: just enough; larger: place pages at the top of a big cache
    page_floor: int = 0
    tensor_scales: bool = False
    empty_rows: bool = True


def build_val_inputs(c: ValCase, device: torch.device, gen: torch.Generator) -> dict[str, object]:
    blocks_per_req = math.ceil(c.ctx / c.block_size)
    need = c.num_reqs * blocks_per_req
    num_blocks = max(c.num_blocks, c.page_floor + need)
    shape = (num_blocks, c.block_size, c.num_kv_heads, c.head_dim)
    k_scale, v_scale = (0.5, 0.25) if c.kv_format != "bf16" else (1.0, 1.0)
    if c.kv_format == "bf16":
        k_cache = torch.empty(shape, dtype=c.cache_dtype, device=device)
        v_cache = torch.empty(shape, dtype=c.cache_dtype, device=device)
    else:
        k_cache = torch.empty(shape, dtype=torch.uint8, device=device)
        v_cache = torch.empty(shape, dtype=torch.uint8, device=device)
    # Random pages for the requests at or above page_floor; only those are filled (big caches).
    pages = c.page_floor + torch.randperm(num_blocks - c.page_floor, generator=gen, device="cpu")[:need]
    pages = pages.to(device)
    for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)):
        vals = torch.randn((need, *shape[1:]), generator=gen, device="cpu").to(device) * 2.0
        cache[pages] = encode(vals, c.kv_format, sc).to(cache.dtype)
    block_table = pages.view(c.num_reqs, blocks_per_req).to(torch.int32)
    req = torch.randint(0, c.num_reqs, (c.num_tokens,), generator=gen).to(torch.int32)
    counts = torch.randint(1, c.width + 1, (c.num_tokens,), generator=gen)
    counts[0] = c.width
    if c.empty_rows and c.num_tokens > 2:
        counts[1] = 0
    sel = torch.full((c.num_tokens, c.width), -1, dtype=torch.int32)
    for t in range(c.num_tokens):
        n = int(counts[t])
        sel[t, :n] = torch.randperm(c.ctx, generator=gen)[:n].sort().values.to(torch.int32)
    q = torch.randn((c.num_tokens, c.num_q_heads, c.head_dim), generator=gen).to(c.q_dtype).to(device)
    ks: float | torch.Tensor = k_scale
    vs: float | torch.Tensor = v_scale
    if c.tensor_scales:
        ks = torch.tensor([k_scale], device=device)
        vs = torch.tensor([v_scale], device=device)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": block_table,
        "token_req_idx": req.to(device),
        "selected": sel.to(device),
        "num_selected": counts.to(torch.int32).to(device),
        "scale": 1.0 / math.sqrt(c.head_dim),
        "k_scale": ks,
        "v_scale": vs,
    }


def tolerance(c: ValCase) -> tuple[float, float]:
    if c.q_dtype == torch.float32 and c.cache_dtype == torch.float32 and c.kv_format == "bf16":
        return 1e-4, 1e-4
    if c.q_dtype == torch.float16 or c.kv_format != "bf16":
        return 1e-2, 1e-2
    return 2e-2, 2e-2


def run_val_case(c: ValCase, device: torch.device, gen: torch.Generator) -> tuple[bool, str]:
    """Kernel vs the torch reference on one case (and graph replay with tensor scales)."""
    inp = build_val_inputs(c, device, gen)
    ref = sparse_paged_attention_ref(**inp, kv_format=c.kv_format)
    out = K.sparse_paged_attention(**inp, num_splits=c.num_splits, kv_format=c.kv_format)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    atol, rtol = tolerance(c)
    err = (out.float() - ref.float()).abs()
    bound = atol + rtol * ref.float().abs()
    counts = inp["num_selected"]
    empty_ok = bool((out[counts == 0] == 0).all())
    ok = bool((err <= bound).all()) and bool(torch.isfinite(out).all()) and empty_ok
    extra = ""
    if c.tensor_scales:
        extra = ", graph " + ("PASS" if graph_replay_matches(inp, c, out) else "FAIL")
        ok = ok and extra.endswith("PASS")
    max_page = int(inp["block_table"].max())
    msg = (
        f"{c.name}: max|err|={err.max().item():.3e} (max|ref|={ref.float().abs().max().item():.2f}) "
        f"splits={K.last_launch_info().get('num_splits')} max_page={max_page}{extra}"
    )
    del inp
    return ok, msg


def graph_replay_matches(inp: dict[str, object], c: ValCase, eager: torch.Tensor) -> bool:
    """The kernel with tensor scales must be CUDA-graph capturable and replay to the eager result."""
    if not isinstance(eager, torch.Tensor) or eager.device.type != "cuda":
        return True
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        K.sparse_paged_attention(**inp, num_splits=c.num_splits, kv_format=c.kv_format, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.sparse_paged_attention(**inp, num_splits=c.num_splits, kv_format=c.kv_format, out=out)
    out.zero_()
    inp["v_scale"].mul_(2.0)  # type: ignore[union-attr]  # a changed scale must be picked up on replay
    graph.replay()
    torch.cuda.synchronize()
    inp["v_scale"].div_(2.0)  # type: ignore[union-attr]
    return torch.allclose(out.float(), 2.0 * eager.float(), atol=2e-2, rtol=2e-2)


def all_empty_case(device: torch.device, gen: torch.Generator) -> tuple[bool, str]:
    """Every row selects nothing: the output must be exactly zero."""
    c = ValCase("all rows empty", num_tokens=3, width=16, num_splits=2, empty_rows=True)
    inp = build_val_inputs(c, device, gen)
    inp["num_selected"] = torch.zeros_like(inp["num_selected"])  # type: ignore[arg-type]
    out = K.sparse_paged_attention(**inp, num_splits=c.num_splits)
    good = bool((out == 0).all())
    return good, f"{c.name}: all zeros={good}"


def validation_cases(smoke: bool = False) -> list[ValCase]:
    if smoke:
        return [
            ValCase("smoke bf16 g8 split3", head_dim=64, num_tokens=4, width=40, ctx=80, num_splits=3),
            ValCase(
                "smoke e4m3 g4 split1", "fp8_e4m3", head_dim=64, num_q_heads=8, num_tokens=4, width=40, ctx=80
            ),
            ValCase(
                "smoke e4m3 tensor scales auto",
                "fp8_e4m3",
                head_dim=64,
                num_tokens=4,
                width=40,
                ctx=80,
                num_splits=None,
                tensor_scales=True,
            ),
        ]
    cases: list[ValCase] = []
    for kv in ("bf16", "fp8_e4m3"):
        for group in (1, 2, 4, 8):
            for splits in (1, 4):
                cases.append(
                    ValCase(
                        f"{kv} D256 g{group} splits={splits}", kv, num_q_heads=2 * group, num_splits=splits
                    )
                )
    for d in (64, 128):
        for kv in ("bf16", "fp8_e4m3", "fp8_e5m2"):
            cases.append(ValCase(f"{kv} D{d} g8 splits=auto", kv, head_dim=d, num_splits=None))
    cases += [
        ValCase("e5m2 D256 g8 splits=3 bs64", "fp8_e5m2", block_size=64, num_splits=3),
        ValCase(
            "fp16 q+cache D128 g4 splits=2",
            q_dtype=torch.float16,
            cache_dtype=torch.float16,
            head_dim=128,
            num_q_heads=8,
            num_splits=2,
        ),
        ValCase(
            "fp32 q+cache D64 g2 splits=1",
            q_dtype=torch.float32,
            cache_dtype=torch.float32,
            head_dim=64,
            num_q_heads=4,
            num_splits=1,
        ),
        ValCase("fp32 q, e4m3 D256 g8 splits=5", "fp8_e4m3", q_dtype=torch.float32, num_splits=5),
        ValCase(
            "e4m3 long rows 2051 sel, splits=auto, T=4",
            "fp8_e4m3",
            num_tokens=4,
            ctx=8000,
            width=2051,
            num_splits=None,
            empty_rows=False,
        ),
        ValCase("bf16 tensor scales + graph, splits=4", num_splits=4, tensor_scales=True),
        ValCase("e4m3 tensor scales + graph, splits=1", "fp8_e4m3", num_splits=1, tensor_scales=True),
        ValCase("e4m3 tensor scales + graph, splits=3", "fp8_e4m3", num_splits=3, tensor_scales=True),
        # Byte offsets past 2**32: 140k pages x 64 slots x 2 heads x 256 = 4.6e9 elements.
        ValCase(
            "e4m3 big cache: pages>100000, bs64",
            "fp8_e4m3",
            block_size=64,
            num_blocks=140_000,
            page_floor=100_000,
            num_splits=2,
        ),
        ValCase(
            "bf16 big cache: pages>100000, bs64",
            block_size=64,
            num_blocks=140_000,
            page_floor=100_000,
            num_splits=1,
        ),
    ]
    return cases
