"""The pieces of our QSA FP8 path that sit between upstream's QSA layer and our kernels.

vLLM's own CUDA Qwen4-Exp (upstream) stores its QSA main cache as ``[blocks, kv_heads, page, 2*D]``
(K in ``[..., :D]``, V in ``[..., D:]``), hands the sparse attention a *packed* selection buffer
(``[T, W + 1]``: ``W`` logical token positions, ``-1`` padding, then one column holding the row's
valid-entry count) and applies the sigmoid output gate inside its kernel. Our subclass
(:mod:`model.upstream.qsa`) runs our E4M3 writer, reader, scales and statistics over
that layout instead; the translation lives here, free of upstream imports, so it is tested against
our references on any machine (``tests/upstream/test_upstream_qsa.py``).
"""

from __future__ import annotations

import torch

from model.kernels import qsa_sparse_attention as qsa_kernel
from model.ops.qsa_sparse_attention import sparse_paged_attention_ref
from model.qsa_kv import ops as kv_ops
from model.qsa_kv.settings import FP8_E4M3
from model.qsa_kv.state import QSAKVState


def split_packed_selection(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's packed ``[T, W + 1]`` selection as our kernel's ``(selected [T, W], counts [T])``."""
    if packed.dim() != 2 or packed.shape[1] < 2:
        raise ValueError(f"QSA packed selection must be [tokens, width + 1], got {tuple(packed.shape)}")
    return packed[:, :-1], packed[:, -1]


def cache_halves(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's bound cache ``[blocks, kv_heads, page, 2*D]`` as K and V views ``[blocks, page, kv_heads, D]``.

    The layout our kernel and :func:`model.qsa_kv.ops.scatter_rows_` take (any strides)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_dim:
        raise ValueError(
            f"QSA main cache must be [blocks, kv_heads, page, 2*{head_dim}], got {tuple(kv_cache.shape)}"
        )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    return key_cache, value_cache


def gate_attention_output(attention: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``bf16(bf16(attention) * sigmoid(gate))`` with the product in fp32.

    The rounding upstream's kernel applies (attention output rounded to the model dtype first, then
    gated in fp32), so an FP8 run differs from upstream's BF16 run only by the cache, not the gate."""
    rounded = attention.to(torch.bfloat16).float()
    return (rounded * torch.sigmoid(gate.reshape(attention.shape).float())).to(torch.bfloat16)


def needs_unfused_prepare(state: QSAKVState) -> bool:
    """Whether upstream's fused QK-norm/RoPE/cache-write launch must be off for this layer.

    The fused launch writes K/V from Triton registers with a native FP8 convert (no sm_86 lowering)
    and never materialises them, so an FP8 cache (our encoder writes it) and the calibration
    collector (it reads the rows) both need the unfused path, where K and V are tensors."""
    return state.quantized or state.absmax is not None


def write_kv(
    state: QSAKVState,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Observe this step's K/V rows (clip counts, absmax) and store them as E4M3 codes of ``x / scale``.

    ``key``/``value`` ``[T_padded, kv_heads, D]``; ``slot_mapping`` holds one slot per real row (it
    may be shorter than the padded rows, and padding slots are ``< 0``). Graph-safe: no host sync,
    static shapes (``kv_ops``)."""
    key_cache, value_cache = cache_halves(kv_cache, key.shape[-1])
    num_rows = min(key.shape[0], slot_mapping.shape[0])
    k, v = key[:num_rows], value[:num_rows]
    slots = kv_ops.slots_for_rows(slot_mapping, num_rows)
    state.observe(k, v, slots)
    k_codes, v_codes = state.encode(k, v)
    kv_ops.scatter_rows_(key_cache, slots, k_codes)
    kv_ops.scatter_rows_(value_cache, slots, v_codes)


def observe_kv(state: QSAKVState, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Statistics only (a BF16 cache that upstream writes itself, while calibrating)."""
    num_rows = min(key.shape[0], slot_mapping.shape[0])
    state.observe(key[:num_rows], value[:num_rows], kv_ops.slots_for_rows(slot_mapping, num_rows))


def attend_fp8(
    state: QSAKVState,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    packed_selection: torch.Tensor,
    scale: float,
    gate: torch.Tensor,
) -> torch.Tensor:
    """Gated sparse attention of ``query [T, Hq, D]`` over an E4M3 cache in upstream's layout.

    The Triton kernel on CUDA (its bit-trick E4M3 decode, sm_86 and up; the scales are read from the
    state's device tensors, so captured graphs see the calibrated values), the torch reference
    elsewhere."""
    if state.kv_format != FP8_E4M3:
        raise ValueError(f"{state.layer_name}: attend_fp8 called for a {state.kv_format} cache")
    key_cache, value_cache = cache_halves(kv_cache, query.shape[-1])
    selected, counts = split_packed_selection(packed_selection)
    args = (query, key_cache, value_cache, block_table, token_to_req, selected, counts, scale)
    scales = dict(k_scale=state.k_scale, v_scale=state.v_scale, kv_format=FP8_E4M3)
    if query.is_cuda:
        attention = qsa_kernel.sparse_paged_attention(*args, num_splits=None, **scales)
    else:
        attention = sparse_paged_attention_ref(*args, **scales)
    return gate_attention_output(attention, gate)


def reconcile_checkpoint_scales(
    layer_name: str,
    checkpoint_k: float,
    checkpoint_v: float,
    state: QSAKVState,
    *,
    dummy_weights: bool = False,
) -> None:
    """Refuse a checkpoint whose own K/V scales (upstream loads ``k_scale``/``v_scale`` tensors into
    the layer) disagree with the ones this deployment serves: either source alone is fine; two that
    disagree would mean one of them is ignored. With ``dummy_weights`` (vLLM's ``load_format=dummy``,
    which fills every parameter, these scales included, with random numbers) there is no checkpoint
    and nothing to reconcile."""
    if dummy_weights or (checkpoint_k == 1.0 and checkpoint_v == 1.0):
        return
    if not state.quantized:
        raise ValueError(
            f"{layer_name}: the checkpoint carries K/V cache scales (k {checkpoint_k}, v {checkpoint_v}) but "
            "the KV cache is not FP8; fix: --kv-cache-dtype fp8, or remove the scales from the checkpoint"
        )
    if (checkpoint_k, checkpoint_v) != (state.k_scale_value, state.v_scale_value):
        raise ValueError(
            f"{layer_name}: the checkpoint's K/V cache scales (k {checkpoint_k}, v {checkpoint_v}) differ from "
            f"the served ones (k {state.k_scale_value}, v {state.v_scale_value}, {state.scale_source}); fix: "
            "write the checkpoint's scales into the VLLM_QSA_KV_SCALES sidecar, or remove them from the checkpoint"
        )
