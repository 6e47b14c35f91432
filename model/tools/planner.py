"""Fit planner: will a Qwen4-Exp checkpoint fit a machine, and how many sequences can it serve?

Usage::

    python -m model.tools.planner deploy/qwen4-exp-config.example.json --gpus 4 --gpu-mem-gib 23.7 \\
        --host-ram-gib 128 --kv-cache-dtype fp8 --expert-weights int4 --seq-len 32768

Why a planner: a 4x RTX 3090 node has 96 GB of GPU memory and the model does not simply "fit or
not". Experts, attention and GDN projections shard across tensor-parallel ranks, but the
hyper-connections, the QSA indexer and the MoE router are replicated on every rank (this is what
``model/ours`` builds), KV heads are replicated once TP exceeds them, the PLE n-gram tables
(~45B parameters) live in pinned host memory sharded by rows (ETP), and vLLM's hybrid KV-cache
manager pads every Mamba-style state to the attention page size. The planner mirrors those rules
so the numbers in ``compose.yaml`` and the Helm chart come from arithmetic, not guesses.

What it mirrors (vLLM 0.32 and this repository's plugin; ``tests/deploy/test_planner_vs_vllm.py``
checks the tiny model against a real engine on the CPU):

* weights: the parameters our vLLM model allocates per rank (vocab-parallel embedding and LM head,
  column/row-parallel GDN, attention and MoE, replicated small modules). The PLE tables are not
  parameters: they are reported separately, as host (pinned) memory.
* KV cache: one paged QSA row per token and QSA layer, ``[K | V | index key]`` for the KV heads this
  rank holds (``max(1, kv_heads // tp)``); FP8 stores K and V as 1-byte codes and keeps the index
  key in the model dtype (``model/ours/qsa_attention.py``).
* per-request state: Gated DeltaNet conv + SSM state per GDN layer (sharded by TP) and the PLE
  token history + dilated-conv state per PLE layer (replicated), each padded to the common page.
* vLLM's block arithmetic: ``Platform._align_hybrid_block_size`` (attention block grown until a
  page holds the largest Mamba state), ``unify_kv_cache_spec_page_size``, the grouping of
  ``_get_kv_cache_groups_uniform_page_size`` (one shared block pool), and
  ``get_max_concurrency_for_kv_cache_config`` (a Mamba group needs 2 blocks per request when
  prefix caching puts it in ``align`` mode, else 1).

Assumptions that are *not* measured on a 3090 are options with documented defaults: the
activation/CUDA-graph reserve per GPU and the host memory of each process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from model.deployment import expert_layout
from model.ple.format import table_format_of
from model.runtime.expert_format import ExpertFormat, checkpoint_expert_format, expert_bytes_per_rank

GIB = 1 << 30
GB = 10**9

# Bytes per element of the dtypes the cache and states use.
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}

# Routed-expert weight formats (model/runtime/expert_format.py): int4 = compressed-tensors W4A16, group 128
# (Marlin W4A16 on sm_86); fp8 = FP8 with 128x128 block scales (W8A16 Marlin: the 3090 has no FP8
# math). A checkpoint's own quantization_config overrides the group/block size.
EXPERT_FORMATS = ("bf16", "fp8", "int4")

# PLE table formats (model/ple/tables.py): bytes per row of ``dim`` values.
PLE_FORMATS = ("bf16", "fp8_e4m3", "nvfp4")
NVFP4_BLOCK = 16

# vLLM's default block size when the user sets none: CacheConfig.DEFAULT_BLOCK_SIZE on CUDA, and
# the CPU platform's default (platforms/cpu.py).
DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 128}
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE for VocabParallelEmbedding/ParallelLMHead


def ssm_state_dtype(
    requested: str, device: str, model_dtype: str = "bf16", cpu_avx512_bf16: bool | None = None
) -> str:
    """The GDN SSM-state dtype vLLM really allocates for ``--mamba-ssm-cache-dtype`` ``requested``.

    ``auto`` means the model dtype, except on vLLM's CPU build on CPUs with AVX512-BF16: there its
    accelerated GDN path resets every SSM cache not explicitly fp16/bf16 to float32
    (``CpuPlatform.check_and_update_config``), which doubles the GDN page and grows the block.
    ``cpu_avx512_bf16=None`` asks this host's CPU, which is right whenever the plan is for here.
    """
    if requested not in ("auto", *DTYPE_BYTES):
        raise ValueError(f"unknown mamba SSM cache dtype {requested!r} (auto, bf16, fp16, fp32)")
    if device == "cpu" and requested in ("auto", "fp32"):
        if cpu_avx512_bf16 is None:
            import torch

            cpu_avx512_bf16 = torch.cpu._is_avx512_bf16_supported()
        if cpu_avx512_bf16:
            return "fp32"
    return model_dtype if requested == "auto" else requested


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shard(n: int, tp: int, what: str) -> int:
    """``n / tp``; vLLM's ``divide`` asserts divisibility, so the planner refuses too."""
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={tp}")
    return n // tp


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


