"""Compile upstream vLLM's Qwen4-Exp QSA Triton kernels for sm_86 and sm_90 without a GPU.

Upstream's kernels keep tiles of their operands in shared memory, so whether they launch on a card
depends on the shapes and tiles: the indexer prefill kernel's query tile is TILE_R rows x every index
head x the head dim (286,720 bytes for 16 heads at TILE_R=64 on sm_86, where an RTX 3090 allows
101,376 per block). This module compiles the kernels ahead of time (``triton.compile`` on an
``ASTSource`` for a ``GPUTarget``; ptxas ships in Triton's wheel) with the constexprs, warps and
stages the launchers pass, and reads the compiled kernel's ``metadata.shared``; ``ptxas_report``
runs ptxas on the PTX for registers and spills. Scalar arguments get the specialisation Triton gives
them at launch (multiple of 16 -> divisibility hint, 1 -> constant), which changes the result.

``tests/kernels/test_sm86_compile.py`` checks the product's choices with it. As a script it prints
the whole study (every head count, both cache dtypes, both targets; the smallest tile change that
fits where the launcher's tile does not): ``.venv/bin/python -m tests.kernels.sm86_compile``.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# name -> (compute capability, max dynamic shared memory per block in bytes)
TARGETS: dict[str, tuple[int, int]] = {"sm_86 (3090)": (86, 101376), "sm_90 (H200)": (90, 232448)}
HEADS = (1, 2, 4, 8, 16)
INDEX_DIM = 128  # indexer_head_dim
CACHE_DTYPES = {"bf16": "bf16", "fp8_e4m3": "fp8e4nv"}  # cache dtype -> Triton pointer element type
# vLLM's attention block size for this hybrid model is picked by its Mamba page alignment (80,
# 112 and 144 in our H200 logs); the indexer's compressed cache page is block_size // ratio.
BLOCK_SIZE, RATIO = 80, 4
PAGE = BLOCK_SIZE // RATIO  # 20 compressed rows per page: k_cache.shape[1] in the launchers
TABLE_WIDTH = 820  # block-table width: 65536-token context / 80
TOPK = 2048 // RATIO  # indexer_budget 2048 -> 512 compressed blocks
MAIN_HEADS, MAIN_KV_HEADS, MAIN_DIM = 16, 2, 256  # main attention (deploy/qwen4-exp-config.example.json)
OPS = "vllm.models.qwen4_exp.nvidia.ops"


def load_ops() -> dict[str, types.ModuleType]:
    """Import upstream's kernel modules with the real ``triton``.

    vLLM's CPU build replaces ``triton`` by a placeholder when Triton has no CPU backend, which
    would turn every ``@triton.jit`` into a plain function; a stand-in ``vllm.triton_utils``
    hands the modules the real package instead (compiling for CUDA needs no driver).
    """
    import vllm

    stub = types.ModuleType("vllm.triton_utils")
    stub.__path__ = [str(Path(vllm.__file__).parent / "triton_utils")]
    stub.__dict__.update(HAS_TRITON=True, triton=triton, tl=tl)
    sys.modules["vllm.triton_utils"] = stub
    modules = {
        name: importlib.import_module(f"{OPS}.{name}") for name in ("qsa_indexer", "qsa", "qsa_prepare", "hc")
    }
    kernel = modules["qsa_indexer"]._qsa_mqa_paged_prefill_kernel  # a real Triton kernel, not a placeholder
    assert type(kernel).__module__.startswith("triton."), type(kernel)
    return modules


@dataclass
class Launch:
    """One kernel launch: argument values as upstream passes them, and what to print."""

    kernel: Any  # triton.JITFunction
    args: dict[str, Any]  # runtime arguments: "*dtype" for tensors, numbers for scalars
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int = 3  # Triton's default: upstream's launchers only set it for qsa.py
    dtype: str = "bf16"
    heads: str = "-"
    head_dim: int = INDEX_DIM
    tile: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def shared_bytes(launch: Launch, capability: int) -> int:
    """Compile ``launch`` for ``sm_<capability>`` and return its static + dynamic shared memory."""
    return compile_launch(launch, capability).metadata.shared


def compile_launch(launch: Launch, capability: int):
    """``launch`` compiled for ``sm_<capability>`` (Triton's CompiledKernel: metadata, asm)."""
    fn = launch.kernel
    constexprs = dict(launch.constexprs)
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = launch.args[name]
        specialize = name not in fn.do_not_specialize
        if isinstance(value, str):  # a tensor: torch allocations are 16-byte aligned
            signature[name] = value
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif specialize and value == 1:  # Triton turns an integer 1 into a constant
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if specialize and value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def ptxas_report(compiled, capability: int) -> str:
    """ptxas's verbose resource report (registers, spill stores/loads) for a compiled kernel's PTX."""
    import subprocess
    import tempfile

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        done = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name=sm_{capability}", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    return done.stderr + done.stdout


def prefill(ops: dict[str, types.ModuleType], heads: int, dtype: str, **tile: int) -> Launch:
    """``_prefill_logits``: fp8 TILE_R 32, STAGES 2, 8 warps; bf16 TILE_R 64, STAGES 2, 4 warps."""
    page = tile.pop("page", PAGE)
    fp8 = dtype == "fp8_e4m3"
    cfg = {"TILE_R": 32 if fp8 else 64, "STAGES": 2, "warps": 8 if fp8 else 4} | tile
    element = "*" + CACHE_DTYPES[dtype]
    args = {
        "q_ptr": element,
        "k_cache_ptr": element,
        "page_table_ptr": "*i32",
        "query_start_loc_ptr": "*i32",
        "visible_blocks_ptr": "*i32",
        "logits_ptr": "*fp32",
        "stride_q_row": heads * INDEX_DIM,
        "stride_q_head": INDEX_DIM,
        "stride_cache_block": page * INDEX_DIM,
        "stride_cache_token": INDEX_DIM,
        "stride_table_req": TABLE_WIDTH,
        "stride_logits_row": 16384,  # logits_width: a multiple of 64
        "num_rows": 8192,
        "query_offset": 0,
        "page_table_width": TABLE_WIDTH,
    }
    constexprs = {"PAGE_SIZE": page, "NUM_HEADS": heads, "HEAD_DIM": INDEX_DIM, "TILE_R": cfg["TILE_R"]}
    constexprs |= {"BLOCK_N": 64, "K_TILES": 16, "STAGES": cfg["STAGES"]}
    tile_text = f"TILE_R={cfg['TILE_R']} STAGES={cfg['STAGES']} BLOCK_N=64 K_TILES=16 PAGE={page}"
    return Launch(
        ops["qsa_indexer"]._qsa_mqa_paged_prefill_kernel,
        args,
        constexprs,
        cfg["warps"],
        dtype=dtype,
        heads=str(heads),
        tile=f"{tile_text} warps={cfg['warps']}",
        extra=cfg | {"page": page},
    )


def decode(ops: dict[str, types.ModuleType], heads: int, dtype: str) -> Launch:
    """``qsa_select_paged_decode`` with one query per request (no speculative tokens)."""
    element = "*" + CACHE_DTYPES[dtype]
    warps = 1 if dtype == "fp8_e4m3" else 2
    args = {
        "q_ptr": element,
        "k_cache_ptr": element,
        "page_table_ptr": "*i32",
        "visible_blocks_ptr": "*i32",
        "logits_ptr": "*fp32",
        "stride_q_row": heads * INDEX_DIM,
        "stride_q_head": INDEX_DIM,
        "stride_cache_block": PAGE * INDEX_DIM,
        "stride_cache_token": INDEX_DIM,
        "stride_table_req": TABLE_WIDTH,
        "stride_logits_row": TABLE_WIDTH * PAGE,
    }
    constexprs = {"PAGE_SIZE": PAGE, "PAGE_TABLE_WIDTH": TABLE_WIDTH, "NUM_HEADS": heads}
    constexprs |= {
        "HEAD_DIM": INDEX_DIM,
        "DECODE_QUERY_LEN": 1,
        "BLOCK_N": 64,
        "TILES_PER_PROG": 1,
        "STAGES": 2,
    }
    tile = f"DECODE_QUERY_LEN=1 BLOCK_N=64 TILES_PER_PROG=1 STAGES=2 PAGE={PAGE} warps={warps}"
    return Launch(
        ops["qsa_indexer"]._qsa_mqa_paged_uniform_kernel,
        args,
        constexprs,
        warps,
        dtype=dtype,
        heads=str(heads),
        tile=tile,
    )


def sparse_attention(
    ops: dict[str, types.ModuleType], group: int, dtype: str, block_n: int, warps: int
) -> Launch:
    """``qsa_sparse_paged_attention`` (main attention over the selected tokens), 4 K splits."""
    q_heads = group * MAIN_KV_HEADS
    cache = "*" + CACHE_DTYPES[dtype]
    token_stride = 2 * MAIN_DIM  # K and V share a [blocks, kv_heads, page, 2*D] cache
    width = TOPK * RATIO + RATIO - 1  # selection columns; the buffer has one more (the count)
    args: dict[str, Any] = {
        "q_ptr": "*bf16",
        "k_cache_ptr": cache,
        "v_cache_ptr": cache,
        "indices_ptr": "*i32",
        "block_table_ptr": "*i32",
        "token_to_req_ptr": "*i32",
        "partial_output_ptr": "*fp32",
        "partial_lse_ptr": "*fp32",
        "output_ptr": "*bf16",
        "output_gate_ptr": "*bf16",
        "softmax_scale": MAIN_DIM**-0.5,
        "output_scale": 1.0,
        "stride_indices_row": width + 1,
        "stride_table_req": TABLE_WIDTH,
        "num_rows": 8192,
        "num_cache_blocks": 41943,
        "num_requests": 1,
    }
    for name in ("q", "output", "output_gate"):
        args |= {f"stride_{name}_row": q_heads * MAIN_DIM, f"stride_{name}_head": MAIN_DIM}
    for name in ("k", "v"):
        args |= {f"stride_{name}_block": MAIN_KV_HEADS * BLOCK_SIZE * token_stride}
        args |= {f"stride_{name}_token": token_stride, f"stride_{name}_head": BLOCK_SIZE * token_stride}
    constexprs = {
        "TOPK": width,
        "PAGE_SIZE": BLOCK_SIZE,
        "PAGE_TABLE_WIDTH": TABLE_WIDTH,
        "GROUP_SIZE": group,
    }
    constexprs |= {"HEAD_DIM": MAIN_DIM, "NUM_QUERY_HEADS": q_heads, "NUM_SPLITS": 4}
    constexprs |= {"NUM_TILES": triton.cdiv(width, block_n), "BLOCK_M": triton.next_power_of_2(group)}
    constexprs |= {"BLOCK_N": block_n, "IS_FP8": dtype == "fp8_e4m3"}
    tile = f"BLOCK_M={constexprs['BLOCK_M']} BLOCK_N={block_n} NUM_SPLITS=4 stages=2 warps={warps}"
    return Launch(
        ops["qsa"]._qsa_sparse_paged_gqa_splitk_kernel,
        args,
        constexprs,
        warps,
        num_stages=2,
        dtype=dtype,
        heads=f"{group} per KV head",
        head_dim=MAIN_DIM,
        tile=tile,
    )


def small_kernels(ops: dict[str, types.ModuleType], dtype: str) -> Iterator[Launch]:
    """The prefill path's kernels whose tile does not depend on a head count (one shape each)."""
    element = "*" + CACHE_DTYPES[dtype]
    heads = 16
    main_width = 2 * (MAIN_HEADS + MAIN_KV_HEADS) * MAIN_DIM
    prepare_args: dict[str, Any] = {
        "q_ptr": "*bf16",
        "q_stride_token": (heads + 1) * INDEX_DIM,
        "k_ptr": "*bf16",
        "k_stride_token": (heads + 1) * INDEX_DIM,
        "pos_ptr": "*i64",
        "pos_stride_axis": 0,
        "pos_stride_token": 1,
        "cos_sin_ptr": "*bf16",
        "q_norm_weight_ptr": "*bf16",
        "k_norm_weight_ptr": "*bf16",
        "eps": 1e-6,
        "q_out_ptr": element,
        "q_out_stride_token": heads * INDEX_DIM,
        "q_out_stride_head": INDEX_DIM,
        "state_cache_ptr": "*bf16",
        "state_cache_stride_block": RATIO * INDEX_DIM,
        "state_cache_stride_token": INDEX_DIM,
        "state_slots_ptr": "*i64",
        "state_table_ptr": "*i32",
        "state_table_stride_req": 1,
        "query_start_loc_ptr": "*i32",
        "logical_positions_ptr": "*i64",
        "compressed_slots_ptr": "*i64",
        "k_work_metadata_ptr": "*i32",
        "compressed_cache_ptr": element,
        "compressed_cache_stride_block": PAGE * INDEX_DIM,
        "compressed_cache_stride_token": INDEX_DIM,
        "num_tokens": 8192,
        "num_state_blocks": 256,
        "num_compressed_blocks": 41943,
        "num_k_work": 2048,
        "main_qkv_ptr": "*bf16",
        "main_qkv_stride_token": main_width,
        "main_q_norm_weight_ptr": "*bf16",
        "main_k_norm_weight_ptr": "*bf16",
        "main_eps": 1e-6,
        "main_q_out_ptr": "*bf16",
        "main_gate_out_ptr": "*bf16",
        "main_cache_ptr": element,
        "main_cache_stride_block": MAIN_KV_HEADS * BLOCK_SIZE * 2 * MAIN_DIM,
        "main_cache_stride_token": 2 * MAIN_DIM,
        "main_cache_stride_head": BLOCK_SIZE * 2 * MAIN_DIM,
        "main_slots_ptr": "*i64",
        "main_k_scale": 1.0,
        "main_v_scale": 1.0,
    }
    prepare_constexprs = {"HQ": heads, "D": INDEX_DIM, "TILE_T_Q": 2, "TILE_H_Q": 4, "COMPRESS_RATIO": RATIO}
    prepare_constexprs |= {"STATE_SIZE": RATIO, "COMP_PAGE_SIZE": PAGE, "IS_2D_POSITIONS": False}
    prepare_constexprs |= {"IS_K_MROPE": False, "CACHE_HAS_ROPE_POS": False, "MROPE_H": 0, "MROPE_W": 0}
    prepare_constexprs |= {"MAIN_HQ": MAIN_HEADS, "MAIN_HK": MAIN_KV_HEADS, "MAIN_D": MAIN_DIM}
    prepare_constexprs |= {"MAIN_PAGE_SIZE": BLOCK_SIZE}
    yield Launch(
        ops["qsa_prepare"]._qsa_prepare_kernel,
        prepare_args,
        prepare_constexprs,
        1,
        dtype=dtype,
        heads=str(heads),
        tile="TILE_T_Q=2 TILE_H_Q=4 (fixed) warps=1",
    )
    if dtype != "bf16":
        return
    width = TOPK * RATIO + RATIO - 1
    yield Launch(
        ops["qsa_indexer"]._expand_qsa_indices_kernel,
        {
            "block_indices_ptr": "*i32",
            "query_positions_ptr": "*i64",
            "visible_blocks_ptr": "*i32",
            "output_ptr": "*i32",
            "stride_blocks_row": TOPK,
            "stride_blocks_column": 1,
            "stride_output_row": width + 1,
            "stride_output_column": 1,
        },
        {"BLOCK_TOPK": TOPK, "COMPRESS_RATIO": RATIO, "COLUMN_BLOCK": 256},
        4,
        tile="COLUMN_BLOCK=256 warps=4",
    )
    splits = 64  # the most K splits any config table picks
    merge_args: dict[str, Any] = {"partial_output_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
    merge_args |= {"output_ptr": "*bf16", "output_gate_ptr": "*bf16", "num_rows": 8192}
    for name in ("output", "output_gate"):
        merge_args |= {f"stride_{name}_row": MAIN_HEADS * MAIN_DIM, f"stride_{name}_head": MAIN_DIM}
    yield Launch(
        ops["qsa"]._qsa_merge_splitk_kernel,
        merge_args,
        {"HEAD_DIM": MAIN_DIM, "NUM_QUERY_HEADS": MAIN_HEADS, "NUM_SPLITS": splits, "BLOCK_SPLITS": splits},
        2,
        num_stages=1,
        heads=str(MAIN_HEADS),
        head_dim=MAIN_DIM,
        tile=f"BLOCK_SPLITS={splits} stages=1 warps=2",
    )
    compress_args: dict[str, Any] = {"stride_raw_row": INDEX_DIM, "stride_raw_dim": 1}
    for name in ("raw_keys", "compressor_state_cache", "pooled"):
        compress_args[f"{name}_ptr"] = "*bf16"
    for name in ("raw_positions", "rope_cache", "logical_positions", "compressed_slots", "first_positions"):
        compress_args[f"{name}_ptr"] = "*i64"
    for name in ("compressor_state_table", "token_to_req", "query_start_loc"):
        compress_args[f"{name}_ptr"] = "*i32"
    compress_args |= {"stride_raw_positions_row": 3, "stride_raw_positions_dim": 1}
    for name in ("compressor_state", "rope"):
        compress_args |= {f"stride_{name}_block": RATIO * INDEX_DIM, f"stride_{name}_token": INDEX_DIM}
        compress_args[f"stride_{name}_dim"] = 1
    compress_args |= {"stride_compressor_state_table_req": 1, "stride_pooled_row": INDEX_DIM}
    compress_args |= {"stride_pooled_dim": 1, "stride_positions_row": 3, "stride_positions_dim": 1}
    compress_args |= {"num_rows": 8192, "num_compressor_state_blocks": 256, "num_requests": 8}
    yield Launch(
        ops["qsa"]._compress_qsa_groups_kernel,
        compress_args,
        {"COMPRESSOR_STATE_SIZE": RATIO, "COMPRESS_RATIO": RATIO, "HEAD_DIM": INDEX_DIM, "BLOCK_D": 128}
        | {"LOAD_ROPE_POSITIONS": False},
        4,
        tile="BLOCK_D=128 warps=4",
    )
    store_args: dict[str, Any] = {"cache_ptr": "*bf16", "slots_ptr": "*i64", "rows_ptr": "*bf16"}
    store_args |= {
        "stride_cache_block": PAGE * INDEX_DIM,
        "stride_cache_token": INDEX_DIM,
        "stride_cache_dim": 1,
    }
    store_args |= {"stride_rows_row": INDEX_DIM, "stride_rows_dim": 1, "num_rows": 8192, "num_blocks": 41943}
    yield Launch(
        ops["qsa"]._store_qsa_rows_kernel,
        store_args,
        {"PAGE_SIZE": PAGE, "WIDTH": INDEX_DIM, "BLOCK_D": 128},
        4,
        tile="BLOCK_D=128 warps=4",
    )


def smaller_tiles(launch: Launch) -> Iterator[dict[str, int]]:
    """Prefill tile changes, least change first: one stage, then half the rows (2 stages, 1), ..."""
    tile_r, stages = launch.extra["TILE_R"], launch.extra["STAGES"]
    yield {"TILE_R": tile_r, "STAGES": 1}
    padded_heads = triton.next_power_of_2(int(launch.heads))
    while (tile_r := tile_r // 2) * padded_heads >= 16:  # tl.dot needs 16 query columns
        yield {"TILE_R": tile_r, "STAGES": stages}
        yield {"TILE_R": tile_r, "STAGES": 1}


def measure(launch: Launch, capability: int, limit: int) -> tuple[str, str, bool]:
    """(shared bytes, fits, compiled) for one target; a compile error is reported, not raised."""
    try:
        shared = shared_bytes(launch, capability)
    except Exception as error:  # e.g. fp8e4nv is not a type on sm_86
        message = str(error).strip().splitlines()[-1].split(". ")[0].split('("')[-1].replace("|", "/")
        return f"does not compile: {message}", "no", False
    over = f" ({shared - limit:+d})" if shared > limit else ""
    return str(shared), ("yes" if shared <= limit else f"no{over}"), True


def rows(ops: dict[str, types.ModuleType]) -> Iterator[tuple[str, Launch, str, str, str]]:
    """Table rows: (kernel, launch, target, shared bytes, fits)."""
    launches: list[tuple[str, Launch]] = []
    for dtype in CACHE_DTYPES:
        launches += [("indexer prefill", prefill(ops, heads, dtype)) for heads in HEADS]
        if dtype == "bf16":
            launches += [("indexer prefill", prefill(ops, 16, dtype, page=page)) for page in (16, 64)]
        launches += [("indexer decode", decode(ops, heads, dtype)) for heads in HEADS]
        for group in HEADS:
            for block_n, warps in ((32, 1), (64, 2)):
                launches.append(("sparse attention", sparse_attention(ops, group, dtype, block_n, warps)))
        launches += [(launch.kernel.__name__, launch) for launch in small_kernels(ops, dtype)]
    for kernel, launch in launches:
        for target, (capability, limit) in TARGETS.items():
            shared, fits, compiled = measure(launch, capability, limit)
            yield kernel, launch, target, shared, fits
            if kernel != "indexer prefill" or launch.extra["page"] != PAGE or fits == "yes" or not compiled:
                continue
            for option in smaller_tiles(launch):
                smaller = prefill(ops, int(launch.heads), launch.dtype, page=launch.extra["page"], **option)
                shared, fits, _ = measure(smaller, capability, limit)
                smaller.tile += " **smallest change that fits**" if fits == "yes" else " (tried)"
                yield kernel, smaller, target, shared, fits
                if fits == "yes":
                    break


def main() -> None:
    ops = load_ops()
    print(
        f"Triton {triton.__version__}; limits: "
        + ", ".join(f"{t} {lim} B" for t, (_, lim) in TARGETS.items())
    )
    print()
    print("| kernel | cache dtype | heads | head_dim | tile settings | target | shared bytes | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for kernel, launch, target, shared, fits in rows(ops):
        cells = (kernel, launch.dtype, launch.heads, launch.head_dim, launch.tile, target, shared, fits)
        print("| " + " | ".join(str(cell) for cell in cells) + " |", flush=True)
    print()
    print(
        "indexer prefill/decode: `qsa_indexer.py` (heads = indexer_n_heads, PAGE = compressed-cache page = "
        f"block_size {BLOCK_SIZE} // ratio {RATIO}); sparse attention: `qsa.py` "
        f"`_qsa_sparse_paged_gqa_splitk_kernel` (heads = query heads per KV head, {MAIN_KV_HEADS} KV heads); "
        "fits: 'no (+N)' = N bytes over the target's limit."
    )


# --- the product's choices on an RTX 3090 ----------------------------------------------------------

SM86 = 86
SM86_LIMIT = 101376
# The real model per rank (deploy/qwen4-exp-config.example.json): query heads per KV head of the main
# attention at TP 1, 2 and 4 (16 query heads, 2 KV heads; KV heads are replicated beyond 2 ranks).
# The 16 index heads are replicated, not split.
GROUP_PER_TP = {1: 8, 2: 8, 4: 4}
INDEX_HEADS = 16


def our_reader(group: int, kv_format: str) -> Launch:
    """Our FP8 QSA reader (``model.kernels.qsa_sparse_attention._sparse_attn_kernel``) as the
    served path launches it at the real head size: E4M3 codes as uint8, fp16 compute, 8 warps."""
    from model.kernels import qsa_sparse_attention as ours

    fmt = ours.KV_FORMATS[kv_format]
    cache = "*u8" if fmt else "*bf16"
    fn = ours._sparse_attn_kernel
    pointers = {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "out_ptr": "*bf16"}
    pointers |= {
        name: "*fp32" for name in ("part_m_ptr", "part_l_ptr", "part_acc_ptr", "k_scale_ptr", "v_scale_ptr")
    }
    args: dict[str, Any] = {}
    for name in fn.arg_names:
        if name.isupper():
            continue
        if name.endswith("_ptr"):
            args[name] = pointers.get(name, "*i32")
        elif name in ("qk_scale", "out_scale"):
            args[name] = 0.0625
        else:
            args[name] = 4096 + 16 * len(args)  # strides and sizes: large multiples of 16
    block_n = ours._default_block_n(MAIN_DIM)
    constexprs = {"GROUP": group, "BLOCK_G": max(16, triton.next_power_of_2(group)), "HEAD_DIM": MAIN_DIM}
    constexprs |= {"BLOCK_N": block_n, "NUM_SPLITS": 4, "KV_FORMAT": fmt}
    constexprs |= {"COMPUTE": tl.float16 if fmt else tl.bfloat16, "K_SCALE_FROM_PTR": False}
    constexprs |= {"V_SCALE_FROM_PTR": False, "FP32_DOT": False}
    return Launch(fn, args, constexprs, 8, num_stages=2, dtype=kv_format, heads=f"{group} per KV head",
                  head_dim=MAIN_DIM, tile=f"BLOCK_N={block_n} NUM_SPLITS=4 stages=2 warps=8")  # fmt: skip


HIDDEN, HC_COUNT, HC_LOWRANK = 2048, 4, 320  # the real model's hyper-connections


def generic(fn: Any, constexprs: dict[str, Any], warps: int = 4, tile: str = "") -> Launch:
    """A launch whose pointers are bf16 tensors and whose other runtime arguments are strides of
    the real hyper-connection width (what upstream's HC launchers pass)."""
    args = {
        n: ("*bf16" if n.endswith("_ptr") else HIDDEN * HC_COUNT) for n in fn.arg_names if n not in constexprs
    }
    return Launch(fn, args, constexprs, warps, heads="-", head_dim=HIDDEN, tile=tile or "launcher defaults")


def hc_launches(ops: dict[str, types.ModuleType]) -> Iterator[tuple[str, Launch]]:
    """Upstream's hyper-connection kernels at the real width (4 streams of 2048), as on sm_86 (no PDL)."""
    hc = ops["hc"]
    dim = HIDDEN * HC_COUNT
    base = {"launch_pdl": False}
    yield (
        "hc grouped norm",
        generic(
            hc._grouped_gemma_rmsnorm_kernel,
            base | {"DIM": dim, "NUM_GROUPS": HC_COUNT, "W_SHARED": False, "EPS": 1e-6},
        ),
    )
    yield "hc silu", generic(hc._hc_silu_kernel, base | {"DIM": HC_LOWRANK, "HC": HC_COUNT})
    yield (
        "hc gate mix",
        generic(hc._hc_gate_mix_kernel, base | {"DIM": dim, "HC": HC_COUNT, "BLOCK_SIZE": 512}),
    )
    yield (
        "hc combine",
        generic(hc._hc_combine_kernel, base | {"HC_DIM": HIDDEN, "HC": HC_COUNT, "BLOCK_SIZE": 512}),
    )
    yield (
        "hc combine+norm",
        generic(
            hc._hc_combine_norm_kernel,
            base | {"HC_DIM": HIDDEN, "HC": HC_COUNT, "W_SHARED": False, "EPS": 1e-6, "BLOCK_SIZE": 512},
        ),
    )


def product_launches(ops: dict[str, types.ModuleType]) -> Iterator[tuple[str, Launch]]:
    """Every QSA Triton kernel the served path launches on a 3090 for the real model, with the tiles
    the product picks there (the indexer prefill tile from ``upstream_indexer_tiles``). The FP8 main
    cache is read by our kernel; upstream's FP8 kernels are not launched below sm_89."""
    from model.vllm_adapter.upstream_indexer_tiles import prefill_tile

    rows, stages, warps = prefill_tile(
        INDEX_HEADS, INDEX_DIM, fp8=False, shared_limit=SM86_LIMIT, capability=SM86
    )
    yield "indexer prefill", prefill(ops, INDEX_HEADS, "bf16", TILE_R=rows, STAGES=stages, warps=warps)
    yield "indexer decode", decode(ops, INDEX_HEADS, "bf16")
    for tp, group in GROUP_PER_TP.items():
        for block_n, w in ((32, 1), (64, 2)):
            yield f"sparse attention TP={tp}", sparse_attention(ops, group, "bf16", block_n, w)
        for kv_format in ("bf16", "fp8_e4m3"):
            yield f"our reader TP={tp}", our_reader(group, kv_format)
    for launch in small_kernels(ops, "bf16"):
        yield launch.kernel.__name__, launch
    yield from hc_launches(ops)


def check_product() -> list[dict[str, Any]]:
    """Compile :func:`product_launches` for sm_86: shared bytes, registers, spills, FP8 types."""
    import re

    ops = load_ops()
    found = []
    for name, launch in product_launches(ops):
        compiled = compile_launch(launch, SM86)
        report = ptxas_report(compiled, SM86)
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
        registers = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
        text = compiled.asm["ttgir"] + compiled.asm["ptx"]
        found.append(
            dict(
                kernel=name,
                cache=launch.dtype,
                tile=launch.tile,
                shared=int(compiled.metadata.shared),
                registers=max(registers, default=0),
                spill_bytes=sum(spills),
                fp8_types=sorted(set(re.findall(r"f8E4M3\w*|f8E5M2\w*|\.e4m3\w*|\.e5m2\w*", text))),
            )
        )
    return found


if __name__ == "__main__" and sys.argv[1:] == ["--product"]:
    import json

    print(json.dumps(check_product()))
    sys.exit(0)


if __name__ == "__main__":
    main()
