"""The n-gram table of one PLE layer in vLLM: checkpoint loading, ETP sharding, lookups, metrics.

Why its own module: Qwen4-Exp's tables hold ~45B values, far more than a 24 GiB card, so by
default each rank keeps its rows in page-locked host memory and the GPU gathers the looked-up
rows through unified addressing (``model.ple.storage``). Tables are sharded by rows across
tensor-parallel ranks (ETP: each rank owns a contiguous row range, rows of other ranks read as
zero, and the ranks' partial results are summed). Tables may be stored as bf16, FP8 E4M3 or
NVFP4 (see ``model.tools.ple_quantize`` for the checkpoint convention); quantized rows are gathered in
their stored form and dequantized after the lookup. The layer that uses the table is
``model.ours.ple_layer``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)

from model.ple.format import parse_format, table_format_of
from model.ple.host_memory import release_file_pages
from model.ple.ngram_hash import layout_from_config
from model.ple.storage import PleStorage, StorageMode, make_storage
from model.ple.tables import (
    dequantize_rows,
    raw_row_bytes,
    row_shapes,
    shard_bounds,
    split_row_bytes,
)
from model.runtime import envs
from model.runtime.metrics import gauge, ple_table_bytes

SHARD_TENSOR = re.compile(r"ngram_embedding\.shard_(\d+)\.(weight|weight_scale|weight_global_scale)$")
"""Checkpoint tensors of one PLE table, relative to ``<layer>.ple.ple_embedding``."""
SHARD_NAME = re.compile(r"ngram_embedding\.shard_(\d+)\.weight$")

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_CONVERT_HINT = "python -m model.tools.ple_quantize --format {fmt} --src <bf16 checkpoint> --out <dir>"


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
