"""Compile the served path's Triton kernels (vLLM's Qwen4-Exp QSA and others) for sm_86 and sm_90, no GPU.

Upstream's kernels keep tiles of their operands in shared memory, so whether they launch on a card
depends on the shapes and tiles: the indexer prefill kernel's query tile is TILE_R rows x every index
head x the head dim (286,720 bytes for 16 heads at TILE_R=64 on sm_86, where an RTX 3090 allows
101,376 per block). This module compiles the kernels ahead of time (``triton.compile`` on an
``ASTSource`` for a ``GPUTarget``; ptxas ships in Triton's wheel) with the constexprs, warps and
stages the launchers pass, and reads the compiled kernel's ``metadata.shared``; ``ptxas_report``
runs ptxas on the PTX for registers and spills. Scalar arguments get the specialisation Triton gives
them at launch (multiple of 16 -> divisibility hint, 1 -> constant), which changes the result.

The Gated DeltaNet (FLA), fused-MoE and PLE kernels of the served path are compiled the same way
with the arguments their own launchers pass, recorded by running the launchers on CPU tensors
(:func:`captured`, :func:`served_extra`); an autotuned kernel gives one launch per config.

``tests/kernels/test_sm86_compile.py`` checks the product's choices with it. As a script it prints
the whole study (every head count, both cache dtypes, both targets; the smallest tile change that
fits where the launcher's tile does not): ``.venv/bin/python -m tests.kernels.sm86_compile``.
"""

from __future__ import annotations

import functools
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
    # The rest of the real package's names (FLA's ``op.py`` takes ``tldevice``; others gluon).
    import triton.language.extra.libdevice as tldevice
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.core import _aggregate

    stub.__dict__.update(tldevice=tldevice, gluon=gluon, gl=gl, aggregate=_aggregate)
    stub.__dict__.update(LOG2E=1.4426950408889634, LOGE2=0.6931471805599453)
    stub.use_tensor_descriptor = importlib.import_module(
        "vllm.triton_utils.tensor_descriptor"
    ).use_tensor_descriptor
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
    unaligned: frozenset[str] = frozenset()  # tensors whose address is not a multiple of 16 bytes


def shared_bytes(launch: Launch, capability: int) -> int:
    """Compile ``launch`` for ``sm_<capability>`` and return its static + dynamic shared memory."""
    return compile_launch(launch, capability).metadata.shared


def compile_launch(launch: Launch, capability: int):
    """``launch`` compiled for ``sm_<capability>`` (Triton's CompiledKernel: metadata, asm)."""
    fn = launch.kernel
    constexprs = dict(launch.constexprs)
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params, strict=True)):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = launch.args[name]
        specialize = not param.do_not_specialize
        align = not param.do_not_specialize_on_alignment
        if isinstance(value, str):  # a tensor: torch allocations are 16-byte aligned
            signature[name] = value
            if name not in launch.unaligned:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "u1"  # what Triton gives a bool at launch
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif specialize and value == 1:  # Triton turns an integer 1 into a constant
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if specialize and align and value % 16 == 0:
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
    from model.upstream import hc_mix  # ours, replacing the gate mix on the served path

    yield (
        "hc gate mix (reference rounding, ours)",
        generic(hc_mix._gate_mix_kernel, {"HC_DIM": HIDDEN, "HC": HC_COUNT, "BLOCK": hc_mix.BLOCK_SIZE}),
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
    the product picks there (the indexer prefill tile from ``model.upstream.indexer_tiles``). The FP8 main
    cache is read by our kernel; upstream's FP8 kernels are not launched below sm_89."""
    from model.deployment.indexer_tile_fit import prefill_tile

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


# --- Gated DeltaNet, MoE and PLE kernels: arguments captured from upstream's own launchers --------
#
# These kernels take many tensors whose dtypes, strides and flags their Python launchers derive; the
# launch is reproduced by running the launcher itself on CPU tensors (``meta`` ones for the expert
# weights) with Triton's launch replaced by a recorder, so the compiled kernel sees what a 3090 run
# would pass. What a launcher reads from the device is pinned to an RTX 3090 (82 SMs, 101,376 bytes
# of shared memory per block, no PDL below sm_90, no tuned fused-MoE table for its name).

GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_HEAD_DIM, GDN_CONV_WIDTH = 16, 32, 128, 4  # linear_* in the config
MOE_EXPERTS, MOE_TOPK, MOE_INTERMEDIATE = 512, 10, 512  # num_experts, per token, moe_intermediate_size
MOE_BATCHES = (1, 16, 64, 256, 2048)  # tokens in a step: the default config's tile depends on it
RTX_3090_SMS = 82
RTX_3090_MOE_NAME = "NVIDIA_GeForce_RTX_3090"  # vLLM's device name in its tuned-config file names
PREFILL_TOKENS = 2048  # one sequence for the chunked GDN prefill: tiles do not depend on the length
SHORT_PREFILL_TOKENS = 48  # below one FLA chunk: the recurrent kernels (model/upstream/gdn.py)
DECODE_BATCH = 16
TP_SIZES = (1, 2, 4)
TORCH_TO_TRITON = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.uint8": "u8",
    "torch.int8": "i8",
    "torch.bool": "i1",
}


