"""Our PLE table formats (FP8 E4M3, NVFP4) on vLLM's own ("upstream") CUDA Qwen4-Exp classes.

Why: on CUDA, upstream's Qwen4-Exp serves (``model.upstream.model``), but its PLE tables
(the hashed n-gram embedding tables, ``vllm.models.qwen4_exp.common.ngram_embedding``) know only
bf16 and its own FP8 variant, multiply FP8 codes by the scale in bf16 (ours decodes in fp32 and
rounds once, so the values differ), have no NVFP4, and its format selector raises
``NotImplementedError`` for AWQ/GPTQ quantization configs although PLE tables are never quantized by
the weight quantizer. ``model/upstream/UPSTREAM_CUDA.md`` sections 4 and 5 map the upstream code
this module hooks.

What it adds (applied by :func:`install`, nothing happens on import):

* :class:`Qwen4ExpPLEOursFp8Method` and :class:`Qwen4ExpPLEOursNvfp4Method`: PLE embedding methods
  that store a table as ONE uint8 tensor ``[rows, B]`` (fp8: ``B = D`` E4M3 codes; nvfp4: ``B = D/2``
  packed E2M1 bytes followed by ``D/16`` E4M3 block-scale bytes). One byte tensor is what keeps
  upstream's three storage paths valid unchanged: ``F.embedding`` on the device table, the pinned
  host table's raw-byte UVA copy kernel, and the ETP all-reduce (each row has one owner rank and
  the others contribute zero bytes, so a byte sum is exact). ``dequantize`` decodes the looked-up
  bytes with ``model.ple.tables.dequantize_rows``, bit for bit what our own CPU/adapter path
  produces.
* :func:`choose_ple_method`, the replacement of ``Qwen4ExpPLEEmbeddingMethod.from_quant_config``:
  the table format comes from the checkpoint's ``ple_embedding_dtype`` read by
  ``model.ple.format`` (the one reader our planner, loader and converter share), never from the
  weight quantizer.
* :class:`Qwen4ExpNGramEmbeddingOurFormats`: upstream's n-gram embedding with a loader for our
  checkpoint names (``shard_N.weight`` codes, ``shard_N.weight_scale`` NVFP4 block scales,
  ``shard_N.weight_global_scale``) that checks shapes, dtypes and that all global scales of a table
  agree, failing with the tensor's name.

Importing this module imports upstream's CUDA Qwen4-Exp (on vLLM's CPU build only after
``tests.upstream.importer.import_upstream``). Everything that depends on how upstream 0.32 is written
is checked by :func:`check_upstream_assumptions`, which raises instead of patching a changed upstream.
"""

from __future__ import annotations

import contextvars
import inspect
import math
import re
from collections.abc import Iterable
from typing import ClassVar

