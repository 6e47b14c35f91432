"""PLE table formats and the plain-torch reference lookup.

Qwen4-Exp's PLE layers read hashed n-gram embedding tables (~45B parameters in total). They are
far too large for 24 GiB cards, so the serving stack keeps them in host memory and gathers rows
on demand. This module is the single definition of what a table *is* (layout and dequantization
rule); the Triton kernel (``model.ple.gather_kernel``) and the storage backends
(``model.ple.storage``) are tested bit for bit against :func:`lookup_ref` here.

Formats (``V`` = rows owned by this rank, ``D`` = embedding dim):

* ``"bf16"``: ``data`` is bf16 ``[V, D]``.
* ``"fp8_e4m3"``: ``data`` is uint8 ``[V, D]`` holding E4M3 (fn) codes, plus one fp32 global
  scale. ``value = e4m3(code) * global_scale``.
* ``"nvfp4"``: ``data`` is uint8 ``[V, D/2]``, two E2M1 codes per byte, low nibble first;
  ``block_scales`` is uint8 ``[V, D/16]`` of E4M3 codes, one per 16 values; one fp32 global
  scale. ``value = (e2m1(code) * e4m3(block_scale)) * global_scale``.

Dequantization always happens in fp32 with exactly that association order (the first product is
exact in fp32, so only the multiply by the global scale and the final cast round) and is then
cast to the output dtype with round-to-nearest-even. Any kernel that follows this order matches
the reference bit for bit.

Only plain torch is imported here: the module is used by checkpoint conversion and CPU tests,
where vLLM and a GPU may be absent. Element codes live in ``model.ple.codes``, the offline encoders in
``model.ple.quantizers`` (``make_table`` here uses them), the format names in ``model.ple.format``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.ple.codes import NVFP4_BLOCK, decode_e2m1, decode_e4m3, fp32_exact
from model.ple.format import FORMATS
from model.ple.quantizers import quantize_fp8_rows, quantize_nvfp4_rows


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown PLE table format {fmt!r}; expected one of {FORMATS}")


def shard_bounds(total_rows: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` owned by ``tp_rank`` under embedding tensor parallelism (ETP).

    Shards are contiguous and as even as possible: the first ``total_rows % tp_size`` ranks get one
    extra row. Contiguity keeps the owner test in the kernel a single range compare.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad tp_rank/tp_size: {tp_rank}/{tp_size}")
    if total_rows < 0:
        raise ValueError(f"total_rows must be >= 0, got {total_rows}")
    base, extra = divmod(total_rows, tp_size)
    start = tp_rank * base + min(tp_rank, extra)
    end = start + base + (1 if tp_rank < extra else 0)
    return start, end


def row_shapes(fmt: str, dim: int) -> tuple[tuple[int, torch.dtype], tuple[int, torch.dtype] | None]:
    """Per-row width and dtype of ``data`` and of ``block_scales`` (``None`` if the format has none)."""
    _check_format(fmt)
    if fmt == "bf16":
        return (dim, torch.bfloat16), None
    if fmt == "fp8_e4m3":
        return (dim, torch.uint8), None
    if dim % NVFP4_BLOCK != 0:
        raise ValueError(f"nvfp4 needs dim divisible by {NVFP4_BLOCK}, got {dim}")
    return (dim // 2, torch.uint8), (dim // NVFP4_BLOCK, torch.uint8)


@dataclass
class PleTable:
    """One rank's shard of a PLE table: rows ``[vocab_start, vocab_end)`` of the global table.

    ``data``/``block_scales`` follow the layouts in the module docstring. ``global_scale`` is 1.0
    for bf16. Tensors may live on any device (CPU, pinned host, GPU); the dataclass only groups
    them so every consumer agrees on the layout.
    """

    format: str
    data: torch.Tensor
    block_scales: torch.Tensor | None
    global_scale: float
    vocab_start: int
    vocab_end: int
    dim: int

    def __post_init__(self) -> None:
        _check_format(self.format)
        (width, dtype), scale_shape = row_shapes(self.format, self.dim)
        rows = self.vocab_end - self.vocab_start
        if rows < 0:
            raise ValueError(f"empty/negative vocab range [{self.vocab_start}, {self.vocab_end})")
        if tuple(self.data.shape) != (rows, width) or self.data.dtype != dtype:
            raise ValueError(
                f"{self.format} data must be {dtype} [{rows}, {width}], "
                f"got {self.data.dtype} {list(self.data.shape)}"
            )
        if scale_shape is None:
            if self.block_scales is not None:
                raise ValueError(f"{self.format} tables have no block scales")
        else:
            s_width, s_dtype = scale_shape
            bs = self.block_scales
            if bs is None or tuple(bs.shape) != (rows, s_width) or bs.dtype != s_dtype:
                raise ValueError(f"nvfp4 block_scales must be uint8 [{rows}, {s_width}]")
        self.global_scale = fp32_exact(self.global_scale)

    @property
    def num_rows(self) -> int:
        return self.vocab_end - self.vocab_start

    @property
    def row_bytes(self) -> int:
        """Bytes read from storage per looked-up row (data plus block scales)."""
        n = self.data.shape[1] * self.data.element_size()
        if self.block_scales is not None:
            n += self.block_scales.shape[1]
        return n

    def nbytes(self) -> int:
        return self.row_bytes * self.num_rows


# --------------------------------------------------------------------------------------------
# Decoding (shared by the reference and by dequantize_rows)
# --------------------------------------------------------------------------------------------


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., P] -> uint8 [..., 2P], low nibble first."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def dequantize_rows(
    fmt: str,
    data: torch.Tensor,
    block_scales: torch.Tensor | None,
    global_scale: float,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Raw rows -> values, following the fp32 association order the kernel uses.

    Exposed separately from :func:`lookup_ref` so the ETP "keep storage dtype" path can gather raw
    bytes on each rank, all-reduce them (only the owner contributes non-zero bytes) and dequantize
    once afterwards with identical results.
    """
    _check_format(fmt)
    if fmt == "bf16":
        return data.to(out_dtype)
    # A 0-dim CPU tensor acts as an fp32 scalar on any device without a host-to-device copy.
    gs = torch.tensor(fp32_exact(global_scale), dtype=torch.float32)
    if fmt == "fp8_e4m3":
        return (decode_e4m3(data) * gs).to(out_dtype)
    assert block_scales is not None
    vals = decode_e2m1(_unpack_nibbles(data))  # [..., D]
    scales = decode_e4m3(block_scales).repeat_interleave(NVFP4_BLOCK, dim=-1)  # [..., D]
    return ((vals * scales) * gs).to(out_dtype)


