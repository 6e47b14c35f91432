"""PLE (per-layer n-gram embeddings) as a vLLM module.

``PLEState`` is the layer vLLM sees: a Mamba-style per-request state with two parts, the last
``ngram_size - 1`` token ids (so hashing continues across steps and prefill chunks) and the
last ``(kernel - 1) * dilation`` inputs of the dilated causal conv. ``Qwen4ExpPLE`` owns the
projections, norms, conv weight and the n-gram table, and adds its output to every residual
stream.

The n-gram table (``NgramTable``) is the big part: Qwen4-Exp's tables hold ~45B values, far
more than a 24 GiB card, so by default each rank keeps its rows in page-locked host memory and
the GPU gathers the looked-up rows through unified addressing (``model.ops.ple_storage``).
Tables are sharded by rows across tensor-parallel ranks (ETP: each rank owns a contiguous row
range, rows of other ranks read as zero, and the ranks' partial results are summed). Tables may
be stored as bf16, FP8 E4M3 or NVFP4 (see ``model.ple_quantize`` for the checkpoint convention);
quantized rows are gathered in their stored form and dequantized after the lookup.

Prefetch: the rows a PLE layer needs depend only on the token ids and the layer's own state, so
``PLEPrefetcher`` computes them for every PLE layer at the start of the forward and starts each
layer's gather on a side stream while the decoder layer before it runs; the layer joins it just
before use. Without CUDA the lookup runs synchronously in the layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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

from model import envs
from model.metrics import gauge, ple_table_bytes
from model.ops.ngram_hash import layout_from_config, next_context, ngram_row_ids, token_windows
from model.ops.ple import dilated_causal_conv, ple_gated_values
from model.ops.ple_host_memory import release_file_pages
from model.ops.ple_storage import PleStorage, StorageMode, make_storage
from model.ops.ple_tables import (
    dequantize_rows,
    raw_row_bytes,
    row_shapes,
    shard_bounds,
    split_row_bytes,
)
from model.ple_format import parse_format, table_format_of

from .hyper_connection import WeightOnly, ZeroCenteredRMSNorm
from .qsa_attention import register_layer
from .step_metadata import StepMetadataBackend, step_metadata

SHARD_TENSOR = re.compile(r"ngram_embedding\.shard_(\d+)\.(weight|weight_scale|weight_global_scale)$")
"""Checkpoint tensors of one PLE table, relative to ``<layer>.ple.ple_embedding``."""
SHARD_NAME = re.compile(r"ngram_embedding\.shard_(\d+)\.weight$")

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_CONVERT_HINT = "python -m model.ple_quantize --format {fmt} --src <bf16 checkpoint> --out <dir>"


def ple_state_shapes(config, num_spec: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(token history, conv inputs) per request; the int64 history comes first for alignment."""
    conv_len = (config.ple_conv_kernel_size - 1) * config.ngram_size
    return (config.ngram_size - 1,), (conv_len + num_spec, config.hc_count * config.hidden_size)


def ple_state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    return torch.int64, model_dtype


def eos_of(config) -> int:
    eos = config.eos_token_id
    return int(eos[0] if isinstance(eos, list) else eos)


