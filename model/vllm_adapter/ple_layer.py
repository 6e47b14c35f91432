"""PLE (per-layer n-gram embeddings) as a vLLM module.

``PLEState`` is the layer vLLM sees: a Mamba-style per-request state with two parts, the last
``ngram_size - 1`` token ids (so hashing continues across steps and prefill chunks) and the
last ``(kernel - 1) * dilation`` inputs of the dilated causal conv. ``Qwen4ExpPLE`` owns the
projections, norms, conv weight and the n-gram table, and adds its output to every residual
stream. The table is sharded by rows across tensor-parallel ranks (each rank owns a contiguous
row range, rows of other ranks read as zero, and the ranks' partial embeddings are summed).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from model.metrics import ple_table_bytes, tp_rank
from model.ops.ngram_hash import NgramLayout, next_context, ngram_layout, ngram_row_ids, token_windows
from model.ops.ple import dilated_causal_conv, ple_gated_values

from .hyper_connection import WeightOnly, ZeroCenteredRMSNorm
from .qsa_attention import register_layer
from .step_metadata import StepMetadataBackend, step_metadata

SHARD_NAME = re.compile(r"ngram_embedding\.shard_(\d+)\.weight$")


def ple_state_shapes(config, num_spec: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(token history, conv inputs) per request; the int64 history comes first for alignment."""
    conv_len = (config.ple_conv_kernel_size - 1) * config.ngram_size
    return (config.ngram_size - 1,), (conv_len + num_spec, config.hc_count * config.hidden_size)


def ple_state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    return torch.int64, model_dtype


def eos_of(config) -> int:
    eos = config.eos_token_id
    return int(eos[0] if isinstance(eos, list) else eos)


def layout_for(config, ple_index: int) -> NgramLayout:
    return ngram_layout(
        vocab_size=config.vocab_size,
        ngram_size=config.ngram_size,
        heads_per_ngram=config.heads_per_ngram,
        ngram_vocab_size_base=config.ngram_vocab_size_base,
        vocab_divisor=config.make_ngram_vocab_size_divisible_by,
        seed=config.seed,
        eos_token_id=eos_of(config),
        ple_layer_index=ple_index,
    )