# --------------------------------------------------------------------------------------------
# Reference lookup
# --------------------------------------------------------------------------------------------


def _local_ids(table: PleTable, ids: torch.Tensor, vocab_start: int | None, vocab_end: int | None):
    start = table.vocab_start if vocab_start is None else int(vocab_start)
    end = table.vocab_end if vocab_end is None else int(vocab_end)
    if end - start != table.num_rows:
        raise ValueError(f"vocab range [{start}, {end}) does not match the table's {table.num_rows} rows")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
    flat = ids.reshape(-1).to(device=table.data.device, dtype=torch.int64)
    local = flat - start
    valid = (local >= 0) & (local < table.num_rows)
    return torch.where(valid, local, torch.zeros_like(local)), valid


def _gather_masked(t: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if t.shape[0] == 0:
        return torch.zeros((idx.numel(), t.shape[1]), dtype=t.dtype, device=t.device)
    rows = t.index_select(0, idx)
    return torch.where(valid[:, None], rows, torch.zeros((), dtype=t.dtype, device=t.device))


def lookup_raw_ref(
    table: PleTable,
    ids: torch.Tensor,
    vocab_start: int | None = None,
    vocab_end: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gather rows in the storage dtype: ``(data_rows [..., W], block_scale_rows [..., S] | None)``.

    Rows not owned by this shard are all-zero bytes, so summing the raw results of every ETP rank
    (as integers) reproduces the owner's bytes exactly.
    """
    idx, valid = _local_ids(table, ids, vocab_start, vocab_end)
    lead = tuple(ids.shape)
    data = _gather_masked(table.data, idx, valid).reshape(*lead, table.data.shape[1])
    scales = None
    if table.block_scales is not None:
        scales = _gather_masked(table.block_scales, idx, valid).reshape(*lead, table.block_scales.shape[1])
    return data, scales


def lookup_ref(
    table: PleTable,
    ids: torch.Tensor,
    vocab_start: int | None = None,
    vocab_end: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Reference lookup: global row ``ids`` (any integer shape ``[...]``) -> ``[..., D]`` values.

    ``vocab_start``/``vocab_end`` default to the table's own range (passing them only checks they
    agree). Ids outside ``[vocab_start, vocab_end)`` give zero rows (+0.0), so an ETP all-reduce
    sum over ranks yields the full-table lookup exactly.
    """
    data, scales = lookup_raw_ref(table, ids, vocab_start, vocab_end)
    return dequantize_rows(table.format, data, scales, table.global_scale, out_dtype)


def make_table(
    fmt: str,
    w: torch.Tensor,
    vocab_start: int = 0,
    vocab_end: int | None = None,
    global_scale: float | None = None,
) -> PleTable:
    """Quantize a float ``[V, D]`` shard into a :class:`PleTable` of format ``fmt`` (tests, tools).

    ``global_scale`` (quantized formats) fixes the scale instead of deriving it from ``w``.
    """
    _check_format(fmt)
    end = vocab_start + w.shape[0] if vocab_end is None else vocab_end
    dim = w.shape[1]
    if fmt == "bf16":
        return PleTable(fmt, w.to(torch.bfloat16).contiguous(), None, 1.0, vocab_start, end, dim)
    if fmt == "fp8_e4m3":
        codes, gs = quantize_fp8_rows(w, global_scale)
        return PleTable(fmt, codes, None, gs, vocab_start, end, dim)
    packed, bs, gs = quantize_nvfp4_rows(w, global_scale)
    return PleTable(fmt, packed, bs, gs, vocab_start, end, dim)


def slice_table(table: PleTable, start: int, end: int) -> PleTable:
    """The sub-table of global rows ``[start, end)`` (views, no copy): an ETP shard of ``table``."""
    if not table.vocab_start <= start <= end <= table.vocab_end:
        raise ValueError(f"[{start}, {end}) is not inside [{table.vocab_start}, {table.vocab_end})")
    a, b = start - table.vocab_start, end - table.vocab_start
    bs = None if table.block_scales is None else table.block_scales[a:b]
    return PleTable(table.format, table.data[a:b], bs, table.global_scale, start, end, table.dim)


def raw_row_bytes(data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Raw lookup results ``[..., W]`` (+ nvfp4 scales ``[..., S]``) as one uint8 ``[..., B]`` tensor.

    One buffer means one collective per lookup, and uint8 is a dtype every backend can sum.
    """
    lead = data.shape[:-1]
    parts = [data.contiguous().view(torch.uint8).reshape(*lead, -1)]
    if scales is not None:
        parts.append(scales.contiguous().view(torch.uint8).reshape(*lead, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def split_row_bytes(fmt: str, packed: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`raw_row_bytes`: uint8 ``[..., B]`` -> (data ``[..., W]``, scales | None)."""
    (width, dtype), scale_shape = row_shapes(fmt, dim)
    nbytes = width * torch.empty((), dtype=dtype).element_size()
    data = packed[..., :nbytes].contiguous().view(dtype)
    if scale_shape is None:
        return data, None
    return data, packed[..., nbytes : nbytes + scale_shape[0]].contiguous()