class Launched(Exception):
    """Raised instead of a launch: the kernel, every argument the launcher passed (positional ones by
    name, heuristics applied) and, for an ``@triton.autotune`` kernel, its list of configs."""

    def __init__(self, fn: Any, args: dict[str, Any], configs: list[Any] | None) -> None:
        super().__init__(getattr(fn, "__name__", str(fn)))
        self.fn, self.values, self.configs = fn, args, configs


def captured(call: Any, index: int = 0) -> Launched:
    """Launch number ``index`` (from 0) that ``call()`` makes, recorded; none of them runs."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    seen = 0

    def record(launched: Launched) -> None:
        nonlocal seen
        seen += 1
        if seen > index:
            raise launched

    def jit_run(self, *args, **kwargs):
        record(Launched(self, {**dict(zip(self.arg_names, args, strict=False)), **kwargs}, None))

    def tuned_run(self, *args, **kwargs):
        fn, values = self.fn, {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        while isinstance(fn, Heuristics):  # heuristics below the autotuner (outside it they ran)
            values |= {name: rule(values) for name, rule in fn.values.items()}
            fn = fn.fn
        record(Launched(fn, values, list(self.configs)))

    saved = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = jit_run, tuned_run
    try:
        call()
    except Launched as launched:
        return launched
    finally:
        JITFunction.run, Autotuner.run = saved
    raise AssertionError(f"{call} launched no Triton kernel")


def tile_text(constexprs: dict[str, Any], warps: int, stages: int) -> str:
    """The block sizes among ``constexprs`` (BK, BV, BLOCK_SIZE_M, ROWS_PER_BLOCK, ...) and warps/stages."""
    import re

    pattern = r"B[A-Z]{1,2}|BLOCK\w*|\w+_BLOCK\w*|GROUP_SIZE_M|NB"
    tiles = [
        f"{k}={v}"
        for k, v in constexprs.items()
        if re.fullmatch(pattern, k) and isinstance(v, int) and not isinstance(v, bool)
    ]
    return " ".join([*tiles, f"warps={warps}", f"stages={stages}"])


def launches_of(launched: Launched, shape: str) -> list[Launch]:
    """``Launch`` objects for a recorded launch: one, or one per autotune config (in list order)."""
    import torch

    fn, values = launched.fn, dict(launched.values)
    options = {k: values.pop(k) for k in list(values) if k not in fn.arg_names}  # grid, warps, pdl...
    args: dict[str, Any] = {}
    constexprs: dict[str, Any] = {}
    unaligned = set()
    for param in fn.params:
        value = values[param.name] if param.name in values else param.default
        if param.name == "launch_pdl":  # a kernel parameter in some of upstream's kernels
            value = False  # programmatic dependent launch needs sm_90
        if param.is_constexpr or value is None:
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            args[param.name] = "*" + TORCH_TO_TRITON[str(value.dtype)]
            if value.storage_offset() * value.element_size() % 16:
                unaligned.add(param.name)
        else:
            args[param.name] = value
    common = dict(dtype="bf16", heads=shape, head_dim=0, unaligned=frozenset(unaligned))
    if launched.configs is None:
        warps, stages = options.get("num_warps", 4), options.get("num_stages", 3)
        return [
            Launch(fn, args, constexprs, warps, stages, tile=tile_text(constexprs, warps, stages), **common)
        ]
    out = []
    for config in launched.configs:
        tuned = constexprs | config.kwargs
        warps, stages = config.num_warps, config.num_stages
        out.append(Launch(fn, args, tuned, warps, stages, tile=tile_text(tuned, warps, stages), **common))
    return out


@dataclass
class Served:
    """A kernel of the served path at one shape: its launch, or every config its autotuner tries."""

    kernel: str
    shape: str
    launches: list[Launch]
    tuned: bool = False  # an autotune list: one fitting config is enough on a 3090
    skipped: str = ""  # why it is not compiled (then ``launches`` is empty)


def triton_causal_conv1d() -> types.ModuleType:
    """vLLM's ``causal_conv1d`` module as a CUDA platform loads it: on a CPU platform its last lines
    rebind ``causal_conv1d_fn``/``_update`` to CPU versions, so a second copy of the file is loaded
    with ``is_cpu`` answering False (the Triton launchers otherwise read nothing of the platform but
    ``is_arch_support_pdl``, False below sm_90)."""
    import importlib.util

    from vllm.platforms import current_platform

    name = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
    path = importlib.util.find_spec(name).origin
    spec = importlib.util.spec_from_file_location(name + "_sm86_compile", path)
    module = importlib.util.module_from_spec(spec)
    saved = current_platform.is_cpu
    current_platform.is_cpu = lambda: False
    try:
        spec.loader.exec_module(module)
    finally:
        current_platform.is_cpu = saved
    module.current_platform = types.SimpleNamespace(is_arch_support_pdl=lambda: False)
    return module


def gdn_served(tp: int, autotuned: bool = True) -> Iterator[Served]:
    """The Triton kernels of vLLM's Gated DeltaNet layer (``qwen_gdn_linear_attn.py``) on the sm_86
    path (``gdn_prefill_backend=triton``, packed recurrent decode on, no speculative decoding) at the
    real per-rank head counts, plus the recurrent kernels our short prefills call. ``autotuned``:
    include the ``@triton.autotune`` kernels (every config of their lists)."""
    import torch
    from vllm.model_executor.layers.mamba import mamba_utils

    conv = triton_causal_conv1d()
    from vllm.third_party.flash_linear_attention.ops import chunk, fused_recurrent, l2norm, layernorm_guard
    from vllm.third_party.flash_linear_attention.ops import solve_tril as tril
    from vllm.third_party.flash_linear_attention.ops.fused_gdn_prefill_post_conv import fused_post_conv_prep
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )
    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices, prepare_chunk_offsets

    H, HV, D = GDN_KEY_HEADS // tp, GDN_VALUE_HEADS // tp, GDN_HEAD_DIM
    qkv, z_dim = (2 * H + HV) * D, HV * D
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    heads = f"TP={tp}: {H} key / {HV} value heads of {D}"
    slots = 64
    ssm_state = torch.empty(slots, HV, D, D, dtype=bf)  # mamba_ssm_cache_dtype auto: the model's bf16
    if mamba_utils.is_conv_state_dim_first():
        conv_state = torch.empty(slots, qkv, GDN_CONV_WIDTH - 1, dtype=bf)
    else:  # vLLM keeps (state_len, dim) and hands the kernels the transposed view
        conv_state = torch.empty(slots, GDN_CONV_WIDTH - 1, qkv, dtype=bf).transpose(-1, -2)
    conv_weight = torch.empty(qkv, GDN_CONV_WIDTH, dtype=bf)
    A_log, dt_bias = torch.empty(HV, dtype=f32), torch.empty(HV, dtype=bf)

    def step(tokens: int):
        qkvz = torch.empty(tokens, qkv + z_dim, dtype=bf)  # in_proj output; mixed_qkv is its slice
        return qkvz[:, :qkv], torch.empty(tokens, HV, dtype=bf), torch.empty(tokens, HV, dtype=bf)

    def one(name: str, shape: str, call: Any) -> Served:
        launched = captured(call)
        tuned = launched.configs is not None
        return Served(
            name, shape, launches_of(launched, shape) if autotuned or not tuned else [], tuned=tuned
        )

    # Prefill: causal conv, post-conv prep, FLA's chunked delta rule.
    T = PREFILL_TOKENS
    mixed, a, b = step(T)
    cu = torch.tensor([0, T], dtype=i32)
    shape = f"{heads}; prefill {T} tokens"
    yield one(
        "gdn causal_conv1d_fn", shape,
        lambda: conv.causal_conv1d_fn(
            mixed.transpose(0, 1), conv_weight, None, conv_states=conv_state, query_start_loc=cu,
            cache_indices=torch.ones(1, dtype=i32), has_initial_state=torch.zeros(1, dtype=torch.bool),
            activation="silu",
        ),
    )  # fmt: skip
    conv_out = torch.empty(T, qkv, dtype=bf)
    yield one(
        "gdn fused_post_conv_prep", shape,
        lambda: fused_post_conv_prep(conv_out, a, b, A_log, dt_bias, H, D, D, apply_l2norm=True),
    )  # fmt: skip
    q, k = torch.empty(1, T, H, D, dtype=bf), torch.empty(1, T, H, D, dtype=bf)
    v, g, beta = (
        torch.empty(1, T, HV, D, dtype=bf),
        torch.empty(1, T, HV, dtype=f32),
        torch.empty(1, T, HV, dtype=f32),
    )
    BT = 64
    chunks = prepare_chunk_indices(cu, BT)
    offsets = prepare_chunk_offsets(cu, BT)
    yield one(
        "gdn chunk_local_cumsum",
        shape,
        lambda: chunk.chunk_local_cumsum(g, chunk_size=BT, cu_seqlens=cu, chunk_indices=chunks),
    )
    yield one(
        "gdn chunk_scaled_dot_kkt", shape,
        lambda: chunk.chunk_scaled_dot_kkt_fwd(k=k, beta=beta, g=g, cu_seqlens=cu, chunk_indices=chunks, output_dtype=f32),
    )  # fmt: skip
    A = torch.empty(1, T, HV, BT, dtype=f32)
    yield one("gdn solve_tril", shape, lambda: tril.solve_tril.__wrapped__(A, cu, chunks, output_dtype=bf))
    Ai = torch.empty(1, T, HV, BT, dtype=bf)
    yield one(
        "gdn recompute_w_u", shape,
        lambda: chunk.recompute_w_u_fwd(k=k, v=v, beta=beta, A=Ai, g_cumsum=g, cu_seqlens=cu, chunk_indices=chunks),
    )  # fmt: skip
    w, u = torch.empty(1, T, HV, D, dtype=bf), torch.empty(1, T, HV, D, dtype=bf)
    yield one(
        "gdn chunk_gated_delta_rule_fwd_h", shape,
        lambda: chunk.chunk_gated_delta_rule_fwd_h(
            k=k, w=w, u=u, g=g, initial_state=ssm_state[:1], output_final_state=True, cu_seqlens=cu,
            chunk_indices=chunks, chunk_offsets=offsets,
        ),
    )  # fmt: skip
    h = torch.empty(1, len(chunks), HV, D, D, dtype=bf)
    yield one(
        "gdn chunk_fwd_o", shape,
        lambda: chunk.chunk_fwd_o(q=q, k=k, v=u, h=h, g=g, scale=D**-0.5, cu_seqlens=cu, chunk_indices=chunks),
    )  # fmt: skip
    # Not launched on this path (upstream normalises in fused_post_conv_prep and passes
    # use_qk_l2norm_in_kernel=False); FLA's chunked call would launch it with the flag set.
    yield one("gdn l2norm (not launched)", shape, lambda: l2norm.l2norm_fwd(q))

    # Short prefills (< one chunk) and decodes: the recurrent kernels.
    S = SHORT_PREFILL_TOKENS
    shape = f"{heads}; short prefill {S} tokens"
    qs, ks = torch.empty(1, S, H, D, dtype=bf), torch.empty(1, S, H, D, dtype=bf)
    vs, gs, bs = (
        torch.empty(1, S, HV, D, dtype=bf),
        torch.empty(1, S, HV, dtype=f32),
        torch.empty(1, S, HV, dtype=f32),
    )
    yield one(
        "gdn fused_recurrent_gated_delta_rule_fwd", shape,
        lambda: fused_recurrent.fused_recurrent_gated_delta_rule_fwd(
            qs, ks, vs, gs, bs, scale=D**-0.5, initial_state=torch.empty(2, HV, D, D, dtype=bf),
            inplace_final_state=True, cu_seqlens=torch.tensor([0, S], dtype=i32),
            ssm_state_indices=torch.ones(1, S, dtype=i32), num_accepted_tokens=None,
            use_qk_l2norm_in_kernel=False,
        ),
    )  # fmt: skip
    _, sa, sb = step(S)
    yield one(
        "gdn fused_sigmoid_gating_delta_rule_update", shape,
        lambda: fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=sa, b=sb, dt_bias=dt_bias, q=qs, k=ks, v=vs, initial_state=ssm_state,
            inplace_final_state=True, cu_seqlens=torch.tensor([0, S], dtype=i32),
            ssm_state_indices=torch.ones(1, S, dtype=i32), use_qk_l2norm_in_kernel=True,
        ),
    )  # fmt: skip
    B = DECODE_BATCH
    shape = f"{heads}; decode batch {B}"
    dmixed, da, db = step(B)
    yield one(
        "gdn causal_conv1d_update", shape,
        lambda: conv.causal_conv1d_update(
            dmixed, conv_state, conv_weight, None, "silu", conv_state_indices=torch.arange(B, dtype=i32),
        ),
    )  # fmt: skip
    core = torch.empty(B, HV, D, dtype=bf)
    yield one(
        "gdn fused_recurrent_packed_decode", shape,
        lambda: fused_recurrent.fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=torch.empty(B, qkv, dtype=bf), a=da, b=db, A_log=A_log, dt_bias=dt_bias,
            scale=D**-0.5, initial_state=ssm_state, out=core.unsqueeze(1),
            ssm_state_indices=torch.arange(B, dtype=i32), use_qk_l2norm_in_kernel=True,
        ),
    )  # fmt: skip
    # Mixed decode + prefill steps run the decodes through the gating kernel (decode shape).
    dq, dk = torch.empty(1, B, H, D, dtype=bf), torch.empty(1, B, H, D, dtype=bf)
    yield one(
        "gdn fused_sigmoid_gating_delta_rule_update", shape,
        lambda: fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=da, b=db, dt_bias=dt_bias, q=dq, k=dk, v=torch.empty(1, B, HV, D, dtype=bf),
            initial_state=ssm_state, inplace_final_state=True, cu_seqlens=torch.arange(B + 1, dtype=i32),
            ssm_state_indices=torch.arange(B, dtype=i32), use_qk_l2norm_in_kernel=True,
        ),
    )  # fmt: skip

    # Output norm: RMSNormGated (norm before a silu gate, per value head of 128). Rows per program
    # depend on the row count (tokens x value heads) and the SM count: 1 at a decode, 4 at a prefill.
    weight = torch.empty(D, dtype=bf)
    saved = layernorm_guard.num_compute_units
    layernorm_guard.num_compute_units = lambda index=None: RTX_3090_SMS
    try:
        for tokens in (DECODE_BATCH, PREFILL_TOKENS):
            x, z = torch.empty(tokens, HV, D, dtype=bf), torch.empty(tokens, HV, D, dtype=bf)
            yield one(
                "gdn gated RMSNorm (layer_norm_fwd_kernel)", f"{heads}; {tokens} tokens",
                lambda x=x, z=z: layernorm_guard.rmsnorm_fn(
                    x, weight, None, z=z, eps=1e-6, group_size=None, norm_before_gate=True, activation="silu"
                ),
            )  # fmt: skip
    finally:
        layernorm_guard.num_compute_units = saved


def moe_rank_shape(tp: int, expert_parallel: bool) -> tuple[int, int]:
    """(experts, expert width) one rank holds: with expert parallelism a 1/tp share of the experts at
    full width, else every expert at 1/tp of its width (``QWEN4EXP_EXPERT_PARALLEL``)."""
    if expert_parallel:
        return MOE_EXPERTS // tp, MOE_INTERMEDIATE
    return MOE_EXPERTS, MOE_INTERMEDIATE // tp


def moe_config_on_3090(tp: int, tokens: int, expert_parallel: bool = False) -> dict[str, int]:
    """The fused-MoE config vLLM picks for bf16 experts on an RTX 3090: it looks for a tuned table
    named after the device (none ships for ``NVIDIA_GeForce_RTX_3090``) and else takes
    ``get_default_config``; reproduced by naming the device so and asking ``try_get_optimal_moe_config``."""
    from vllm.model_executor.layers.fused_moe import fused_moe

    experts, n = moe_rank_shape(tp, expert_parallel)
    saved = fused_moe.get_device_name_as_file_name
    fused_moe.get_device_name_as_file_name = lambda: RTX_3090_MOE_NAME
    fused_moe.get_moe_configs.cache_clear()
    try:
        w1, w2 = (experts, 2 * n, HIDDEN), (experts, HIDDEN, n)
        name = fused_moe.get_config_file_name(experts, n, None)
        assert RTX_3090_MOE_NAME in name and fused_moe.get_moe_configs(experts, n, None) is None, name
        return fused_moe.try_get_optimal_moe_config(w1, w2, MOE_TOPK, None, tokens)
    finally:
        fused_moe.get_device_name_as_file_name = saved
        fused_moe.get_moe_configs.cache_clear()


def moe_served(tp: int, expert_parallel: bool = False) -> Iterator[Served]:
    """vLLM's Triton ``fused_moe_kernel`` for bf16 experts (both GEMMs of ``fused_experts_impl``) at
    the real per-rank shapes, with the config a 3090 gets at each batch size. With expert
    parallelism a rank runs its own experts at full width on every token of the step (tokens routed
    elsewhere take no tile: their ids are -1 in the rank's expert map)."""
    import torch
    from triton import language as tlang
    from vllm.model_executor.layers.fused_moe import fused_moe

    experts, n = moe_rank_shape(tp, expert_parallel)
    bf, i32 = torch.bfloat16, torch.int32
    w1 = torch.empty(experts, 2 * n, HIDDEN, dtype=bf, device="meta")
    w2 = torch.empty(experts, HIDDEN, n, dtype=bf, device="meta")
    layout = f"EP={tp}: {experts} experts" if expert_parallel else f"TP={tp}: {experts} experts"
    for tokens in MOE_BATCHES:
        config = moe_config_on_3090(tp, tokens, expert_parallel)
        padded = tokens * MOE_TOPK + experts * (config["BLOCK_SIZE_M"] - 1)
        sorted_ids = torch.empty(padded, dtype=i32, device="meta")
        expert_ids = torch.empty(triton.cdiv(padded, config["BLOCK_SIZE_M"]), dtype=i32, device="meta")
        post_padded = torch.empty(1, dtype=i32, device="meta")
        weights = torch.empty(tokens, MOE_TOPK, dtype=torch.float32, device="meta")
        cache1 = torch.empty(tokens, MOE_TOPK, 2 * n, dtype=bf, device="meta")
        cache3 = torch.empty(tokens, MOE_TOPK, HIDDEN, dtype=bf, device="meta")
        for gemm, a, w, c, routed, top_k in (
            ("w13", torch.empty(tokens, HIDDEN, dtype=bf, device="meta"), w1, cache1, False, MOE_TOPK),
            ("w2", torch.empty(tokens * MOE_TOPK, n, dtype=bf, device="meta"), w2, cache3, True, 1),
        ):
            shape = f"{layout}, {gemm} {tuple(w.shape[1:])}, {tokens} tokens"
            launched = captured(
                functools.partial(
                    fused_moe.invoke_fused_moe_triton_kernel,
                    a, w, c, None, None, weights, sorted_ids, expert_ids, post_padded, routed, top_k,
                    dict(config), tlang.bfloat16, False, False, False, False, False,
                )  # A, B, C, scales, routing, flags fp8/int8/w8a16/w4a16/per-channel all off
            )  # fmt: skip
            yield Served(f"fused_moe_kernel {gemm}", shape, launches_of(launched, shape))


PLE_CHANNELS = HC_COUNT * HIDDEN  # the PLE layer's gate and short convolution run on 4 x 2048
PLE_CONV_KERNEL, PLE_DILATION = 4, 3  # ple_conv_kernel_size; ngram_size is the dilation
PLE_ROW_DIM = 128  # one table row: ple_embed_dim 2048 over (ngram_size - 1) x heads_per_ngram = 16


def ple_served() -> Iterator[Served]:
    """Upstream's PLE Triton kernels (``vllm/models/qwen4_exp/common/ops/ple.py``: n-gram ids, gate,
    dilated short conv at a decode and a prefill with its state write-back; the pinned-table row copy
    of ``common/ngram_embedding.py``) and our PLE gather (``model/ple/gather_kernel.py``, bf16, FP8
    and NVFP4 rows dequantised to bf16). None of them depends on the TP size (PLE is replicated)."""
    from vllm.models.qwen4_exp.common import ngram_embedding
    from vllm.models.qwen4_exp.common.ops import ple

    from model.ple import gather_kernel as ours

    platform = ple.current_platform
    ple.current_platform = types.SimpleNamespace(is_arch_support_pdl=lambda: False)  # sm_86: no PDL
    try:
        yield from _ple_launches(ple, ngram_embedding, ours)
    finally:
        ple.current_platform = platform


def _ple_launches(ple: Any, ngram_embedding: Any, ours: Any) -> Iterator[Served]:
    import torch

    bf, i32, i64 = torch.bfloat16, torch.int32, torch.int64
    T, reqs, heads_per_ngram, context = PREFILL_TOKENS, 4, 8, 2

    def one(name: str, shape: str, call: Any, index: int = 0) -> Served:
        return Served(name, shape, launches_of(captured(call, index), shape))

    yield one(
        "ple ngram ids", f"{T} tokens, {context} x {heads_per_ngram} n-gram heads",
        lambda: ple.ple_ngram_ids(
            torch.empty(T, dtype=i32), torch.tensor([0, 1, 2, 3, T], dtype=i32),
            torch.empty(reqs, context, dtype=i32), torch.empty(context * heads_per_ngram, dtype=i64),
            torch.empty(context * heads_per_ngram, dtype=i64), torch.empty(context * heads_per_ngram, dtype=i64),
            eos_token_id=0, heads_per_ngram=heads_per_ngram,
        ),
    )  # fmt: skip
    kv = torch.empty(T, PLE_CHANNELS + HIDDEN, dtype=bf)  # kv_proj output: [key (4 x 2048), value]
    norm = torch.empty(PLE_CHANNELS, dtype=bf)
    yield one(
        "ple gate", f"{T} tokens, {HC_COUNT} x {HIDDEN}",
        lambda: ple._ple_gate(
            kv[:, :PLE_CHANNELS], kv[:, PLE_CHANNELS:], torch.empty(T, PLE_CHANNELS, dtype=bf), norm, norm, norm,
            1e-6,
        ),
    )  # fmt: skip
    state_len = (PLE_CONV_KERNEL - 1) * PLE_DILATION
    state = torch.empty(64, PLE_CHANNELS, state_len, dtype=bf)
    weights = torch.empty(PLE_CHANNELS, PLE_CONV_KERNEL, dtype=bf)
    for mode, tokens in (("decode", DECODE_BATCH), ("prefill", T)):
        x, residual = torch.empty(tokens, PLE_CHANNELS, dtype=bf), torch.empty(tokens, PLE_CHANNELS, dtype=bf)
        nreq = tokens if mode == "decode" else reqs
        extra = {} if mode == "decode" else {"query_start_loc": torch.tensor([0, 1, 2, 3, T], dtype=i32)}

        def conv(x=x, residual=residual, nreq=nreq, mode=mode, extra=extra):
            ple.ple_conv(
                x, residual, state, weights, torch.arange(nreq, dtype=i32), torch.empty_like(residual),
                mode=mode, dilation=PLE_DILATION, has_initial_states=torch.ones(nreq, dtype=torch.bool), **extra,
            )  # fmt: skip

        shape = f"{mode} {tokens} tokens, {PLE_CHANNELS} channels, kernel {PLE_CONV_KERNEL} dilation {PLE_DILATION}"
        yield one(f"ple conv ({mode})", shape, conv)
        if mode == "prefill":
            yield one("ple conv state write-back", shape, conv, index=1)
    row_bytes = PLE_ROW_DIM * 2  # bf16 rows; our FP8/NVFP4 rows are narrower
    yield Served(
        "ple pinned row copy",
        f"{T * context * heads_per_ngram} rows of {row_bytes} bytes",
        launches_of(
            Launched(
                ngram_embedding._lookup_ple_embedding_from_pinned_kernel,
                dict(weight_ptr=torch.empty(1, dtype=torch.uint8), ids_ptr=torch.empty(1, dtype=i64),
                     output_ptr=torch.empty(1, dtype=torch.uint8), row_bytes=row_bytes, tp_vocab_start=0,
                     tp_vocab_end=2**31 - 1, BLOCK_D=triton.next_power_of_2(row_bytes)),
                None,
            ),
            f"{row_bytes}-byte rows",
        ),
    )  # fmt: skip
    saved = ours._KERNEL_INTERPRETED
    ours._KERNEL_INTERPRETED = True  # lets the launcher take CPU tensors; the kernel stays compiled
    try:
        n = T * context * heads_per_ngram
        for fmt, width in (("bf16", PLE_ROW_DIM), ("fp8_e4m3", PLE_ROW_DIM), ("nvfp4", PLE_ROW_DIM // 2)):
            dtype = bf if fmt == "bf16" else torch.uint8
            data = torch.empty(1024, width, dtype=dtype)
            scales = torch.empty(1024, PLE_ROW_DIM // 16, dtype=torch.uint8) if fmt == "nvfp4" else None
            out = torch.empty(n, PLE_ROW_DIM, dtype=bf)
            yield one(
                f"our ple_gather ({fmt})", f"{n} rows of {PLE_ROW_DIM}",
                lambda data=data, scales=scales, out=out, fmt=fmt: ours.ple_gather(
                    fmt, data, torch.empty(n, dtype=i64), 0, out, block_scales=scales
                ),
            )  # fmt: skip
    finally:
        ours._KERNEL_INTERPRETED = saved


# The FLA autotune lists are compiled at one TP size: the head counts only enter index arithmetic
# and grids, and all three sizes gave the same bytes, registers and spills for every config
# (``python -m tests.kernels.sm86_compile --product --all-tp`` compiles them at each).
TUNED_TP = 4


def served_extra(all_tp: bool = False) -> Iterator[Served]:
    """Every GDN, MoE and PLE kernel of :func:`gdn_served`, :func:`moe_served` and :func:`ple_served`."""
    for tp in TP_SIZES:
        yield from (s for s in gdn_served(tp, autotuned=all_tp or tp == TUNED_TP) if s.launches)
    for tp in TP_SIZES:
        yield from moe_served(tp)
    for tp in (t for t in TP_SIZES if t > 1):  # expert parallelism: whole experts per rank
        yield from moe_served(tp, expert_parallel=True)
    yield Served(
        "int4 experts (Marlin)", "-", [], skipped="CUDA C++ (Marlin), not Triton: nothing to compile"
    )
    yield from ple_served()


def measure_sm86(launch: Launch) -> dict[str, Any]:
    """``launch`` compiled for sm_86: shared bytes, registers, spill bytes (ptxas) and FP8 types."""
    import re

    compiled = compile_launch(launch, SM86)
    report = ptxas_report(compiled, SM86)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    text = compiled.asm["ttgir"] + compiled.asm["ptx"]
    return dict(
        shared=int(compiled.metadata.shared),
        registers=max(registers, default=0),
        spill_bytes=sum(spills),
        fp8_types=sorted(set(re.findall(r"f8E4M3\w*|f8E5M2\w*|\.e4m3\w*|\.e5m2\w*", text))),
    )


_ITEMS: list[tuple[str, str, str, Launch | None, bool, str]] = []  # read by the forked workers


def _measure_item(index: int) -> dict[str, Any]:
    kernel, cache, shape, launch, tuned, skipped = _ITEMS[index]
    row: dict[str, Any] = dict(kernel=kernel, cache=cache, shape=shape, autotune=tuned, skipped=skipped)
    if launch is None:
        return row | dict(tile="-", shared=0, registers=0, spill_bytes=0, fp8_types=[], fits=None)
    row |= dict(tile=launch.tile) | measure_sm86(launch)
    row["fits"] = row["shared"] <= SM86_LIMIT and row["spill_bytes"] == 0
    return row


def check_product(workers: int | None = None, all_tp: bool = False) -> list[dict[str, Any]]:
    """Compile :func:`product_launches` and :func:`served_extra` for sm_86 (one row per launch, per
    autotune config for a tuned kernel, per skipped kernel with its reason), in ``workers`` forked
    processes (default: one per CPU; compiling is single-threaded)."""
    import multiprocessing

    ops = load_ops()
    _ITEMS.clear()
    for name, launch in product_launches(ops):
        _ITEMS.append((name, launch.dtype, f"heads {launch.heads} x {launch.head_dim}", launch, False, ""))
    for served in served_extra(all_tp):
        if served.skipped:
            _ITEMS.append((served.kernel, "-", served.shape, None, False, served.skipped))
        for launch in served.launches:
            _ITEMS.append((served.kernel, "bf16", served.shape, launch, served.tuned, ""))
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        return [_measure_item(i) for i in range(len(_ITEMS))]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_measure_item, range(len(_ITEMS)), chunksize=1)


if __name__ == "__main__" and sys.argv[1:2] == ["--product"]:
    import json

    print(json.dumps(check_product(all_tp="--all-tp" in sys.argv[2:])))
    sys.exit(0)


if __name__ == "__main__":
    main()
