"""PLE table formats, quantizers and the plain-torch reference lookup.

Qwen4-Exp's PLE layers read hashed n-gram embedding tables (~45B parameters in total). They are
far too large for 24 GiB cards, so the serving stack keeps them in host memory and gathers rows
on demand. This module is the single definition of what a table *is* (layout and dequantization
rule); the Triton kernel (``model.kernels.ple_gather``) and the storage backends
(``model.ops.ple_storage``) are tested bit for bit against :func:`lookup_ref` here.

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
where vLLM and a GPU may be absent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.ple_format import FORMATS, TableFormat, parse_format

__all__ = ["FORMATS", "TableFormat", "parse_format"]  # re-exported: the format names live in model.ple_format

NVFP4_BLOCK = 16
"""Values per NVFP4 block scale."""

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Midpoints between consecutive E2M1 magnitudes: bucketize() against them rounds to nearest.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# Rows processed per chunk by the quantizers, so converting a multi-GiB shard does not need
# several fp32 copies of it at once.
_QUANT_CHUNK_ROWS = 1 << 16


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown PLE table format {fmt!r}; expected one of {FORMATS}")


def fp32_exact(x: float) -> float:
    """Round a Python float to the nearest fp32 value.

    Global scales are stored as fp32 in checkpoints and passed to kernels as fp32 scalars; keeping
    the Python-side value fp32-exact means every path multiplies by the very same number.
    """
    return float(torch.tensor(x, dtype=torch.float32).item())


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


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn variant: no infinities, 0x7F/0xFF are NaN) codes -> fp32, exact."""
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (bit 3 = sign) -> fp32, exact. Code 8 decodes to -0.0, like the kernel.

    Decoded by re-biasing through the fp16 bit layout (``s ee m`` -> ``s 000ee m000000000`` is
    ``value * 2**-14``) rather than a lookup table: no host-to-device constant is created, so the
    torch path stays legal inside CUDA-graph capture.
    """
    c = codes.to(torch.int16)
    bits = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    return bits.view(torch.float16).to(torch.float32) * 16384.0


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


# --------------------------------------------------------------------------------------------
# Quantizers (tests and checkpoint conversion)
# --------------------------------------------------------------------------------------------


def _encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 codes (uint8), saturating at +-448 so no NaN codes are ever produced."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _global_amax(w: torch.Tensor) -> float:
    amax = 0.0
    for r0 in range(0, w.shape[0], _QUANT_CHUNK_ROWS):
        chunk = w[r0 : r0 + _QUANT_CHUNK_ROWS]
        if chunk.numel():
            amax = max(amax, float(chunk.abs().max().float().item()))
    if amax != amax or amax in (float("inf"), float("-inf")):
        raise ValueError("table contains NaN/inf")
    return amax


def fp8_global_scale(amax: float) -> float:
    """The fp32 global scale that maps a table absmax of ``amax`` to E4M3's 448 (1.0 for all-zero)."""
    scale = fp32_exact(amax / E4M3_MAX) if amax > 0 else 1.0
    if scale == 0.0:  # amax is tiny enough that amax/448 underflows fp32
        scale = fp32_exact(float.fromhex("0x1p-149"))
    return scale


def nvfp4_global_scale(amax: float) -> float:
    """The fp32 global scale that maps a table absmax to ``448 * 6`` (E4M3 block scale x E2M1 max)."""
    scale = fp32_exact(amax / (E4M3_MAX * E2M1_MAX)) if amax > 0 else 1.0
    if scale == 0.0:
        scale = fp32_exact(float.fromhex("0x1p-149"))
    return scale


def table_amax(parts) -> float:
    """Absmax over several ``[rows, D]`` pieces of one table (e.g. its checkpoint shards).

    Why: a PLE table has ONE global scale, but checkpoints split it into ``split_ngram_parts``
    shards; converting shard by shard needs the whole table's absmax first.
    """
    return max((_global_amax(p) for p in parts), default=0.0)


def _check_given_scale(global_scale: float) -> float:
    gs = fp32_exact(global_scale)
    if not (gs > 0.0 and gs != float("inf")):
        raise ValueError(f"global scale must be a finite positive fp32 value, got {global_scale}")
    return gs


