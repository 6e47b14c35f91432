"""Gated full attention with QSA sparse token selection, as a vLLM module.

``QSACache`` is the layer vLLM sees: it declares one paged cache per QSA layer whose rows hold,
per token, the attention key and value of every KV head and the raw indexer key
(``[K | V | index key]``, one "head" of ``2 * kv_heads * head_dim + index_dim`` channels), and it
writes new tokens into the slots vLLM assigns. ``Qwen4ExpQSAAttention`` owns the projections and
norms and runs, for every query: block scoring over the mean-pooled index keys, top-k selection
plus the incomplete tail, and attention over the selected tokens only.

KV cache formats (vLLM's ``--kv-cache-dtype``): ``auto``/the model dtype keep one row of
``2 * kv_heads * head_dim + index_dim`` elements in the model dtype. ``fp8``/``fp8_e4m3`` make the
page ``uint8``: per token ``[K codes | V codes | index key bytes]``, where K and V are E4M3 codes of
``value / scale`` (static per-layer scales, ``model.qsa_kv``) and the index key keeps the model
dtype, stored as its raw bytes and read back through ``Tensor.view(dtype)``. Keeping the index key
in the same row (rather than a second cache spec) keeps one page, one block table and one write per
layer: a second spec with a much smaller page would become its own KV-cache group with a different
block size, its own metadata, and on vLLM 0.32 a larger scheduler block (see vllm-internals.md). The
index key stays unquantised because block selection ranks mean-pooled keys and should not move with
the cache format. The attention reads codes with the Triton kernel on CUDA (sm_86+) and with the
torch reference on vLLM's CPU build; both fold the scales in.

Prefix caching: the page is a plain ``FullAttentionSpec``, so vLLM hashes and shares its blocks
like any attention cache. Every step pools the block keys from the raw index keys in the cached
rows (``pooled_block_keys``), so a request that starts from a prefix-cache hit, even one ending
inside a compression block, selects exactly as if it had computed the prefix itself: nothing of
the prefix needs recomputing. (Upstream vLLM's qwen4_exp keeps the raw keys of the open block in a
ring buffer that is not prefix-cacheable, next to a cache of pooled keys.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from model.deployment import resolve
from model.kernels import qsa_sparse_attention as qsa_kernel
from model.ops.qsa_indexer import pooled_block_keys, select_tokens, select_tokens_batched
from model.ops.qsa_sparse_attention import sparse_paged_attention_ref
from model.ops.rope import apply_rope, inverse_frequencies, rope_cos_sin
from model.qsa_kv import ops as kv_ops
from model.qsa_kv.layer_names import qsa_layer_names
from model.qsa_kv.settings import FP8_E4M3, QSAKVConfigError, resolve_kv_format
from model.qsa_kv.state import QSAKVState
from model.runtime import envs
from model.runtime.execution_mode import runs_eagerly

from .hyper_connection import ZeroCenteredRMSNorm
from .step_metadata import StepMetadataBackend, step_metadata


def register_layer(vllm_config: VllmConfig, name: str, layer: nn.Module) -> None:
    context = vllm_config.compilation_config.static_forward_context
    if name in context:
        raise ValueError(f"Duplicate layer name: {name}")
    context[name] = layer


class QSACache(nn.Module, AttentionLayerBase):
    """The paged per-token cache of one QSA layer (model dtype, or uint8 rows for an FP8 cache)."""

    def __init__(
        self,
        *,
        kv_heads: int,
        head_dim: int,
        index_dim: int,
        dtype: torch.dtype,
        prefix: str,
        layer_name: str | None = None,
        all_layer_names: Sequence[str] | None = None,
    ):
        super().__init__()
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.index_dim = index_dim
        self.dtype = dtype
        self.prefix = prefix
        self.kv_width = kv_heads * head_dim
        self.kv_cache = torch.tensor([])
        vllm_config = get_current_vllm_config()
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self.kv_format = resolve_kv_format(cache_dtype, dtype)
        self.quantized = self.kv_format == FP8_E4M3
        # FP8: one byte per K/V element; the index key keeps the model dtype as raw bytes.
        self.storage_dtype = torch.uint8 if self.quantized else dtype
        index_width = index_dim * dtype.itemsize if self.quantized else index_dim
        self.index_offset = 2 * self.kv_width
        self.row_width = self.index_offset + index_width
        self.block_size = vllm_config.cache_config.block_size
        self.use_kernel = self._choose_kernel(vllm_config, cache_dtype)
        layer_name = layer_name or prefix
        self.kv_state = QSAKVState(
            layer_name=layer_name,
            kv_format=self.kv_format,
            settings=resolve.of(vllm_config).qsa_kv,
            expected_layers=list(all_layer_names) if all_layer_names is not None else [layer_name],
            eager=runs_eagerly(vllm_config),
            model=str(vllm_config.model_config.model),
            cache_dtype=cache_dtype,
            engine=vllm_config.instance_id,
        )
        register_layer(vllm_config, prefix, self)

    def _choose_kernel(self, vllm_config: VllmConfig, cache_dtype: str) -> bool:
        """Triton kernel on CUDA sm_86+, torch reference on the CPU; FP8 elsewhere cannot start."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return False
        ok, why = qsa_kernel.is_supported(vllm_config.device_config.device)
        if not ok and self.quantized:
            raise QSAKVConfigError(
                f"--kv-cache-dtype {cache_dtype} for Qwen4-Exp QSA layers needs the Triton QSA kernel "
                f"(CUDA, compute capability >= 8.6) or vLLM's CPU build, and it cannot run here: {why}"
            )
        return ok

    def get_attn_backend(self):
        return StepMetadataBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.row_width,
            head_size_v=0,
            dtype=self.storage_dtype,
        )

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """vLLM's post-load hook: set the static scales before warm-up and any graph capture."""
        self.kv_state.apply()

    def rows(self) -> torch.Tensor:
        """The cache as ``[num_blocks, block_size, row_width]``."""
        return self.kv_cache[:, 0]

    def write(
        self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor
    ) -> None:
        """Store the rows of this step's tokens; rows without a slot (padding, slot < 0) are skipped.

        Statistics (clip counts, calibration absmax) are taken from the pre-quantisation K/V of the
        same rows, in place on the device (``model.qsa_kv.ops``), so the step never waits for the host.
        """
        slots = kv_ops.slots_for_rows(slot_mapping, k.shape[0])
        self.kv_state.observe(k, v, slots)
        if self.quantized:
            k_codes, v_codes = self.kv_state.encode(k, v)
            row = kv_ops.fp8_rows(k_codes, v_codes, index_k, self.dtype)
        else:
            row = torch.cat([k.flatten(1), v.flatten(1), index_k], dim=-1).to(self.dtype)
        kv_ops.scatter_rows_(self.rows(), slots, row)

    def key_view(self) -> torch.Tensor:
        rows = self.rows()
        return rows[..., : self.kv_width].unflatten(-1, (self.kv_heads, self.head_dim))

    def value_view(self) -> torch.Tensor:
        rows = self.rows()
        return rows[..., self.kv_width : 2 * self.kv_width].unflatten(-1, (self.kv_heads, self.head_dim))

    def index_view(self) -> torch.Tensor:
        """Raw index keys ``[num_blocks, block_size, index_dim]`` in the model dtype."""
        tail = self.rows()[..., self.index_offset :]
        return tail.view(self.dtype) if self.quantized else tail

    def index_keys(self, block_row: torch.Tensor, length: int) -> torch.Tensor:
        """Raw index keys ``[length, index_dim]`` of one request, in token order."""
        pages = block_row[: (length + self.block_size - 1) // self.block_size].long()
        rows = self.index_view()[pages].reshape(-1, self.index_dim)
        return rows[:length]

    def attend(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        token_req: torch.Tensor,
        selected: torch.Tensor,
        num_selected: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Sparse attention over this cache, dequantising FP8 codes with the layer's scales."""
        kwargs: dict = {}
        if self.quantized:
            kwargs = dict(k_scale=self.kv_state.k_scale, v_scale=self.kv_state.v_scale, kv_format=FP8_E4M3)
        args = (q, self.key_view(), self.value_view(), block_table, token_req, selected, num_selected, scale)
        if self.use_kernel and q.is_cuda:
            return qsa_kernel.sparse_paged_attention(*args, num_splits=None, **kwargs)
        return sparse_paged_attention_ref(*args, **kwargs)


class Qwen4ExpQSAAttention(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.total_kv_heads = config.num_key_value_heads
        self.num_kv_heads = max(1, self.total_kv_heads // tp)
        self.index_heads = config.indexer_n_heads
        self.index_dim = config.indexer_head_dim
        self.budget = config.indexer_budget
        self.ratio = config.indexer_compress_ratio
        self._selection: str | None = None  # "batched" | "loop", see _batched_selection
        self.scale = self.head_dim**-0.5
        eps = config.rms_norm_eps
        rope = config.rope_parameters or {}
        rotary_dim = int(self.head_dim * rope.get("partial_rotary_factor", 1.0))
        self.register_buffer(
            "inv_freq",
            inverse_frequencies(rotary_dim, float(rope.get("rope_theta", 10000.0))),
            persistent=False,
        )
        # q_proj interleaves [query | output gate] per head, so it is 2x heads of head_dim.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            2 * config.num_attention_heads,
            self.total_kv_heads,
            bias=False,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps)
        self.indexer = QSAIndexer(config, prefix=f"{prefix}.indexer", quant_config=vllm_config.quant_config)
        self.attn = QSACache(
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            index_dim=self.index_dim,
            dtype=vllm_config.model_config.dtype,
            prefix=f"{prefix}.attn",
            layer_name=prefix,
            all_layer_names=qsa_layer_names(prefix, config.layer_types),
        )

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv, _ = self.qkv_proj(hidden_states)
        q_width = 2 * self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        q_gate, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.inv_freq, hidden_states.dtype)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        index_q, index_k = self.indexer(hidden_states, cos, sin)

        out = self._attend(q, k, v, index_q, index_k, positions)
        out = out.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))
        out, _ = self.o_proj(out)
        return out

    def _batched_selection(self, index_q: torch.Tensor) -> bool:
        if self._selection is None:  # read once, at the first real step (the device is known then)
            self._selection = envs.qsa_selection(index_q.is_cuda)
        return self._selection == "batched"

    def _attend(self, q, k, v, index_q, index_k, positions) -> torch.Tensor:
        meta = step_metadata(self.attn.prefix)
        if meta is None:  # profiling run: no cache bound to real requests
            return torch.zeros_like(q)
        cache = self.attn
        cache.write(meta.slot_mapping, k, v, index_k)
        num_tokens = q.shape[0]
        width = self.budget + self.ratio - 1
        selected = torch.full((num_tokens, width), -1, dtype=torch.int32, device=q.device)
        num_selected = torch.zeros(num_tokens, dtype=torch.int32, device=q.device)
        token_req = torch.empty(num_tokens, dtype=torch.int32, device=q.device)
        qsl = meta.query_start_loc.tolist()
        for r in range(meta.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            if end == start:
                continue
            token_req[start:end] = r
            keys = cache.index_keys(meta.block_table[r], int(meta.seq_lens[r]))
            block_keys = pooled_block_keys(
                keys, self.ratio, self.indexer.k_layernorm.weight, self.indexer.k_layernorm.eps, self.inv_freq
            )
            # Default: CUDA the chunked selection (no per-query loop or host sync), CPU the
            # per-query loop, which matches transformers' op order and tie-breaking bit for bit
            # (parity tests); QWEN4EXP_QSA_SELECTION overrides (benchmarks, diagnosis).
            select = select_tokens_batched if self._batched_selection(index_q) else select_tokens
            sel, count = select(index_q[start:end], positions[start:end], block_keys, self.budget, self.ratio)
            selected[start:end] = sel
            num_selected[start:end] = count
        return cache.attend(q, meta.block_table, token_req, selected, num_selected, self.scale)


class QSAIndexer(nn.Module):
    """Projects the index queries (several heads) and the single index key of every token."""

    def __init__(self, config, prefix: str, quant_config=None) -> None:
        super().__init__()
        self.heads = config.indexer_n_heads
        self.dim = config.indexer_head_dim
        # Replicated on every rank: selection must be identical across tensor-parallel ranks. It
        # gets the quantization config like every linear, so a checkpoint must name it in its
        # ignore list (model.runtime.quant_checks refuses a quantized indexer) instead of it being skipped
        # by accident.
        self.index_qk_proj = ReplicatedLinear(
            config.hidden_size,
            (self.heads + 1) * self.dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.index_qk_proj",
        )
        self.q_layernorm = ZeroCenteredRMSNorm(self.dim, config.rms_norm_eps)
        self.k_layernorm = ZeroCenteredRMSNorm(self.dim, config.rms_norm_eps)

    def forward(self, hidden_states, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        qk, _ = self.index_qk_proj(hidden_states)
        q, k = qk.split([self.heads * self.dim, self.dim], dim=-1)
        q = self.q_layernorm(q.view(-1, self.heads, self.dim))
        return apply_rope(q, cos, sin), k