def row_shard(total_rows: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous, near-even split of the table rows across tensor-parallel ranks (ETP)."""
    return shard_bounds(total_rows, rank, world)


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------


def ple_pinned_bytes():
    return gauge(
        "ple_pinned_bytes",
        "Page-locked host bytes held by this rank's PLE table rows, by layer (0 without CUDA).",
        ("layer", "rank"),
    )


def ple_storage_info():
    return gauge(
        "ple_storage_info",
        "1 per PLE table: storage mode (pinned = host memory, VLLM_PLE_CPU_OFFLOAD=1; device) and "
        "table format (bf16, fp8_e4m3, nvfp4).",
        ("layer", "rank", "mode", "format"),
    )


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------


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


def _tp_all_reduce_bytes(t: torch.Tensor) -> torch.Tensor:
    """Sum uint8 partial rows over the tensor-parallel group.

    vLLM's generic all-reduce may pick float-only fast paths (custom/quick all-reduce), so raw
    bytes go to NCCL directly (``ncclUint8``), or to torch.distributed where pynccl is absent.
    """
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    comm = getattr(group.device_communicator, "pynccl_comm", None)
    if comm is not None and not comm.disabled:
        out = comm.all_reduce(t)
        if out is not None:
            return out
    out = t.clone()
    torch.distributed.all_reduce(out, group=group.device_group)
    return out


class NgramTable(nn.Module):
    """This rank's rows of one PLE table, with the config-derived hash layout and its storage.

    The storage seam: ``lookup`` (or ``start_prefetch``/``wait_prefetch``) is the only way the
    layer reads rows, whether they sit in GPU memory, in pinned host memory or in plain RAM, and
    whatever their format. Checkpoint tensors are copied straight into the storage allocation as
    they arrive (``load_tensor``), so loading never holds a second copy of the table.
    """

    def __init__(
        self,
        config,
        ple_index: int,
        layer_name: str,
        *,
        fmt: str | None = None,
        mode: StorageMode | None = None,
        device: torch.device | str | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        prefetch: bool = False,
        max_tokens: int = 0,
    ) -> None:
        super().__init__()
        self.layout = layout_from_config(config, ple_index)
        self.heads = self.layout.num_heads
        self.row_dim = config.ple_embed_dim // self.heads
        self.total_rows = self.layout.padded_rows
        self.tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        self.row_start, self.row_end = row_shard(self.total_rows, self.tp_rank, self.tp_size)
        self.format = table_format_of(config) if fmt is None else parse_format(fmt, "fmt")
        self.mode: StorageMode = envs.ple_storage_mode() if mode is None else mode
        self.split_parts = config.split_ngram_parts
        self.layer_name = layer_name
        self.out_dtype = out_dtype
        # Quantized rows are summed across ranks as raw bytes (one owner per row), then dequantized.
        self.raw_reduce = self.tp_size > 1 and self.format != "bf16"
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] = tensor_model_parallel_all_reduce
        self.all_reduce_bytes: Callable[[torch.Tensor], torch.Tensor] = _tp_all_reduce_bytes
        try:
            row_shapes(self.format, self.row_dim)
        except ValueError as e:
            raise ValueError(
                f"{layer_name}: ple_embedding_dtype={self.format!r} needs ple_embed_dim / heads "
                f"({config.ple_embed_dim} / {self.heads} = {self.row_dim}) divisible by 16: {e}"
            ) from e
        try:
            self.storage: PleStorage = make_storage(
                self.mode,
                self.format,
                self.row_start,
                self.row_end,
                self.row_dim,
                global_scale=None if self.format != "bf16" else 1.0,
                device=device,
                out_dtype=out_dtype,
            )
        except ValueError as e:
            if self.mode == "pinned":
                raise ValueError(
                    f"{layer_name}: PLE tables cannot be kept in pinned host memory here ({e}). Set "
                    f"{envs.PLE_CPU_OFFLOAD}=0 to keep them in GPU memory instead (needs "
                    f"{self._nbytes_estimate() / 2**30:.2f} GiB per rank for this layer)"
                ) from e
            raise
        self.prefetch = prefetch
        if prefetch and max_tokens > 0:
            # Before any CUDA-graph capture: the prefetch output must not be allocated while capturing.
            self.storage.reserve_prefetch(max_tokens * self.heads, raw=self.raw_reduce)
        self.shards_loaded: set[int] = set()
        self._scales_loaded: set[int] = set()
        self._global_scales: dict[int, tuple[float, str]] = {}

    def _nbytes_estimate(self) -> int:
        (width, dtype), scales = row_shapes(self.format, self.row_dim)
        row = width * torch.empty((), dtype=dtype).element_size() + (scales[0] if scales else 0)
        return row * (self.row_end - self.row_start)

    # ---- loading ------------------------------------------------------------------------------

    @property
    def shard_rows(self) -> int:
        return -(-self.total_rows // self.split_parts)

    @property
    def num_shards(self) -> int:
        return -(-self.total_rows // self.shard_rows)

    def _shard_range(self, index: int, name: str) -> tuple[int, int]:
        if not 0 <= index < self.num_shards:
            raise ValueError(
                f"{name}: shard index {index} out of range: the config implies {self.num_shards} shards "
                f"(split_ngram_parts={self.split_parts}); fix split_ngram_parts in config.json"
            )
        start = index * self.shard_rows
        return start, min(self.shard_rows, self.total_rows - start)

    def _owned(self, start: int, rows: int) -> tuple[int, int] | None:
        lo, hi = max(start, self.row_start), min(start + rows, self.row_end)
        return (lo, hi) if lo < hi else None

    def load_tensor(self, rest: str, tensor: torch.Tensor, name: str) -> bool:
        """Route one checkpoint tensor of this table (``rest`` is relative to the table's prefix).

        Returns False for tensors that are not table rows or scales (e.g. the hash buffers).
        Raises ValueError naming the tensor and the fix for anything that does not match the
        config: a wrong shape or dtype, a scale tensor that the format has no use for, or a
        global scale that differs from another shard's.
        """
        m = SHARD_TENSOR.fullmatch(rest)
        if m is None:
            return False
        index, kind = int(m.group(1)), m.group(2)
        if kind == "weight":
            self.load_shard(index, tensor, name)
        elif kind == "weight_scale":
            self._load_block_scales(index, tensor, name)
        else:
            self._load_global_scale(index, tensor, name)
        return True

    def _config_hint(self) -> str:
        return (
            f"config.json ple_embedding_dtype={self.format!r}"
            if self.format != "bf16"
            else "config.json sets no ple_embedding_dtype (bf16 tables)"
        )

    def load_shard(self, index: int, rows: torch.Tensor, name: str) -> None:
        """Copy the part of checkpoint shard ``index`` (table rows) that this rank owns."""
        start, n = self._shard_range(index, name)
        (width, dtype), _ = row_shapes(self.format, self.row_dim)
        if self.format == "bf16":
            if not rows.is_floating_point() or rows.dtype in _FP8_DTYPES:
                raise ValueError(
                    f"{name} is {rows.dtype}, i.e. quantized codes, but {self._config_hint()}; set "
                    "ple_embedding_dtype to the format the checkpoint was converted to "
                    '("fp8_e4m3" or "nvfp4")'
                )
        else:
            if rows.dtype == torch.float8_e4m3fn:
                rows = rows.view(torch.uint8)
            if rows.dtype != torch.uint8:
                what = "uint8 E4M3 codes" if self.format == "fp8_e4m3" else "uint8 packed E2M1 codes"
                raise ValueError(
                    f"{name} is {rows.dtype}, but {self._config_hint()} expects {what}; convert the "
                    f"checkpoint with `{_CONVERT_HINT.format(fmt=self.format)}`, or remove "
                    "ple_embedding_dtype from config.json if the tables are bf16"
                )
        if tuple(rows.shape) != (n, width):
            packed = ""
            if self.format == "nvfp4" and tuple(rows.shape) == (n, self.row_dim):
                packed = " (nvfp4 rows are packed: two 4-bit codes per byte, low nibble first)"
            raise ValueError(
                f"{name}: shape {tuple(rows.shape)} does not match the config ({n} rows of "
                f"ple_embed_dim / heads = {self.row_dim} values, stored as {width} {self.format} "
                f"columns){packed}; check ngram_vocab_size_base, make_ngram_vocab_size_divisible_by, "
                "split_ngram_parts, ple_embed_dim and ple_embedding_dtype"
            )
        owned = self._owned(start, n)
        if owned is not None:
            lo, hi = owned
            part = rows[lo - start : hi - start]
            self.storage.load_data_rows(lo, part if part.dtype == dtype else part.to(dtype))
        release_file_pages(rows)  # copied: its mmapped checkpoint pages need not stay resident
        self.shards_loaded.add(index)

    def _load_block_scales(self, index: int, scales: torch.Tensor, name: str) -> None:
        start, n = self._shard_range(index, name)
        if self.format != "nvfp4":
            raise ValueError(
                f"{name} holds NVFP4 block scales, but {self._config_hint()}; set "
                'ple_embedding_dtype to "nvfp4" if the checkpoint was converted to nvfp4'
            )
        if scales.dtype == torch.float8_e4m3fn:
            scales = scales.view(torch.uint8)
        want = (n, self.row_dim // 16)
        if scales.dtype != torch.uint8 or tuple(scales.shape) != want:
            raise ValueError(
                f"{name} is {scales.dtype} {tuple(scales.shape)}; nvfp4 block scales must be uint8 "
                f"E4M3 codes of shape {want} (one per 16 values of each row); re-convert the "
                f"checkpoint with `{_CONVERT_HINT.format(fmt='nvfp4')}`"
            )
        owned = self._owned(start, n)
        if owned is not None:
            lo, hi = owned
            self.storage.load_block_scale_rows(lo, scales[lo - start : hi - start])
        release_file_pages(scales)
        self._scales_loaded.add(index)

    def _load_global_scale(self, index: int, value: torch.Tensor, name: str) -> None:
        self._shard_range(index, name)
        if self.format == "bf16":
            raise ValueError(
                f"{name} is a quantized table's global scale, but {self._config_hint()}; set "
                'ple_embedding_dtype to "fp8_e4m3" or "nvfp4" to match the checkpoint'
            )
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(
                f"{name} is {value.dtype} {tuple(value.shape)}; a global scale must be one fp32 value "
                f"(shape [] or [1]); re-convert with `{_CONVERT_HINT.format(fmt=self.format)}`"
            )
        v = float(value.reshape(()).to(torch.float32))
        if not (v > 0.0 and v != float("inf")):
            raise ValueError(
                f"{name} = {v}: a global scale must be finite and positive; re-convert with "
                f"`{_CONVERT_HINT.format(fmt=self.format)}`"
            )
        for other, (ov, oname) in self._global_scales.items():
            if other != index and ov != v:
                raise ValueError(
                    f"{name} = {v!r} differs from {oname} = {ov!r}: all shards of one PLE table share "
                    "one global scale (applied after the lookup, whichever shard a row comes from); "
                    f"re-quantize the whole table with one scale: `{_CONVERT_HINT.format(fmt=self.format)}`"
                )
        self._global_scales[index] = (v, name)
        self.storage.set_global_scale(v)

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

    def finish_loading(self, owner: str) -> None:
        """Fail closed unless every shard's rows, block scales and global scale arrived; export metrics."""
        prefix = f"{owner}.ngram_embedding"
        missing = self.missing_shards()
        if missing:
            raise ValueError(
                f"checkpoint is missing PLE table shards {missing} of {prefix} "
                f"(expected shard_0..shard_{self.num_shards - 1}, split_ngram_parts="
                f"{self.split_parts}); re-export the checkpoint or fix split_ngram_parts in config.json"
            )
        shards = set(range(self.num_shards))
        if self.format == "nvfp4":
            gone = sorted(shards - self._scales_loaded)
            if gone:
                names = ", ".join(f"{prefix}.shard_{i}.weight_scale" for i in gone)
                raise ValueError(
                    f"checkpoint is missing {names}: nvfp4 tables need uint8 E4M3 block scales "
                    f"[rows, {self.row_dim // 16}] per shard; re-convert with "
                    f"`{_CONVERT_HINT.format(fmt='nvfp4')}`"
                )
        if self.format != "bf16":
            gone = sorted(shards - set(self._global_scales))
            if gone:
                names = ", ".join(f"{prefix}.shard_{i}.weight_global_scale" for i in gone)
                raise ValueError(
                    f"checkpoint is missing {names}: {self.format} tables need one fp32 global scale "
                    f"tensor per shard (equal for all shards of a table); re-convert with "
                    f"`{_CONVERT_HINT.format(fmt=self.format)}`"
                )
        assert self.storage.fully_loaded, "every shard was routed but the storage is incomplete"
        self.export_metrics()

    def export_metrics(self) -> None:
        rank = str(self.tp_rank)
        st = self.storage
        ple_table_bytes().labels(layer=self.layer_name, rank=rank, storage=st.location).set(st.table_bytes())
        ple_pinned_bytes().labels(layer=self.layer_name, rank=rank).set(st.pinned_bytes())
        ple_storage_info().labels(layer=self.layer_name, rank=rank, mode=st.mode, format=self.format).set(1)

    # ---- lookups ------------------------------------------------------------------------------

    def partial_lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's contribution for global ``rows [T, heads]``: zeros for rows it does not own.

        Dequantized ``[T, heads * row_dim]`` rows, or, when quantized rows are reduced as raw
        bytes across ranks, uint8 ``[T, heads, B]`` (codes, plus nvfp4 block scales).
        """
        if self.raw_reduce:
            data, scales = self.storage.lookup_raw(rows)
            return raw_row_bytes(data, scales)
        return self.storage.lookup(rows).flatten(-2)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results (one owner per row, so byte sums are exact)."""
        if self.tp_size == 1:
            return partial
        return self.all_reduce_bytes(partial) if self.raw_reduce else self.all_reduce(partial)

    def finalize(self, reduced: torch.Tensor) -> torch.Tensor:
        """Reduced partials -> embeddings ``[T, heads * row_dim]`` in ``out_dtype``."""
        if not self.raw_reduce:
            return reduced
        data, scales = split_row_bytes(self.format, reduced, self.row_dim)
        vals = dequantize_rows(self.format, data, scales, self.storage.global_scale, self.out_dtype)
        return vals.flatten(-2)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[T, heads * row_dim]`` of global rows ``[T, heads]``, summed over ranks."""
        return self.finalize(self.reduce(self.partial_lookup(rows)))

    def start_prefetch(self, rows: torch.Tensor, context: object = None) -> None:
        """Start this rank's gather of ``rows`` on the side stream (synchronously without CUDA).

        ``context`` rides along with the prefetch in flight (the storage's ``prefetch`` object
        is the one owner of that state) and comes back from :meth:`wait_prefetch_with_context`.
        """
        self.storage.prefetch.start(rows, raw=self.raw_reduce, context=context)

    @property
    def prefetch_pending(self) -> bool:
        return self.storage.prefetch.pending

    def wait_prefetch(self) -> torch.Tensor:
        """Join the prefetch started by :meth:`start_prefetch` and return the embeddings."""
        return self.wait_prefetch_with_context()[1]

    def wait_prefetch_with_context(self) -> tuple[object, torch.Tensor]:
        """Join the prefetch: (the ``context`` it was started with, the embeddings)."""
        pf = self.storage.prefetch
        context = pf.context
        partial = raw_row_bytes(*pf.wait_raw()) if self.raw_reduce else pf.wait().flatten(-2)
        return context, self.finalize(self.reduce(partial))

    def drop_prefetch(self) -> None:
        """Join and discard a prefetch whose step was abandoned (e.g. an exception mid-forward)."""
        self.storage.prefetch.drop()


@dataclass
class PLEStep:
    """What one PLE layer needs from this step before its lookup: request layout, ids, state slots."""

    qsl: torch.Tensor  # [R+1] int64 on CPU
    qsl_dev: torch.Tensor  # the same on the model's device
    has_state: torch.Tensor  # [R] bool on CPU
    slots: torch.Tensor | None  # [R] int64 state slots, None in profiling runs
    context: torch.Tensor  # [R, n-1] tokens preceding each request's first new token
    windows: torch.Tensor  # [T, n] token windows
    rows: torch.Tensor  # [T, heads] global table rows


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
        device = torch.device(vllm_config.device_config.device)
        self.prefetch = envs.ple_prefetch(cuda=device.type == "cuda")
        self.ple_embedding = NgramTable(
            config,
            ple_index,
            layer_name=prefix,
            device=device,
            out_dtype=vllm_config.model_config.dtype,
            prefetch=self.prefetch,
            max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        )
        self.state = PLEState(config, vllm_config.model_config.dtype, prefix=f"{prefix}.state")

    def prepare(self, input_ids: torch.Tensor) -> PLEStep:
        """Token windows and table rows for this step, from ``input_ids`` and this layer's state.

        Reads only this layer's own state (written at the end of its forward), so it may run at
        the start of the model's forward, before any decoder layer.
        """
        meta = step_metadata(self.state.prefix)
        table = self.ple_embedding
        device = input_ids.device
        if meta is None:  # profiling run: one fresh pseudo-request, no state written
            qsl = torch.tensor([0, input_ids.shape[0]], dtype=torch.int64)
            has_state = torch.zeros(1, dtype=torch.bool)
            slots = None
        else:
            qsl = meta.query_start_loc
            has_state = meta.num_computed > 0
            slots = meta.block_table[:, 0].long()
        num_reqs = qsl.shape[0] - 1
        context = torch.full((num_reqs, table.layout.context_len), self.eos, dtype=torch.int64, device=device)
        if slots is not None:
            history = self.state.kv_cache[0][slots]
            context = torch.where(has_state.to(device).unsqueeze(1), history, context)
        qsl_dev = qsl.to(device)
        windows = token_windows(input_ids.long(), context, qsl_dev)
        rows = ngram_row_ids(windows, table.layout)
        return PLEStep(qsl, qsl_dev, has_state, slots, context, windows, rows)

    def start_lookup(self, step: PLEStep) -> None:
        """Begin the table gather for ``step``; :meth:`forward` joins it (the step travels with
        the prefetch in the table's storage, the one place that knows a gather is in flight)."""
        self.drop_pending()
        self.ple_embedding.start_prefetch(step.rows, context=step)

    def drop_pending(self) -> None:
        self.ple_embedding.drop_prefetch()

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.ple_embedding
        if table.prefetch_pending:
            step, embeddings = table.wait_prefetch_with_context()
            assert isinstance(step, PLEStep)
        else:  # synchronous lookup (CPU, prefetch off, or called outside the model)
            step = self.prepare(input_ids)
            embeddings = table.lookup(step.rows)
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
        bounds = step.qsl.tolist()
        slots, has_state = step.slots, step.has_state
        for r in range(len(bounds) - 1):
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
            self.state.kv_cache[0][slots] = next_context(step.windows, step.qsl_dev, step.context)
        return streams + gated + conv_out


class PLEPrefetcher:
    """Starts each PLE layer's table gather while the decoder layer before it runs.

    ``begin(input_ids)`` at the start of the model's forward computes every PLE layer's rows
    (they depend only on the token ids and the layer's own state) and starts the gather of a PLE
    in the first decoder layer; ``before_layer(i)``, called just before decoder layer ``i`` runs,
    starts the gather of layer ``i + 1``'s PLE on the side stream, so it overlaps layer ``i``.
    Layers whose PLE has prefetch off (CPU by default) look up synchronously in their forward.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._ples: list[Qwen4ExpPLE | None] = [getattr(layer, "ple", None) for layer in layers]
        self.enabled = any(p is not None and p.prefetch for p in self._ples)
        self._steps: dict[int, PLEStep] = {}

    def begin(self, input_ids: torch.Tensor) -> None:
        if not self.enabled:
            return
        self._steps = {}
        for i, ple in enumerate(self._ples):
            if ple is not None and ple.prefetch:
                ple.drop_pending()
                self._steps[i] = ple.prepare(input_ids)
        self._start(0)

    def before_layer(self, index: int) -> None:
        if self.enabled:
            self._start(index + 1)

    def _start(self, index: int) -> None:
        step = self._steps.pop(index, None)
        if step is not None:
            ple = self._ples[index]
            assert ple is not None
            ple.start_lookup(step)