def load_config(path: str | Path):
    """A normalized ``Qwen4ExpTextConfig`` from a checkpoint directory or a config.json file.

    transformers fills the defaults (layer_types from the 4:1 pattern, ple_embed_dim = hidden) and
    validates the architecture, so the planner sees exactly what the engine will see. A
    multimodal ``Qwen4ExpConfig`` file is reduced to its ``text_config``.
    """
    from transformers import Qwen4ExpTextConfig

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    raw: dict[str, Any] = json.loads(p.read_text())
    if "text_config" in raw and isinstance(raw["text_config"], dict):
        raw = raw["text_config"]
    raw = {k: v for k, v in raw.items() if k not in ("transformers_version", "model_type")}
    extra = {k: raw.pop(k) for k in ("ple_embedding_dtype", "quantization_config") if k in raw}
    config = Qwen4ExpTextConfig(**raw)
    for k, v in extra.items():
        setattr(config, k, v)
    return config


# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------


@dataclass
class WeightPart:
    name: str
    params_per_rank: int
    bytes_per_rank: int
    sharding: str


def weights_per_rank(
    config, tp: int, expert_format: str | ExpertFormat = "bf16", *, expert_parallel: bool = False
) -> list[WeightPart]:
    """The parameters one tensor-parallel rank allocates, by part (dense parts in bf16).

    ``expert_parallel`` (vLLM's ``--enable-expert-parallel``): each rank holds ``num_experts / tp``
    whole routed experts instead of a ``1 / tp`` slice of every expert's intermediate width. The
    bytes are the same up to the int4 scales' rounding; what changes is the matrices each MoE kernel
    sees (a 3090's Marlin tiles need the per-rank widths to divide, checked by the planner)."""
    fmt = expert_format if isinstance(expert_format, ExpertFormat) else ExpertFormat(expert_format)
    c = config
    H = c.hidden_size
    hc = c.hc_count
    width = hc * H
    types = list(c.layer_types)
    n_gdn = types.count("linear_attention")
    n_qsa = len(types) - n_gdn
    n_layers = len(types)
    n_ple = len(c.ple_layer_ids)
    bf = 2
    parts: list[WeightPart] = []

    def add(name: str, params: int, sharding: str, nbytes: int | None = None) -> None:
        parts.append(WeightPart(name, params, bf * params if nbytes is None else nbytes, sharding))

    vocab = cdiv(c.vocab_size, VOCAB_PADDING) * VOCAB_PADDING
    vocab_rank = shard(vocab, tp, "padded vocab")
    heads = 1 if c.tie_word_embeddings else 2
    add("embed_tokens + lm_head", heads * vocab_rank * H, "vocab-parallel")

    # Gated DeltaNet (vLLM's QwenGatedDeltaNetAttention): everything column/row parallel except
    # the per-head-dim norm; A_log is fp32.
    nk, nv, dk, dv = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    )
    conv_dim = 2 * nk * dk + nv * dv
    nv_r = shard(nv, tp, "linear_num_value_heads")
    gdn = (
        shard(2 * nk * dk + 2 * nv * dv, tp, "GDN qkvz width") * H  # in_proj_qkvz
        + 2 * nv_r * H  # in_proj_ba
        + shard(conv_dim, tp, "GDN conv dim") * c.linear_conv_kernel_dim  # conv1d
        + nv_r  # dt_bias
        + dv  # norm
        + H * shard(nv * dv, tp, "GDN value width")  # out_proj
    )
    add("GDN (linear attention)", n_gdn * (gdn + nv_r), "TP-sharded", n_gdn * (bf * gdn + 4 * nv_r))

    # Gated attention with QSA: q+gate heads sharded, KV heads sharded or replicated (1 per rank
    # once tp > kv heads), o_proj row-parallel; the indexer is replicated so that every rank
    # selects the same tokens.
    hd = c.head_dim
    kv_local = max(1, c.num_key_value_heads // tp)
    q_rank = shard(2 * c.num_attention_heads, tp, "2 * num_attention_heads") * hd
    attn = (q_rank + 2 * kv_local * hd) * H + shard(c.num_attention_heads * hd, tp, "attention width") * H
    attn += 2 * hd  # q_norm, k_norm
    add("QSA attention (q/k/v/o)", n_qsa * attn, f"TP-sharded, {kv_local} KV head(s) per rank")
    idx = (c.indexer_n_heads + 1) * c.indexer_head_dim * H + 2 * c.indexer_head_dim
    add("QSA indexer", n_qsa * idx, "replicated")

    # MoE (Qwen3NextSparseMoeBlock): routed experts and shared expert sharded on the intermediate
    # dim, router and shared-expert gate replicated.
    E, I_, Is = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    if expert_parallel and tp > 1:
        e_r, i_r, how = shard(E, tp, "num_experts"), I_, f"expert-parallel ({E // tp} whole experts per rank)"
    else:
        e_r, i_r, how = E, shard(I_, tp, "moe_intermediate_size"), "TP-sharded (intermediate)"
    routed = e_r * (2 * i_r * H + H * i_r)
    add(
        f"routed experts ({fmt.label()})",
        n_layers * routed,
        how,
        n_layers * expert_bytes_per_rank(e_r, i_r, H, fmt),
    )
    is_r = shard(Is, tp, "shared_expert_intermediate_size")
    add("shared expert", n_layers * 3 * is_r * H, "TP-sharded")
    add("router + shared-expert gate", n_layers * (E * H + H), "replicated")

    # Hyper-connections: two gated residuals per layer plus the final mixer, replicated.
    gated = width + c.hc_lowrank * width + width * c.hc_lowrank
    add("hyper-connections", n_layers * 2 * (gated + hc * width) + gated, "replicated")

    # PLE dense part (projections, norms, conv); the tables themselves are host memory.
    E_ple = c.ple_embed_dim
    ple = width * E_ple + H * E_ple + 3 * width + width * c.ple_conv_kernel_size
    if n_ple:
        add("PLE projections/norms/conv", n_ple * ple, "replicated")
    return parts


# ------------------------------------------------------------------------------------------------
# PLE tables
# ------------------------------------------------------------------------------------------------


def ple_row_bytes(fmt: str, dim: int) -> int:
    if fmt == "bf16":
        return 2 * dim
    if fmt == "fp8_e4m3":
        return dim
    if fmt == "nvfp4":
        return dim // 2 + dim // NVFP4_BLOCK
    raise ValueError(f"unknown PLE format {fmt!r}; expected one of {PLE_FORMATS}")


@dataclass
class PleTables:
    layers: int
    rows_per_layer: list[int]
    row_dim: int
    params_total: int
    bytes_per_rank: dict[str, int]  # format -> bytes this rank holds (largest rank)
    bytes_total: dict[str, int]


def ple_tables(config, tp: int) -> PleTables:
    """Rows of every PLE table (sum of the prime head vocabularies, padded) and bytes per rank.

    Rows are split contiguously across TP ranks (ETP, ``shard_bounds``): the first ranks get one
    extra row, so the per-rank figure is the largest rank's.
    """
    from model.ple.ngram_hash import layout_from_config

    heads = (config.ngram_size - 1) * config.heads_per_ngram
    dim = config.ple_embed_dim // heads if heads else 0
    rows = [layout_from_config(config, i).padded_rows for i in range(len(config.ple_layer_ids))]
    per_rank = {f: sum(cdiv(r, tp) * ple_row_bytes(f, dim) for r in rows) for f in PLE_FORMATS}
    total = {f: sum(r * ple_row_bytes(f, dim) for r in rows) for f in PLE_FORMATS}
    return PleTables(len(rows), rows, dim, sum(rows) * dim, per_rank, total)


# ------------------------------------------------------------------------------------------------
# KV cache and per-request state, and vLLM's block arithmetic
# ------------------------------------------------------------------------------------------------


@dataclass
class CachePlan:
    kv_dtype: str
    qsa_layers: int
    gdn_layers: int
    ple_layers: int
    qsa_row_bytes: int  # one token, one QSA layer, this rank
    kv_bytes_per_token: int  # all QSA layers, this rank (unpadded)
    gdn_state_bytes: int  # one request, one GDN layer, this rank
    ple_state_bytes: int  # one request, one PLE layer (replicated on every rank)
    state_bytes_per_request: int  # all GDN + PLE layers, this rank (unpadded)
    block_size: int  # tokens per vLLM block (scheduler block for the QSA groups)
    page_bytes: int  # unified page size of every layer
    mamba_padding_pct: float
    group_size: int
    num_groups: int
    qsa_groups: int
    mamba_groups: int
    mamba_blocks_per_request: int
    padded_state_bytes_per_request: int  # what vLLM really reserves for the states of one request


def plan_cache(
    config,
    tp: int,
    kv_dtype: str = "bf16",
    device: str = "cuda",
    block_size: int | None = None,
    prefix_caching: bool = True,
    mamba_ssm_dtype: str = "auto",
    model_dtype: str = "bf16",
    cpu_avx512_bf16: bool | None = None,
) -> CachePlan:
    c = config
    types = list(c.layer_types)
    n_gdn = types.count("linear_attention")
    n_qsa = len(types) - n_gdn
    n_ple = len(c.ple_layer_ids)
    mb = DTYPE_BYTES[model_dtype]
    kvb = DTYPE_BYTES[kv_dtype]
    hd = c.head_dim
    kv_local = max(1, c.num_key_value_heads // tp)
    # QSA row: K and V of the local KV heads in the cache dtype, index key in the model dtype.
    row = 2 * kv_local * hd * kvb + c.indexer_head_dim * mb

    nk, nv, dk, dv = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    )
    conv_dim = 2 * nk * dk + nv * dv
    ssm_dtype = ssm_state_dtype(mamba_ssm_dtype, device, model_dtype, cpu_avx512_bf16)
    gdn_conv = (c.linear_conv_kernel_dim - 1) * shard(conv_dim, tp, "GDN conv dim") * mb
    gdn_ssm = shard(nv, tp, "linear_num_value_heads") * dv * dk * DTYPE_BYTES[ssm_dtype]
    gdn_page = gdn_conv + gdn_ssm
    ple_page = 0
    if n_ple:
        conv_len = (c.ple_conv_kernel_size - 1) * c.ngram_size
        ple_page = 8 * (c.ngram_size - 1) + conv_len * c.hc_count * c.hidden_size * mb
    mamba_page = max(gdn_page, ple_page)

    # Platform._align_hybrid_block_size: the attention page per token comes from the model
    # config's KV heads/head size (K and V, cache dtype), not from our wider QSA row.
    base = block_size or DEFAULT_BLOCK_SIZE[device]
    attn_1tok = 2 * kv_local * hd * kvb
    block = base
    if mamba_page:
        block = max(base, base * cdiv(mamba_page, base * attn_1tok))
    mamba_padded = block * attn_1tok if mamba_page else 0
    qsa_page = block * row
    # unify_kv_cache_spec_page_size: every layer ends up with the largest page.
    page = max(qsa_page, mamba_padded)
    qsa_block = block * (page // qsa_page) if page % qsa_page == 0 else block
    pad_pct = 100.0 * (page - mamba_page) / mamba_page if mamba_page else 0.0

    # _get_kv_cache_groups_uniform_page_size: buckets of identical specs, split into groups of
    # ``group_size`` layers; all groups draw from one pool of ``page * group_size``-byte blocks.
    buckets = [n for n in (n_qsa, n_gdn, n_ple) if n]
    group_size = min(buckets)
    if max(buckets) < 1.5 * group_size:
        group_size = max(buckets)
    qsa_groups = cdiv(n_qsa, group_size)
    mamba_groups = cdiv(n_gdn, group_size) + (cdiv(n_ple, group_size) if n_ple else 0)
    mamba_blocks = 2 if prefix_caching else 1
    return CachePlan(
        kv_dtype=kv_dtype,
        qsa_layers=n_qsa,
        gdn_layers=n_gdn,
        ple_layers=n_ple,
        qsa_row_bytes=row,
        kv_bytes_per_token=n_qsa * row,
        gdn_state_bytes=gdn_page,
        ple_state_bytes=ple_page,
        state_bytes_per_request=n_gdn * gdn_page + n_ple * ple_page,
        block_size=qsa_block,
        page_bytes=page,
        mamba_padding_pct=pad_pct,
        group_size=group_size,
        num_groups=qsa_groups + mamba_groups,
        qsa_groups=qsa_groups,
        mamba_groups=mamba_groups,
        mamba_blocks_per_request=mamba_blocks,
        padded_state_bytes_per_request=mamba_groups * mamba_blocks * page * group_size,
    )


@dataclass
class Capacity:
    kv_cache_bytes: int
    num_blocks: int
    blocks_per_request: int
    max_concurrency: float  # vLLM's "Maximum concurrency for N tokens per request"
    kv_cache_tokens: int  # vLLM's "KV cache size: N tokens"
    sequences_fit: int  # whole sequences of seq_len that fit at once


def capacity(cache: CachePlan, kv_cache_bytes: int, seq_len: int) -> Capacity:
    """vLLM's block count and concurrency for ``kv_cache_bytes`` of KV memory on each rank."""
    bytes_per_block = cache.page_bytes * cache.group_size
    num_blocks = max(0, kv_cache_bytes // bytes_per_block)
    per_req = (
        cache.qsa_groups * cdiv(seq_len, cache.block_size)
        + cache.mamba_groups * cache.mamba_blocks_per_request
    )
    conc = num_blocks / per_req
    # One block is the pool's null block and never holds data.
    fit = max(0, (num_blocks - 1) // per_req)
    return Capacity(kv_cache_bytes, num_blocks, per_req, conc, int(conc * seq_len), fit)


# ------------------------------------------------------------------------------------------------
# Marlin's tiles (the 3090's kernel for int4 and FP8 experts)
# ------------------------------------------------------------------------------------------------


def _marlin_group(expert: ExpertFormat) -> int | None:
    """The group Marlin sees for these experts: int4's group, -1 for FP8 (per channel), None for bf16."""
    return None if expert.name == "bf16" else expert.group if expert.name == "int4" else -1


def marlin_moe_misfit(config, tp: int, expert: ExpertFormat, expert_parallel: bool) -> str | None:
    """Why vLLM's fused-MoE Marlin kernel cannot run this rank's experts, or None if it can
    (:func:`model.deployment.expert_layout.marlin_misfit`, the rule the deployment applies too)."""
    group = _marlin_group(expert)
    if group is None:
        return None
    H, I_ = config.hidden_size, config.moe_intermediate_size
    sliced = not expert_parallel and tp > 1
    problems = expert_layout.marlin_misfit(H, I_ // tp if sliced else I_, group)
    if not problems:
        return None
    fix = (
        "serve with expert parallelism (QWEN4EXP_EXPERT_PARALLEL=auto or on, planner --expert-parallel)"
        if sliced and not expert_layout.marlin_misfit(H, I_, group)
        else "use another group size or TP size"
    )
    return f"{expert.label()} experts: Marlin cannot run them ({'; '.join(problems)}); {fix}"


# ------------------------------------------------------------------------------------------------
# The whole plan
# ------------------------------------------------------------------------------------------------


@dataclass
class Machine:
    gpus: int = 4
    gpu_mem_gib: float = 23.7  # what torch reports for an RTX 3090 (24 GB marketing)
    host_ram_gib: float = 128.0


@dataclass
class Options:
    tp: int | None = None
    device: str = "cuda"
    kv_cache_dtype: str = "fp8"
    expert_weights: str = "int4"  # or "auto": the checkpoint's quantization_config (int4 when bf16)
    seq_len: int | None = None
    gpu_memory_utilization: float = 0.92
    reserve_gib: float = 2.5  # activations at max_num_batched_tokens + CUDA graphs + NCCL (assumed)
    kv_cache_gib: float | None = None  # fix the KV memory per rank (CPU: VLLM_CPU_KVCACHE_SPACE)
    block_size: int | None = None
    prefix_caching: bool = True
    mamba_ssm_dtype: str = "auto"
    ple_format: str | None = None  # default: the checkpoint's
    ple_on_device: bool = False  # VLLM_PLE_CPU_OFFLOAD=0
    expert_parallel: bool | None = None  # QWEN4EXP_EXPERT_PARALLEL: on, off, None = auto (as the service)
    worker_host_gib: float = 4.0  # per GPU worker: CUDA context, torch, staging (assumed)
    frontend_host_gib: float = 4.0  # API server + engine core (assumed)
    os_reserve_gib: float = 8.0  # kernel, page cache for streaming checkpoint shards (assumed)
    shm_gib: float = 8.0  # /dev/shm for NCCL SHM transport and vLLM's message queues
    host_headroom: float = 0.10  # keep this fraction of host RAM free when recommending a format


@dataclass
class Plan:
    config_path: str
    machine: Machine
    options: Options
    tp: int
    seq_len: int
    weights: list[WeightPart]
    weights_bytes_per_rank: int
    weights_params_total: int
    weights_fit_by_format: dict[str, float]  # expert format -> GiB per rank
    ple: PleTables
    ple_format: str
    ple_device_bytes_per_rank: int
    cache: CachePlan
    gpu_budget_bytes: int
    capacity: Capacity
    host_needed_gib: dict[str, float]
    recommended_ple_format: str | None
    memory_request_gib: int
    notes: list[str] = field(default_factory=list)
    expert_format: str = ""  # routed-expert format planned, and whether the checkpoint stores it
    expert_name: str = "bf16"  # that format's name (bf16 | fp8 | int4), for the speed estimate
    expert_parallel: bool = False  # whole experts per rank (decided as the service's auto decides)


def make_plan(config_path: str | Path, machine: Machine, options: Options) -> Plan:
    config = load_config(config_path)
    tp = options.tp or machine.gpus
    seq_len = options.seq_len or config.max_position_embeddings
    stored = checkpoint_expert_format(config)
    formats = {f: stored if stored.name == f else ExpertFormat(f) for f in EXPERT_FORMATS}
    if options.expert_weights != "auto" and options.expert_weights not in formats:
        raise ValueError(
            f"unknown expert weight format {options.expert_weights!r}; expected auto or {EXPERT_FORMATS}"
        )
    if options.expert_weights == "auto":  # the checkpoint's format; a bf16 checkpoint is planned as int4
        expert = stored if stored.name != "bf16" else formats["int4"]
    else:
        expert = formats[options.expert_weights]
    cuda = options.device == "cuda"
    ep = options.expert_parallel
    auto_note = None
    if ep is None:  # QWEN4EXP_EXPERT_PARALLEL=auto, decided as the service decides it
        group = _marlin_group(expert)
        why = (
            expert_layout.slices_need_whole_experts(
                config.hidden_size, config.moe_intermediate_size, tp, group
            )
            if cuda and group is not None
            else []
        )
        ep = bool(why)
        if ep:
            auto_note = (
                f"expert parallelism planned (QWEN4EXP_EXPERT_PARALLEL=auto): Marlin cannot run the "
                f"{expert.label()} experts sliced over {tp} ranks ({'; '.join(why)})"
            )
    misfit = marlin_moe_misfit(config, tp, expert, ep) if cuda else None
    try:
        parts = weights_per_rank(config, tp, expert, expert_parallel=ep)
    except ValueError as exc:  # int4 groups that do not tile the per-rank width: no plan at all
        raise ValueError(misfit or str(exc)) from exc
    w_bytes = sum(p.bytes_per_rank for p in parts)
    by_format = {}
    for f, x in formats.items():
        with contextlib.suppress(ValueError):  # a format this layout cannot hold is left out
            by_format[f] = (
                sum(p.bytes_per_rank for p in weights_per_rank(config, tp, x, expert_parallel=ep)) / GIB
            )
    full = weights_per_rank(config, 1, "bf16")
    ple = ple_tables(config, tp)
    stored_ple_fmt = table_format_of(config)  # the loader's reader: refuses what the engine refuses
    ple_fmt = options.ple_format or stored_ple_fmt
    ple_dev = ple.bytes_per_rank[ple_fmt] if options.ple_on_device else 0
    cache = plan_cache(
        config,
        tp,
        kv_dtype=options.kv_cache_dtype,
        device=options.device,
        block_size=options.block_size,
        prefix_caching=options.prefix_caching,
        mamba_ssm_dtype=options.mamba_ssm_dtype,
    )
    budget = int(machine.gpu_mem_gib * options.gpu_memory_utilization * GIB)
    if options.kv_cache_gib is not None:
        kv_bytes = int(options.kv_cache_gib * GIB)
    else:
        kv_bytes = budget - w_bytes - ple_dev - int(options.reserve_gib * GIB)
    cap = capacity(cache, max(kv_bytes, 0), seq_len)

    fixed_host = (
        tp * options.worker_host_gib + options.frontend_host_gib + options.os_reserve_gib + options.shm_gib
    )
    host_needed = {
        f: (0.0 if options.ple_on_device else ple.bytes_total[f] / GIB) + fixed_host for f in PLE_FORMATS
    }
    usable = machine.host_ram_gib * (1 - options.host_headroom)
    recommended = next((f for f in PLE_FORMATS if host_needed[f] <= usable), None)
    chosen = host_needed[ple_fmt]
    notes: list[str] = []
    if misfit:
        notes.append(misfit)
    if auto_note:
        notes.append(auto_note)
    if expert.name != stored.name:
        notes.append(
            f"the checkpoint stores {stored.label()} routed experts; this plan assumes {expert.label()} "
            "(convert first: python -m model.tools.quantize, see the README)"
        )
    if kv_bytes <= 0:
        notes.append(
            f"weights ({w_bytes / GIB:.1f} GiB/GPU) + reserve exceed the {budget / GIB:.1f} GiB budget: "
            "does not fit; quantize the experts (--expert-weights int4) or add GPUs"
        )
    elif cap.sequences_fit == 0:
        notes.append(f"not even one sequence of {seq_len} tokens fits the KV cache; lower --seq-len")
    if chosen > machine.host_ram_gib:
        notes.append(f"PLE {ple_fmt}: host memory needed {chosen:.0f} GiB > {machine.host_ram_gib:.0f} GiB")
    # Memory request for the pod/container: PLE pinned + processes + shm, rounded up to 8 GiB.
    request = int(8 * math.ceil((chosen - options.os_reserve_gib) / 8))
    return Plan(
        config_path=str(config_path),
        machine=machine,
        options=options,
        tp=tp,
        seq_len=seq_len,
        weights=parts,
        weights_bytes_per_rank=w_bytes,
        weights_params_total=sum(p.params_per_rank for p in full),
        weights_fit_by_format=by_format,
        ple=ple,
        ple_format=ple_fmt,
        ple_device_bytes_per_rank=ple_dev,
        cache=cache,
        gpu_budget_bytes=budget,
        capacity=cap,
        host_needed_gib=host_needed,
        recommended_ple_format=recommended,
        memory_request_gib=request,
        notes=notes,
        expert_format=f"{expert.label()} ({'checkpoint' if expert == stored else 'planned'})",
        expert_name=expert.name,
        expert_parallel=ep,
    )


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    """GiB with two decimals; small sizes (tiny test models) in MiB/KiB/bytes so they stay readable."""
    if n >= GIB / 100 or n == 0:
        return f"{n / GIB:,.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):,.2f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):,.2f} KiB"
    return f"{int(n)} B"


def _count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:,.2f}B"
    return f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{int(n):,}"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.2f} MiB"


def render(plan: Plan) -> str:
    m, o, c, cap, ple = plan.machine, plan.options, plan.cache, plan.capacity, plan.ple
    out: list[str] = []
    w = out.append
    w(f"# Fit plan: {plan.config_path}")
    w("")
    w(
        f"Machine: {m.gpus} x {m.gpu_mem_gib:g} GiB GPU, {m.host_ram_gib:g} GiB host RAM; TP={plan.tp}, "
        f"device={o.device}, KV cache {o.kv_cache_dtype}, routed experts {plan.expert_format}, "
        f"sequence length {plan.seq_len:,}, prefix caching {'on' if o.prefix_caching else 'off'}."
    )
    w("")
    w(
        f"## Weights per GPU (TP={plan.tp}; model total {_count(plan.weights_params_total)} params without PLE tables)"
    )
    w("")
    w("| part | params/GPU | bytes/GPU | sharding |")
    w("|---|---:|---:|---|")
    for p in plan.weights:
        w(f"| {p.name} | {_count(p.params_per_rank)} | {_gib(p.bytes_per_rank)} | {p.sharding} |")
    w(f"| **total** | | **{_gib(plan.weights_bytes_per_rank)}** | |")
    w("")
    fits = ", ".join(f"{f}: {_gib(g * GIB)}" for f, g in plan.weights_fit_by_format.items())
    w(f"Weights per GPU by routed-expert format: {fits}.")
    w("")
    w("## KV cache and per-request state (per GPU)")
    w("")
    w("| item | bytes |")
    w("|---|---:|")
    w(
        f"| QSA row, one token, one layer ([K\\|V] {o.kv_cache_dtype} + index key bf16) | {c.qsa_row_bytes:,} |"
    )
    w(f"| KV cache per token ({c.qsa_layers} QSA layers) | {c.kv_bytes_per_token:,} |")
    w(f"| GDN state per request, one layer (conv + SSM) | {c.gdn_state_bytes:,} |")
    if c.ple_layers:
        w(f"| PLE state per request, one layer (history + conv, replicated) | {c.ple_state_bytes:,} |")
    w(
        f"| state per request, all {c.gdn_layers} GDN + {c.ple_layers} PLE layers (unpadded) | "
        f"{c.state_bytes_per_request:,} ({_mib(c.state_bytes_per_request)}) |"
    )
    w(
        f"| state per request as vLLM reserves it ({c.mamba_groups} groups x {c.mamba_blocks_per_request} "
        f"blocks x page) | {c.padded_state_bytes_per_request:,} ({_mib(c.padded_state_bytes_per_request)}) |"
    )
    w(
        f"| vLLM block: tokens / page bytes (Mamba pages padded {c.mamba_padding_pct:.1f}%) | "
        f"{c.block_size} / {c.page_bytes:,} |"
    )
    w("")
    w("## GPU memory and capacity (per GPU)")
    w("")
    w("| item | value |")
    w("|---|---:|")
    w(f"| budget (gpu_memory_utilization {o.gpu_memory_utilization}) | {_gib(plan.gpu_budget_bytes)} |")
    w(f"| weights | {_gib(plan.weights_bytes_per_rank)} |")
    if plan.ple_device_bytes_per_rank:
        w(f"| PLE table on device ({plan.ple_format}) | {_gib(plan.ple_device_bytes_per_rank)} |")
    if o.kv_cache_gib is None:
        w(f"| activations + CUDA graphs + NCCL (assumed) | {o.reserve_gib:.2f} GiB |")
    w(f"| KV cache | {_gib(cap.kv_cache_bytes)} |")
    w(f"| KV blocks | {cap.num_blocks:,} |")
    w(f"| blocks per {plan.seq_len:,}-token request | {cap.blocks_per_request:,} |")
    w(f"| vLLM 'KV cache size' | {cap.kv_cache_tokens:,} tokens |")
    w(f"| vLLM 'Maximum concurrency' | {cap.max_concurrency:.2f}x |")
    w(f"| **sequences of {plan.seq_len:,} tokens that fit** | **{cap.sequences_fit:,}** |")
    w("")
    w(
        f"## PLE tables (host, pinned; {ple.layers} layer(s), {sum(ple.rows_per_layer):,} rows x {ple.row_dim}, "
        f"{_count(ple.params_total)} params)"
    )
    w("")
    w("| format | per rank (ETP) | all ranks | host RAM needed | fits |")
    w("|---|---:|---:|---:|---|")
    usable = m.host_ram_gib * (1 - o.host_headroom)
    for f in PLE_FORMATS:
        need = plan.host_needed_gib[f]
        ok = "yes" if need <= usable else ("tight" if need <= m.host_ram_gib else "no")
        w(
            f"| {f}{(' (selected)' if o.ple_format else ' (checkpoint)') if f == plan.ple_format else ''} | "
            f"{_gib(ple.bytes_per_rank[f])} | "
            f"{_gib(ple.bytes_total[f])} | {need:.1f} GiB | {ok} |"
        )
    w("")
    w(
        f"Host RAM needed = PLE tables + {plan.tp} x {o.worker_host_gib:g} GiB workers + "
        f"{o.frontend_host_gib:g} GiB front end + {o.os_reserve_gib:g} GiB OS/page cache + "
        f"{o.shm_gib:g} GiB /dev/shm; 'yes' leaves {o.host_headroom:.0%} free."
    )
    w(f"Recommended PLE format: {plan.recommended_ple_format or 'none fits'}.")
    w(f"Container memory request (format {plan.ple_format}): {plan.memory_request_gib} GiB.")
    for n in plan.notes:
        w(f"\n**Note:** {n}")
    return "\n".join(out) + "\n"


def to_json(plan: Plan) -> str:
    return json.dumps(asdict(plan), indent=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.tools.planner", description=__doc__.splitlines()[0])
    p.add_argument("config", help="checkpoint directory or config.json")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--gpu-mem-gib", type=float, default=23.7, help="memory per GPU (RTX 3090: 23.7)")
    p.add_argument("--host-ram-gib", type=float, default=128.0)
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: --gpus)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="fp8")
    p.add_argument(
        "--expert-weights",
        choices=("auto", *EXPERT_FORMATS),
        default="auto",
        help="routed-expert format; auto = the checkpoint's quantization_config, or int4 (the format "
        "a 3090 needs, noted in the output) for a bf16 checkpoint",
    )
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: max_position_embeddings)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--reserve-gib", type=float, default=2.5, help="activations/graphs/NCCL per GPU")
    p.add_argument(
        "--kv-cache-gib", type=float, help="fixed KV memory per rank (CPU: VLLM_CPU_KVCACHE_SPACE)"
    )
    p.add_argument("--block-size", type=int)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--mamba-ssm-dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="vLLM's --mamba-ssm-cache-dtype (auto: the model dtype; fp32 on AVX512-BF16 CPUs with --device cpu)",
    )
    p.add_argument("--ple-format", choices=PLE_FORMATS, help="default: the checkpoint's ple_embedding_dtype")
    p.add_argument("--ple-on-device", action="store_true", help="VLLM_PLE_CPU_OFFLOAD=0")
    p.add_argument(
        "--expert-parallel",
        choices=("auto", "on", "off"),
        default="auto",
        help="QWEN4EXP_EXPERT_PARALLEL: whole routed experts per rank (on), slices (off), or as the "
        "service decides (auto: whole where Marlin cannot run the slices)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--speed",
        metavar="FILE",
        help="JSON of bench/bench_real_shape.py: print a decode-speed estimate for RTX 3090s at this TP",
    )
    p.add_argument(
        "--measured-config",
        help="--speed: the config whose one rank the measurement ran (default: CONFIG; another model of "
        "the family takes its layers, bytes and collectives from CONFIG and the overhead per layer from this)",
    )
    p.add_argument("--link", choices=("p2p", "no-p2p"), default="no-p2p", help="--speed: how the GPUs talk")
    p.add_argument("--allreduce-latency-us", type=float, help="--speed: time per all-reduce call, us")
    p.add_argument("--allreduce-busbw-gbps", type=float, help="--speed: all-reduce bus bandwidth, GB/s")
    p.add_argument("--memory-efficiency", type=float, help="--speed: attainable fraction of peak bandwidth")
    p.add_argument(
        "--overhead-scale",
        type=float,
        help="--speed: the measured step's non-memory time on a 3090 relative to the measuring GPU "
        "(default: both ends, 1 and the SM-throughput ratio)",
    )
    p.add_argument(
        "--batches",
        type=lambda v: [int(x) for x in v.split(",")],
        help="--speed: e.g. 1,4,16 (default: measured)",
    )
    a = p.parse_args(argv)
    if a.speed and a.json:
        p.error("--speed prints a markdown estimate after the markdown plan; leave out --json")
    machine = Machine(a.gpus, a.gpu_mem_gib, a.host_ram_gib)
    options = Options(
        tp=a.tp,
        device=a.device,
        kv_cache_dtype=a.kv_cache_dtype,
        expert_weights=a.expert_weights,
        seq_len=a.seq_len,
        gpu_memory_utilization=a.gpu_memory_utilization,
        reserve_gib=a.reserve_gib,
        kv_cache_gib=a.kv_cache_gib,
        block_size=a.block_size,
        prefix_caching=not a.no_prefix_caching,
        mamba_ssm_dtype=a.mamba_ssm_dtype,
        ple_format=a.ple_format,
        ple_on_device=a.ple_on_device,
        expert_parallel={"auto": None, "on": True, "off": False}[a.expert_parallel],
    )
    try:
        plan = make_plan(a.config, machine, options)
    except (ValueError, OSError) as exc:
        print(f"planner: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(to_json(plan) + "\n" if a.json else render(plan))
    if a.speed:
        return _print_speed(a, plan)
    return 0


def _print_speed(a: argparse.Namespace, plan: Plan) -> int:
    """``--speed``: the measured one-rank step turned into this machine's decode speed, printed
    after the memory plan because both answer "what will this node do" for the same config. Without
    ``--overhead-scale``, at both ends of its range: which share of the measured overhead a 3090
    pays alike and which it pays slower is not known."""
    from model.tools import planner_speed as ps

    link = ps.LINKS[a.link]
    link = replace(
        link,
        latency_us=link.latency_us if a.allreduce_latency_us is None else a.allreduce_latency_us,
        busbw_gbps=a.allreduce_busbw_gbps or link.busbw_gbps,
    )
    scales = [a.overhead_scale] if a.overhead_scale is not None else [1.0, ps.SM_THROUGHPUT_RATIO]
    config = load_config(a.config)
    try:
        measured = json.loads(Path(a.speed).read_text())
        measured_config = load_config(a.measured_config) if a.measured_config else config
        for scale in scales:
            est = ps.estimate_rtx3090(
                measured,
                measured_config,
                config,
                weights_per_rank=weights_per_rank,
                tp=plan.tp,
                expert_parallel=plan.expert_parallel,
                expert_format=plan.expert_name,
                batches=a.batches,
                inputs=ps.Inputs(
                    memory_efficiency=a.memory_efficiency or ps.MEMORY_EFFICIENCY,
                    overhead_scale=scale,
                    link=link,
                ),
            )
            sys.stdout.write("\n" + ps.render_estimate(est))
    except (ValueError, OSError, KeyError) as exc:
        print(f"planner: --speed {a.speed}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