def quantize_fp8_rows(w_bf16: torch.Tensor, global_scale: float | None = None) -> tuple[torch.Tensor, float]:
    """``[V, D]`` float -> ``(uint8 E4M3 codes [V, D], fp32 global scale)``.

    One per-tensor scale maps the table's absmax to 448; rounding is torch's round-to-nearest-even
    cast to float8_e4m3fn. An all-zero table gets scale 1.0. ``global_scale`` overrides the
    scale (values beyond ``448 * scale`` saturate): used to quantize the shards of one table with
    the scale of the whole table.
    """
    if w_bf16.dim() != 2:
        raise ValueError("expected a 2-D [rows, dim] tensor")
    if global_scale is None:
        scale = fp8_global_scale(_global_amax(w_bf16))
    else:
        scale = _check_given_scale(global_scale)
    scale_t = torch.tensor(scale, dtype=torch.float32)
    codes = torch.empty(w_bf16.shape, dtype=torch.uint8, device=w_bf16.device)
    for r0 in range(0, w_bf16.shape[0], _QUANT_CHUNK_ROWS):
        chunk = w_bf16[r0 : r0 + _QUANT_CHUNK_ROWS].float()
        codes[r0 : r0 + _QUANT_CHUNK_ROWS] = _encode_e4m3(chunk / scale_t)
    return codes, scale