import torch
import vllm
from torch import nn
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.layers.quantization.modelopt import (
    ModelOptMixedPrecisionConfig,
    ModelOptQuantConfigBase,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.models.qwen4_exp.common import ngram_embedding as _common
from vllm.models.qwen4_exp.common.ple import copy_ple_embedding_shard_
from vllm.models.qwen4_exp.nvidia import ngram_embedding as _nvidia_ngram
from vllm.models.qwen4_exp.nvidia import ple_layer as _nvidia_ple_layer

from model.ple.format import FIELD, FORMATS, table_format_of
from model.ple.tables import dequantize_rows, row_shapes, split_row_bytes

VERIFIED_VLLM = "0.32."
"""The vLLM release whose upstream Qwen4-Exp sources this module was written against."""


# Checkpoint tensors of one table, relative to the n-gram embedding module (``<layer>.ple.ple_embedding``).
_SHARD_TENSOR = re.compile(r"ngram_embedding\.shard_(\d+)\.(weight|weight_scale|weight_global_scale)")
# Upstream's FP8 convention names the one per-table scale ``ngram_embedding.weight_scale``.
_TABLE_SCALE = "ngram_embedding.weight_scale"
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_CONVERT = "python -m model.tools.ple_quantize --format {fmt} --src <bf16 checkpoint> --out <dir>"

# The table format of the n-gram embedding being built, set by Qwen4ExpNGramEmbeddingOurFormats
# around upstream's __init__ (which calls the selector with only ``ple_embedding_dtype``), so that a
# format declared in ``quantization_config.ple_embedding_dtype`` is honoured too.
_BUILDING_FORMAT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ple_format", default=None)

# Quantization configs for which upstream's selector itself decides (they carry upstream's own FP8
# PLE convention); every other config is a weight quantizer that never touches PLE tables.
_UPSTREAM_DECIDES = (Fp8Config, ModelOptQuantConfigBase, ModelOptMixedPrecisionConfig)
_SAVED_SELECTOR = "_qwen4exp_upstream_from_quant_config"


def supported_ple_formats() -> tuple[str, ...]:
    """The PLE table formats (``model.ple.format`` names) upstream serves once :func:`install` ran."""
    return FORMATS


# ------------------------------------------------------------------------------------------------
# Embedding methods
# ------------------------------------------------------------------------------------------------


class _OursQuantizedMethod(_common.Qwen4ExpPLEEmbeddingMethod):
    """Common part of our FP8 and NVFP4 PLE methods: one uint8 row tensor plus one fp32 global scale.

    ``create_weights`` also sets the table's ``embedding_dim`` to the stored row width ``B`` in bytes
    (the decoded width stays in ``ple_value_dim``): upstream's pinned table derives its byte-copy
    width, prefetch buffer and output width from ``embedding_dim`` right after ``create_weights``
    returns, and reading ``B`` there makes all three right for packed rows without copying its code.
    """

    table_format: ClassVar[str]

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        del input_size, output_size, params_dtype
        dim = input_size_per_partition
        width = row_bytes(self.table_format, dim)
        # Plain parameters (not vLLM's BasevLLMParameter): our loader places every byte itself.
        weight = nn.Parameter(
            layer.allocate_embedding_weight(sum(output_partition_sizes), width, torch.uint8),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)
        # NaN until loaded: a table whose scale never arrived fails in process_weights_after_loading.
        scale = nn.Parameter(torch.full((1,), math.nan, dtype=torch.float32), requires_grad=False)
        layer.register_parameter("weight_global_scale", scale)
        layer.ple_value_dim = dim
        layer.ple_format = self.table_format
        layer.ple_global_scale = None  # Python float, set once all scales are loaded
        layer.ple_load = _LoadRecord()
        layer.embedding_dim = width

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Fail closed unless every shard's rows (and NVFP4 block scales) and a global scale arrived."""
        record: _LoadRecord = layer.ple_load
        prefix = layer.prefix
        needed = set(_shards_with_rows(layer))
        missing = [f"{prefix}.shard_{i}.weight" for i in sorted(needed - record.rows)]
        if self.table_format == "nvfp4":
            missing += [f"{prefix}.shard_{i}.weight_scale" for i in sorted(needed - record.block_scales)]
        if record.global_scale is None:
            missing.append(f"{prefix}.shard_<i>.weight_global_scale")
        if missing:
            raise ValueError(
                f"checkpoint is missing {', '.join(missing)} ({self.table_format} PLE table, "
                f"config.json {FIELD}={self.table_format!r}); re-convert with "
                f"`{_CONVERT.format(fmt=self.table_format)}`"
            )
        # The decode multiplies by a Python float: no device read, nothing for CUDA graphs to capture.
        layer.ple_global_scale = record.global_scale[0]

    def dequantize(
        self, layer: nn.Module, embeddings: torch.Tensor, output_dtype: torch.dtype
    ) -> torch.Tensor:
        """Looked-up bytes ``[..., heads * B]`` (or ``[..., B]``) -> values ``[..., heads * D]``."""
        scale = layer.ple_global_scale
        if scale is None:
            raise RuntimeError(f"{layer.prefix}: PLE table used before its weights were loaded")
        width = layer.weight.shape[1]
        if embeddings.dtype != torch.uint8 or embeddings.shape[-1] % width:
            raise RuntimeError(
                f"{layer.prefix}: expected uint8 PLE rows of {width} bytes per head, got "
                f"{embeddings.dtype} {tuple(embeddings.shape)}"
            )
        rows = embeddings.reshape(*embeddings.shape[:-1], embeddings.shape[-1] // width, width)
        data, block_scales = split_row_bytes(self.table_format, rows, layer.ple_value_dim)
        return dequantize_rows(self.table_format, data, block_scales, scale, output_dtype).flatten(-2)


class Qwen4ExpPLEOursFp8Method(_OursQuantizedMethod):
    """FP8 E4M3 (fn) codes as uint8 ``[rows, D]``, one fp32 global scale; value = e4m3 * scale in fp32."""

    table_format = "fp8_e4m3"


class Qwen4ExpPLEOursNvfp4Method(_OursQuantizedMethod):
    """NVFP4 rows as uint8 ``[rows, D/2 + D/16]``: packed E2M1 codes (low nibble first), then E4M3
    block scales (one per 16 values); value = (e2m1 * e4m3(block)) * global scale in fp32."""

    table_format = "nvfp4"


_OUR_METHODS: dict[str, type[_OursQuantizedMethod]] = {
    "fp8_e4m3": Qwen4ExpPLEOursFp8Method,
    "nvfp4": Qwen4ExpPLEOursNvfp4Method,
}


def row_bytes(fmt: str, dim: int) -> int:
    """Bytes of one stored row of ``dim`` values in ``fmt`` (codes plus NVFP4 block scales)."""
    (width, dtype), scales = row_shapes(fmt, dim)
    return width * torch.empty((), dtype=dtype).element_size() + (scales[0] if scales else 0)


# ------------------------------------------------------------------------------------------------
# Format selection (replaces Qwen4ExpPLEEmbeddingMethod.from_quant_config)
# ------------------------------------------------------------------------------------------------


def choose_ple_method(quant_config, prefix: str, embedding_dtype: str | None = None):
    """The PLE embedding method of one table: its format comes from the checkpoint, not the quantizer.

    ``fp8_e4m3``/``nvfp4`` (any ``model.ple.format`` alias, e.g. upstream's ``float8_e4m3fn``): ours.
    bf16 with no quant config, FP8 or ModelOpt: upstream's own choice (these configs may quantize the
    table in upstream's FP8 convention). bf16 with any other config (AWQ, GPTQ and their Marlin forms,
    compressed-tensors, INC, Quark...): unquantized, as weight quantizers leave embedding tables alone
    (upstream raises ``NotImplementedError`` for AWQ/GPTQ and for compressed-tensors schemes whose
    targets match the table's name).
    """
    fmt = _BUILDING_FORMAT.get()
    if fmt is None:
        fmt = table_format_of({FIELD: embedding_dtype})
    if fmt in _OUR_METHODS:
        return _OUR_METHODS[fmt]()
    if quant_config is None or isinstance(quant_config, _UPSTREAM_DECIDES):
        return _upstream_selector()(quant_config, prefix, embedding_dtype)
    return _common.Qwen4ExpPLEUnquantizedEmbeddingMethod()


def _upstream_selector():
    # Saved on the class, not here, so that a reloaded module still finds upstream's original.
    saved = _common.Qwen4ExpPLEEmbeddingMethod.__dict__.get(_SAVED_SELECTOR)
    if saved is not None:
        return saved.__func__
    return _common.Qwen4ExpPLEEmbeddingMethod.__dict__["from_quant_config"].__func__


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


class _LoadRecord:
    """What arrived for one table: shard indices with rows / block scales, the global scale and its name."""

    def __init__(self) -> None:
        self.rows: set[int] = set()
        self.block_scales: set[int] = set()
        self.global_scale: tuple[float, str] | None = None


def _shard_geometry(table: nn.Module, index: int) -> tuple[int, int]:
    """(first row, row count) of checkpoint shard ``index``, as upstream's loader splits the table."""
    parts = table.ple_split_parts
    size = -(-table.org_vocab_size // parts)
    start = index * size
    return start, max(0, min(size, table.org_vocab_size - start))


def _shards_with_rows(table: nn.Module) -> list[int]:
    return [i for i in range(table.ple_split_parts) if _shard_geometry(table, i)[1] > 0]


class Qwen4ExpNGramEmbeddingOurFormats(_nvidia_ngram.Qwen4ExpNGramEmbedding):
    """Upstream's n-gram embedding, loading our PLE checkpoint convention (``model.tools.ple_quantize``).

    Quantized tables: ``shard_N.weight`` (codes), ``shard_N.weight_scale`` (NVFP4 block scales) and
    ``shard_N.weight_global_scale`` (one fp32 value, equal across shards; upstream's table-level
    ``ngram_embedding.weight_scale`` is accepted for FP8 as the same thing) are copied straight into
    this rank's rows of the byte table. bf16 tables load as upstream does, after refusing quantized
    codes (upstream would silently convert integer codes to bf16 values).
    """

    def __init__(self, config, *args, **kwargs) -> None:
        if not _selector_installed():
            raise RuntimeError(
                "Qwen4ExpNGramEmbeddingOurFormats needs model.upstream.ple.install() first: "
                "upstream's constructor picks the table format through the selector it patches"
            )
        token = _BUILDING_FORMAT.set(table_format_of(config))
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            _BUILDING_FORMAT.reset(token)
        table = self.ngram_embedding
        table.ple_split_parts = self.split_ngram_parts
        if isinstance(table.quant_method, _OursQuantizedMethod):
            _check_table_geometry(table, self.ngram_heads)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        table = self.ngram_embedding
        ours = isinstance(table.quant_method, _OursQuantizedMethod)
        bf16 = isinstance(table.quant_method, _common.Qwen4ExpPLEUnquantizedEmbeddingMethod)
        loaded: set[str] = set()
        rest: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            m = _SHARD_TENSOR.fullmatch(name)
            if ours and (m is not None or name == _TABLE_SCALE):
                loaded |= _load_ours(table, m, tensor, _full_name(table, name))
                continue
            if bf16 and m is not None:
                _refuse_quantized_tensor_in_bf16(m.group(2), tensor, _full_name(table, name))
            rest.append((name, tensor))
        loaded |= super().load_weights(rest)
        export_table_metrics(self)
        return loaded


def export_table_metrics(owner: nn.Module) -> None:
    """The PLE gauges ours exports (``ple_table_bytes``, ``ple_pinned_bytes``, ``ple_storage_info``),
    for upstream's table of this n-gram embedding, so Grafana shows where the tables live whichever
    implementation serves. Labels as ours: the PLE layer (``model.layers.N.ple``), the tensor-parallel
    rank, and ours' storage and format names."""
    from model.ple.vllm_table import ple_pinned_bytes, ple_storage_info
    from model.runtime.metrics import ple_table_bytes, tp_rank

    table = owner.ngram_embedding
    weight = table.weight
    nbytes = weight.numel() * weight.element_size()
    if weight.device.type != "cpu":
        location = "device"
    else:
        location = "pinned" if weight.is_pinned() else "cpu"
    mode = "pinned" if isinstance(table, _common.Qwen4ExpPLEPinnedHostEmbedding) else "device"
    layer = table.prefix.removesuffix(".ngram_embedding").removesuffix(".ple_embedding")
    rank = tp_rank()
    # Our FP8/NVFP4 methods name their format; otherwise upstream's own storage dtype.
    fmt = getattr(table, "ple_format", None) or (
        "bf16" if weight.dtype == torch.bfloat16 else str(weight.dtype).removeprefix("torch.")
    )
    ple_table_bytes().labels(layer=layer, rank=rank, storage=location).set(nbytes)
    ple_pinned_bytes().labels(layer=layer, rank=rank).set(nbytes if location == "pinned" else 0)
    ple_storage_info().labels(layer=layer, rank=rank, mode=mode, format=fmt).set(1)


def _full_name(table: nn.Module, name: str) -> str:
    """Checkpoint name of ``ngram_embedding.<rest>``: the table's prefix ends in ``.ngram_embedding``."""
    return f"{table.prefix}{name[len('ngram_embedding') :]}"


def _check_table_geometry(table: nn.Module, heads: int) -> None:
    """Upstream 0.32's pinned table sizes its byte copy and output from ``embedding_dim`` after
    ``create_weights``; if a later upstream derives them otherwise, refuse instead of copying garbage."""
    width = table.weight.shape[1]
    if table.embedding_dim != width:
        raise RuntimeError(f"{table.prefix}: embedding_dim {table.embedding_dim} != stored row width {width}")
    if hasattr(table, "_row_bytes"):
        got = (table._row_bytes, table._output_dim)
        if got != (width, heads * width):
            raise RuntimeError(
                f"{table.prefix}: upstream's pinned PLE table copies {got[0]} bytes per row into "
                f"{got[1]} bytes per token, but packed rows are {width} bytes ({heads} heads): "
                f"upstream changed how it sizes pinned rows (written against vLLM {VERIFIED_VLLM}x); "
                "re-check model/upstream/ple.py"
            )


def _refuse_quantized_tensor_in_bf16(kind: str, tensor: torch.Tensor, name: str) -> None:
    if kind != "weight":
        raise ValueError(
            f"{name} belongs to a quantized PLE table, but config.json sets no {FIELD} (bf16 tables); "
            'set it to the format the checkpoint was converted to ("fp8_e4m3" or "nvfp4")'
        )
    if not tensor.is_floating_point() or tensor.dtype in _FP8_DTYPES:
        raise ValueError(
            f"{name} is {tensor.dtype}, i.e. quantized codes, but config.json sets no {FIELD} (bf16 "
            'tables); set it to the format the checkpoint was converted to ("fp8_e4m3" or "nvfp4")'
        )


def _as_codes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def _load_ours(table: nn.Module, m: re.Match | None, tensor: torch.Tensor, name: str) -> set[str]:
    fmt: str = table.ple_format
    record: _LoadRecord = table.ple_load
    if m is None or m.group(2) == "weight_global_scale":
        if m is None and fmt != "fp8_e4m3":
            raise ValueError(f"{name}: a table-level scale has no meaning for {fmt} PLE tables")
        if m is not None:
            _shard_index(table, int(m.group(1)), name)
        _load_global_scale(table, record, tensor, name)
        return {"ngram_embedding.weight_global_scale"}
    index, kind = int(m.group(1)), m.group(2)
    start, rows = _shard_index(table, index, name)
    dim = table.ple_value_dim
    (code_width, _), block = row_shapes(fmt, dim)
    if kind == "weight_scale" and block is None:
        raise ValueError(
            f'{name} holds NVFP4 block scales, but config.json {FIELD}={fmt!r}; set it to "nvfp4" if '
            "the checkpoint was converted to nvfp4"
        )
    columns = (0, code_width) if kind == "weight" else (code_width, code_width + block[0])
    want = (rows, columns[1] - columns[0])
    tensor = _as_codes(tensor)
    if tensor.dtype != torch.uint8 or tuple(tensor.shape) != want:
        what = "codes" if kind == "weight" else "E4M3 block scales"
        hint = ""
        if fmt == "nvfp4" and kind == "weight" and tuple(tensor.shape) == (rows, dim):
            hint = " (nvfp4 rows are packed: two 4-bit codes per byte, low nibble first)"
        raise ValueError(
            f"{name} is {tensor.dtype} {tuple(tensor.shape)}; {fmt} {what} must be uint8 {want} for "
            f"this config{hint}; check ple_embed_dim, split_ngram_parts and {FIELD}, or re-convert "
            f"with `{_CONVERT.format(fmt=fmt)}`"
        )
    lo, hi = table.shard_indices.org_vocab_start_index, table.shard_indices.org_vocab_end_index
    destination = table.weight.data[:, columns[0] : columns[1]]
    copy_ple_embedding_shard_(destination, tensor, checkpoint_start=start, tp_start=lo, tp_end=hi)
    (record.rows if kind == "weight" else record.block_scales).add(index)
    return {"ngram_embedding.weight"}


def _shard_index(table: nn.Module, index: int, name: str) -> tuple[int, int]:
    if not 0 <= index < table.ple_split_parts:
        raise ValueError(
            f"{name}: shard index {index} out of range for split_ngram_parts={table.ple_split_parts}; "
            "fix split_ngram_parts in config.json"
        )
    return _shard_geometry(table, index)


def _load_global_scale(table: nn.Module, record: _LoadRecord, tensor: torch.Tensor, name: str) -> None:
    if tensor.numel() != 1 or not tensor.is_floating_point() or tensor.dtype in _FP8_DTYPES:
        raise ValueError(
            f"{name} is {tensor.dtype} {tuple(tensor.shape)}; a PLE global scale is one fp32 value "
            f"(shape [] or [1]); re-convert with `{_CONVERT.format(fmt=table.ple_format)}`"
        )
    value = float(tensor.reshape(()).to(torch.float32))
    if not (0.0 < value < math.inf):
        raise ValueError(f"{name} = {value}: a PLE global scale must be finite and positive")
    if record.global_scale is not None and record.global_scale[0] != value:
        first_value, first_name = record.global_scale
        raise ValueError(
            f"{name} = {value!r} differs from {first_name} = {first_value!r}: all shards of one PLE "
            "table share one global scale (applied after the lookup, whichever shard a row comes "
            f"from); re-quantize the whole table with one scale: `{_CONVERT.format(fmt=table.ple_format)}`"
        )
    if record.global_scale is None:
        record.global_scale = (value, name)
    table.weight_global_scale.data.fill_(value)


# ------------------------------------------------------------------------------------------------
# Installation
# ------------------------------------------------------------------------------------------------


def check_upstream_assumptions() -> None:
    """Raise ``RuntimeError`` naming what differs if upstream is not written the way this module patches.

    Checked: the vLLM release, the selector being a patchable staticmethod with upstream 0.32's
    parameters, ``ple_layer`` building its n-gram embedding through a module global, the n-gram
    embedding's constructor parameters and load hook, and the table classes' allocation hook.
    """
    problems = []
    version = vllm.__version__.split("+")[0]
    if not version.startswith(VERIFIED_VLLM):
        problems.append(f"vLLM is {vllm.__version__}, this module was verified on {VERIFIED_VLLM}x")
    method_cls = _common.Qwen4ExpPLEEmbeddingMethod
    selector = method_cls.__dict__.get("from_quant_config")
    if not isinstance(selector, staticmethod):
        problems.append("Qwen4ExpPLEEmbeddingMethod.from_quant_config is no longer a staticmethod")
    elif list(inspect.signature(selector.__func__).parameters) != [
        "quant_config",
        "prefix",
        "embedding_dtype",
    ]:
        problems.append(f"from_quant_config takes {inspect.signature(selector.__func__)}")
    current = getattr(_nvidia_ple_layer, "Qwen4ExpNGramEmbedding", None)
    if current not in (_nvidia_ngram.Qwen4ExpNGramEmbedding, Qwen4ExpNGramEmbeddingOurFormats):
        problems.append(f"nvidia/ple_layer.py's Qwen4ExpNGramEmbedding global is {current!r}")
    params = list(inspect.signature(_nvidia_ngram.Qwen4ExpNGramEmbedding.__init__).parameters)
    if params[:2] != ["self", "config"] or "quant_config" not in params:
        problems.append(f"Qwen4ExpNGramEmbedding.__init__ takes {params}")
    if "load_weights" not in _nvidia_ngram.Qwen4ExpNGramEmbedding.__dict__:
        problems.append("Qwen4ExpNGramEmbedding no longer defines load_weights")
    for cls in (_common.Qwen4ExpPLEDeviceEmbedding, _common.Qwen4ExpPLEPinnedHostEmbedding):
        if "allocate_embedding_weight" not in cls.__dict__:
            problems.append(f"{cls.__name__} no longer defines allocate_embedding_weight")
    if problems:
        raise RuntimeError(
            "upstream Qwen4-Exp PLE code differs from what model/upstream/ple.py patches: "
            + "; ".join(problems)
        )


def _selector_installed() -> bool:
    selector = _common.Qwen4ExpPLEEmbeddingMethod.__dict__.get("from_quant_config")
    return getattr(selector, "__func__", None) is choose_ple_method


def installed() -> bool:
    """Whether :func:`install` has been applied in this process."""
    return (
        _selector_installed() and _nvidia_ple_layer.Qwen4ExpNGramEmbedding is Qwen4ExpNGramEmbeddingOurFormats
    )


def install() -> None:
    """Make upstream build and load our PLE table formats; idempotent. Call before the model is built.

    1. ``Qwen4ExpPLEEmbeddingMethod.from_quant_config`` -> :func:`choose_ple_method` (upstream's
       original is kept on the class and still decides bf16 tables under FP8/ModelOpt configs).
    2. ``vllm.models.qwen4_exp.nvidia.ple_layer.Qwen4ExpNGramEmbedding`` (the module global
       ``Qwen4ExpPLELayer.__init__`` constructs) -> :class:`Qwen4ExpNGramEmbeddingOurFormats`.

    Neither the device nor the pinned table class is replaced: the methods' byte rows fit both.
    """
    check_upstream_assumptions()
    if installed():
        return
    method_cls = _common.Qwen4ExpPLEEmbeddingMethod
    if _SAVED_SELECTOR not in method_cls.__dict__:
        setattr(method_cls, _SAVED_SELECTOR, method_cls.__dict__["from_quant_config"])
    method_cls.from_quant_config = staticmethod(choose_ple_method)
    _nvidia_ple_layer.Qwen4ExpNGramEmbedding = Qwen4ExpNGramEmbeddingOurFormats