def row_shard(total_rows: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous, near-even split of the table rows across tensor-parallel ranks (ETP)."""
    base, extra = divmod(total_rows, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class PLEState(nn.Module, MambaBase):
    def __init__(self, config, model_dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self._shapes = ple_state_shapes(config)
        self._dtypes = ple_state_dtypes(model_dtype)
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        register_layer(get_current_vllm_config(), prefix, self)

    def get_state_shape(self):
        return self._shapes

    def get_state_dtype(self):
        return self._dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return True

    def get_attn_backend(self):
        return StepMetadataBackend


class NgramTable(nn.Module):
    """This rank's rows of one PLE table, with the config-derived hash layout.

    The storage seam: ``lookup`` is the only way the layer reads rows, so the pinned-host storage
    can replace the device-resident parameter without touching the layer.
    """

    def __init__(self, config, ple_index: int, layer_name: str) -> None:
        super().__init__()
        self.layout = layout_for(config, ple_index)
        heads = self.layout.num_heads
        self.row_dim = config.ple_embed_dim // heads
        self.total_rows = self.layout.padded_rows
        self.row_start, self.row_end = row_shard(
            self.total_rows, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        )
        self.weight = nn.Parameter(
            torch.empty(self.row_end - self.row_start, self.row_dim), requires_grad=False
        )
        self.split_parts = config.split_ngram_parts
        self.shards_loaded: set[int] = set()
        self.layer_name = layer_name

    def export_metrics(self) -> None:
        storage = "cpu" if self.weight.device.type == "cpu" else "device"
        nbytes = self.weight.numel() * self.weight.element_size()
        ple_table_bytes().labels(layer=self.layer_name, rank=tp_rank(), storage=storage).set(nbytes)

    @property
    def shard_rows(self) -> int:
        return -(-self.total_rows // self.split_parts)

    @property
    def num_shards(self) -> int:
        return -(-self.total_rows // self.shard_rows)

    def load_shard(self, index: int, rows: torch.Tensor, name: str) -> None:
        """Copy the part of checkpoint shard ``index`` that this rank owns."""
        if not 0 <= index < self.num_shards:
            raise ValueError(
                f"{name}: shard index {index} out of range: the config implies {self.num_shards} shards"
            )
        start = index * self.shard_rows
        expected = (min(self.shard_rows, self.total_rows - start), self.row_dim)
        if tuple(rows.shape) != expected:
            raise ValueError(
                f"{name}: shape {tuple(rows.shape)} does not match the config ({expected[0]} rows of "
                f"ple_embed_dim / heads = {self.row_dim}); check ngram_vocab_size_base, "
                "make_ngram_vocab_size_divisible_by, split_ngram_parts and ple_embed_dim"
            )
        lo, hi = max(start, self.row_start), min(start + expected[0], self.row_end)
        if lo < hi:
            self.weight.data[lo - self.row_start : hi - self.row_start].copy_(rows[lo - start : hi - start])
        self.shards_loaded.add(index)

    def check_buffer(self, short_name: str, value: torch.Tensor, name: str) -> None:
        expected = {
            "layer_multipliers": self.layout.multipliers,
            "ngram_heads_vocab_sizes": self.layout.head_vocab_sizes,
            "ngram_heads_offsets": self.layout.head_offsets,
        }[short_name]
        if value.tolist() != list(expected):
            raise ValueError(
                f"{name} = {value.tolist()} does not match the hash layout derived from the config "
                f"({list(expected)}); the checkpoint was made with a different vocab_size, ngram_size, "
                "heads_per_ngram, ngram_vocab_size_base or seed"
            )

    def missing_shards(self) -> list[int]:
        return sorted(set(range(self.num_shards)) - self.shards_loaded)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[T, heads * row_dim]`` of global rows ``[T, heads]``; zeros for other ranks' rows."""
        local = rows - self.row_start
        owned = (local >= 0) & (local < self.weight.shape[0])
        out = self.weight[local.clamp(0, max(self.weight.shape[0] - 1, 0))]
        out = torch.where(owned.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out.flatten(-2)


class Qwen4ExpPLE(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, ple_index: int, prefix: str) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.hc_count = config.hc_count
        self.eps = config.rms_norm_eps
        self.dilation = config.ngram_size
        self.eos = eos_of(config)
        width = self.hidden_size * self.hc_count
        embed = config.ple_embed_dim
        self.key_proj = WeightOnly(width, embed)
        self.value_proj = WeightOnly(self.hidden_size, embed)
        self.norm_key = ZeroCenteredRMSNorm(width, self.eps, self.hidden_size)
        self.norm_query = ZeroCenteredRMSNorm(width, self.eps, self.hidden_size)
        self.norm_conv = ZeroCenteredRMSNorm(width, self.eps, self.hidden_size)
        self.conv1d = WeightOnly(width, 1, config.ple_conv_kernel_size)
        self.ple_embedding = NgramTable(config, ple_index, layer_name=prefix)
        self.state = PLEState(config, vllm_config.model_config.dtype, prefix=f"{prefix}.state")
        self.tp_size = get_tensor_model_parallel_world_size()

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        meta = step_metadata(self.state.prefix)
        table = self.ple_embedding
        n_ctx = table.layout.context_len
        if meta is None:  # profiling run: one fresh pseudo-request, no state written
            qsl = torch.tensor([0, input_ids.shape[0]], dtype=torch.int64)
            has_state = torch.zeros(1, dtype=torch.bool)
            slots = None
        else:
            qsl = meta.query_start_loc
            has_state = meta.num_computed > 0
            slots = meta.block_table[:, 0].long()
        num_reqs = qsl.shape[0] - 1
        device = streams.device
        context = torch.full((num_reqs, n_ctx), self.eos, dtype=torch.int64, device=device)
        if slots is not None:
            history = self.state.kv_cache[0]
            keep = has_state.to(device)
            context[keep] = history[slots[keep]]
        qsl_dev = qsl.to(device)
        windows = token_windows(input_ids.long(), context, qsl_dev)
        embeddings = table.lookup(ngram_row_ids(windows, table.layout))
        if self.tp_size > 1:
            embeddings = tensor_model_parallel_all_reduce(embeddings)
        gated, conv_in = ple_gated_values(
            streams,
            embeddings.to(streams.dtype),
            self.key_proj.weight,
            self.value_proj.weight,
            self.norm_key.weight,
            self.norm_query.weight,
            self.norm_conv.weight,
            self.hc_count,
            self.hidden_size,
            self.eps,
        )
        conv_out = torch.empty_like(conv_in)
        weight = self.conv1d.weight.squeeze(1)
        state_len = (weight.shape[1] - 1) * self.dilation
        bounds = qsl.tolist()
        for r in range(num_reqs):
            start, end = bounds[r], bounds[r + 1]
            if start == end:
                continue
            if slots is not None and bool(has_state[r]):
                state = self.state.kv_cache[1][slots[r], :state_len]
            else:
                state = conv_in.new_zeros(state_len, conv_in.shape[1])
            conv_out[start:end], new_state = dilated_causal_conv(
                conv_in[start:end], state, weight, self.dilation
            )
            if slots is not None:
                self.state.kv_cache[1][slots[r], :state_len] = new_state
        if slots is not None:
            self.state.kv_cache[0][slots] = next_context(windows, qsl_dev, context)
        return streams + gated + conv_out