def _encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already divided by its scale) -> 4-bit codes, nearest magnitude, sign in bit 3.

    Zero magnitudes never carry the sign bit, so the quantizer never emits -0 (code 8).
    """
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = torch.bucketize(x.abs().clamp(max=E2M1_MAX), mids).to(torch.uint8)
    sign = ((x < 0) & (mag != 0)).to(torch.uint8) << 3
    return mag | sign


def quantize_nvfp4_rows(
    w_bf16: torch.Tensor, global_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``[V, D]`` float -> ``(packed uint8 [V, D/2], E4M3 block scales uint8 [V, D/16], fp32 scale)``.

    Two-level scaling as in NVIDIA's NVFP4: the global scale maps the table absmax to
    ``448 * 6`` so block scales use E4M3's full range; each block of 16 values gets the E4M3 scale
    nearest to ``block_amax / 6 / global``, and values are rounded to the nearest E2M1 magnitude
    after dividing by the *decoded* block scale (so quantization error is measured against what
    the kernel will actually reconstruct). ``global_scale`` overrides the table-level scale (to
    quantize every checkpoint shard of one table with the whole table's scale).
    """
    if w_bf16.dim() != 2:
        raise ValueError("expected a 2-D [rows, dim] tensor")
    rows, dim = w_bf16.shape
    if dim % NVFP4_BLOCK != 0:
        raise ValueError(f"nvfp4 needs dim divisible by {NVFP4_BLOCK}, got {dim}")
    if global_scale is None:
        gscale = nvfp4_global_scale(_global_amax(w_bf16))
    else:
        gscale = _check_given_scale(global_scale)
    packed = torch.empty((rows, dim // 2), dtype=torch.uint8, device=w_bf16.device)
    scales = torch.empty((rows, dim // NVFP4_BLOCK), dtype=torch.uint8, device=w_bf16.device)
    min_sub = float.fromhex("0x1p-9")  # smallest positive E4M3 subnormal
    for r0 in range(0, rows, _QUANT_CHUNK_ROWS):
        x = w_bf16[r0 : r0 + _QUANT_CHUNK_ROWS].float()
        n = x.shape[0]
        blocks = x.reshape(n, dim // NVFP4_BLOCK, NVFP4_BLOCK)
        bamax = blocks.abs().amax(dim=-1)
        want = bamax / (E2M1_MAX * gscale)
        # A non-zero block must not get a zero scale (it would vanish entirely).
        want = torch.where(bamax > 0, want.clamp(min=min_sub), torch.zeros_like(want))
        s_codes = _encode_e4m3(want)
        s_vals = decode_e4m3(s_codes) * gscale  # effective per-block scale, fp32
        denom = torch.where(s_vals > 0, s_vals, torch.ones_like(s_vals))
        q = _encode_e2m1(blocks / denom[..., None]).reshape(n, dim)
        q = torch.where(s_vals.repeat_interleave(NVFP4_BLOCK, dim=-1) > 0, q, torch.zeros_like(q))
        packed[r0 : r0 + n] = q[:, 0::2] | (q[:, 1::2] << 4)
        scales[r0 : r0 + n] = s_codes
    return packed, scales, gscale


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


# --------------------------------------------------------------------------------------------
# ETP groups whose members hold different batches (groups spanning data-parallel ranks)
# --------------------------------------------------------------------------------------------
#
# Within one tensor-parallel group every rank sees the same ids, so each rank looks up the rows
# it owns and the partial results are all-reduced. When the embedding-parallel group spans
# data-parallel replicas, members hold different batches. Then every member publishes its ids in
# a fixed number of slots (padded with -1, an id nobody owns), looks up ALL members' slots in its
# own shard, and a reduce-scatter hands each member the sum over the group of the rows of its own
# slots. Every row has exactly one owner, so the sum is done on raw bytes (uint8): exact for bf16
# rows, fp8 codes and nvfp4 packed codes + block scales alike, and 1 or ~0.56 bytes per value
# travel instead of 2.


def etp_pad_ids(ids: torch.Tensor, capacity: int) -> torch.Tensor:
    """``ids`` flattened into ``capacity`` int64 slots, padded with -1 (never owned -> zero rows).

    A fixed capacity (e.g. ``max_num_batched_tokens * heads``) keeps every collective's shape
    static, which CUDA graphs need and which lets members with different batch sizes meet.
    """
    flat = ids.reshape(-1)
    if flat.numel() > capacity:
        raise ValueError(f"{flat.numel()} ids do not fit in {capacity} ETP slots")
    out = torch.full((capacity,), -1, dtype=torch.int64, device=ids.device)
    out[: flat.numel()] = flat.to(torch.int64)
    return out


def etp_select_own(reduced: torch.Tensor, rank: int, num_ids: int) -> torch.Tensor:
    """Member ``rank``'s first ``num_ids`` slots of a group-wide ``[G, capacity, ...]`` result.

    The all-reduce formulation of the last step (reduce everything, keep your own block), for
    backends without reduce-scatter; a reduce-scatter returns exactly this block.
    """
    return reduced[rank, :num_ids]


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


class EtpCollectives:
    """The two collectives an ETP lookup needs, over ``world_size`` members (``rank`` is ours).

    ``all_gather(t)`` returns ``[world_size, *t.shape]``; ``reduce_scatter_sum(t)`` takes
    ``[world_size, *rest]`` from every member and returns ``sum over members of t[rank]``.
    """

    rank: int
    world_size: int

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def reduce_scatter_sum(self, t: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class TorchDistEtpCollectives(EtpCollectives):
    """:class:`EtpCollectives` over a ``torch.distributed`` process group.

    NCCL uses ``all_gather_into_tensor``/``reduce_scatter_tensor``; other backends (gloo, on CPU)
    fall back to list all-gather and all-reduce + :func:`etp_select_own`.
    """

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._nccl = dist.get_backend(group) == "nccl"

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = t.new_empty((self.world_size, *t.shape))
        if self._nccl:
            self._dist.all_gather_into_tensor(out, t, group=self.group)
        else:
            self._dist.all_gather(list(out.unbind(0)), t, group=self.group)
        return out

    def reduce_scatter_sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if self._nccl:
            out = t.new_empty(t.shape[1:])
            self._dist.reduce_scatter_tensor(out, t, group=self.group)
            return out
        buf = t.clone()
        self._dist.all_reduce(buf, group=self.group)
        return buf[self.rank]


def etp_lookup_raw_across_ranks(
    fmt: str,
    dim: int,
    lookup_raw,
    ids: torch.Tensor,
    capacity: int,
    comm: EtpCollectives,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw rows for this member's ``ids`` from a table sharded over an ETP group of different batches.

    ``lookup_raw(ids)`` is this member's shard lookup (e.g. ``PleStorage.lookup_raw``) returning
    ``(data, scales | None)`` with zero bytes for rows it does not own. Steps: pad ids into
    ``capacity`` slots, all-gather every member's slots, look them all up locally, reduce-scatter
    the raw bytes (sum; one owner per row makes it exact), keep this member's ``ids.numel()``
    rows. Returns ``(data [*ids.shape, W], scales [*ids.shape, S] | None)`` in storage layout;
    dequantize with :func:`dequantize_rows`.
    """
    n = ids.numel()
    slots = etp_pad_ids(ids, capacity)
    gathered = comm.all_gather(slots)  # [G, capacity]
    data, scales = lookup_raw(gathered)
    mine = comm.reduce_scatter_sum(raw_row_bytes(data, scales))  # [capacity, B]
    d, s = split_row_bytes(fmt, mine[:n], dim)
    d = d.reshape(*ids.shape, d.shape[-1])
    return d, None if s is None else s.reshape(*ids.shape, s.shape[-1])
