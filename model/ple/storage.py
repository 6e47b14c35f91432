"""Storage backends for PLE tables: on a device, or in pinned host memory read through UVA.

Why two backends behind one interface: the full Qwen4-Exp PLE tables (~45B params) cannot sit
in a 24 GiB RTX 3090, so production keeps each rank's shard in page-locked host memory and the
GPU gathers rows through unified virtual addressing (one PCIe read per row, dequantized in the
same kernel). Small models and tests keep tables on the device (or on the CPU) and use the plain
torch path. The model layer only sees :class:`PleStorage`.

Loading is two-phase: ``allocate`` (or :func:`make_storage`) reserves exactly the shard's
bytes, then ``load_rows`` copies checkpoint shards straight into that allocation, so peak host
memory stays near one table plus one checkpoint shard, never two full copies.

``lookup(ids, out=...)`` writes into a caller-provided buffer and allocates nothing on the
pinned/CUDA path, so it can be captured in a CUDA graph. ``start_prefetch``/``wait_prefetch``
run the lookup on a side stream (fork/join through events, capturable too) so that the PCIe
latency of the gather hides behind the layers computed before the PLE layer needs its rows.

Neighbours in ``model.ple``, one concern each: ``host_memory`` (exact-size pinned buffers, releasing
checkpoint pages), ``uva`` (the GPU-reads-pinned-memory probe), ``prefetch`` (all
prefetch state), ``tables`` (what a table is), ``quantizers`` (offline encoders).
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

from model.ple import gather_kernel as _pg
from model.ple.host_memory import alloc_host_tensor
from model.ple.prefetch import SideStreamPrefetch
from model.ple.tables import FORMATS, PleTable, fp32_exact, lookup_raw_ref, lookup_ref, row_shapes
from model.ple.uva import check_uva_support

StorageMode = Literal["device", "pinned"]

# Side-stream prefetches use at most max(8, SM count / this) programs; see PinnedHostPleStorage.
PREFETCH_SM_DIVISOR = 16


# --------------------------------------------------------------------------------------------
# Storage backends
# --------------------------------------------------------------------------------------------


def _merge_interval(intervals: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted([*intervals, (a, b)]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


class PleStorage:
    """One rank's PLE table shard, rows ``[vocab_start, vocab_end)``, plus its lookup path.

    Subclasses decide where the tensors live and how rows are gathered. ``device`` is the
    *compute* device: where ids are expected and outputs are written.
    """

    mode: str = ""

    def __init__(
        self,
        fmt: str,
        vocab_start: int,
        vocab_end: int,
        dim: int,
        *,
        global_scale: float | None = 1.0,
        device: torch.device | str | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown PLE table format {fmt!r}; expected one of {FORMATS}")
        if vocab_end < vocab_start:
            raise ValueError(f"bad vocab range [{vocab_start}, {vocab_end})")
        if fmt == "bf16" and global_scale not in (None, 1.0):
            raise ValueError("bf16 tables have no global scale")
        self.format = fmt
        self.vocab_start = int(vocab_start)
        self.vocab_end = int(vocab_end)
        self.dim = int(dim)
        # ``global_scale=None`` defers it: checkpoints store the scale in its own tensor, which
        # may arrive after the rows; rows are raw codes, so they can be stored before it is known.
        self._scale_known = global_scale is not None or fmt == "bf16"
        self.global_scale = fp32_exact(1.0 if global_scale is None else global_scale)
        self.out_dtype = out_dtype
        self.device = torch.device(device) if device is not None else _default_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        (self._width, self._dtype), self._scale_shape = row_shapes(fmt, dim)
        self.data: torch.Tensor
        self.block_scales: torch.Tensor | None = None
        self._loaded: list[tuple[int, int]] = []
        self._loaded_scales: list[tuple[int, int]] = []
        self.prefetch = SideStreamPrefetch(self)

    @classmethod
    def allocate(cls, fmt: str, vocab_start: int, vocab_end: int, dim: int, **kwargs) -> PleStorage:
        """Reserve uninitialized storage for rows ``[vocab_start, vocab_end)``; then ``load_rows``."""
        return cls(fmt, vocab_start, vocab_end, dim, **kwargs)

    # ---- shape / bookkeeping -------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self.vocab_end - self.vocab_start

    @property
    def row_layout(self) -> tuple[tuple[int, torch.dtype], tuple[int, torch.dtype] | None]:
        """Storage layout of one row: (width, dtype) and the nvfp4 scales' (width, dtype) | None."""
        return (self._width, self._dtype), self._scale_shape

    @property
    def table(self) -> PleTable:
        """The storage tensors as a :class:`PleTable` (views, no copy)."""
        return PleTable(
            self.format,
            self.data,
            self.block_scales,
            self.global_scale,
            self.vocab_start,
            self.vocab_end,
            self.dim,
        )

    def table_bytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        if self.block_scales is not None:
            n += self.block_scales.numel()
        return n

    def pinned_bytes(self) -> int:
        """Bytes of page-locked host memory held by this table (0 unless pinned on CUDA)."""
        return 0

    @property
    def location(self) -> str:
        """Where the rows live: ``"device"`` (GPU memory), ``"pinned"`` (page-locked host memory
        read through UVA) or ``"cpu"`` (ordinary RAM: vLLM's CPU build)."""
        return "cpu" if self.data.device.type == "cpu" else "device"

    @property
    def global_scale_known(self) -> bool:
        return self._scale_known

    def set_global_scale(self, value: float) -> None:
        """Fix the table's fp32 global scale; a later, different value raises ValueError.

        Why fail instead of overwrite: rows quantized with another scale would decode silently
        wrong, and one table has exactly one scale.
        """
        if self.format == "bf16":
            raise ValueError("bf16 tables have no global scale")
        v = fp32_exact(value)
        if not (v > 0.0 and v != float("inf")):
            raise ValueError(f"global scale must be a finite positive fp32 value, got {value}")
        if self._scale_known and v != self.global_scale:
            raise ValueError(f"global scale {value} differs from the table's {self.global_scale}")
        self.global_scale = v
        self._scale_known = True

    @property
    def fully_loaded(self) -> bool:
        """Every row (and, for nvfp4, every block-scale row) stored and the global scale known."""
        return self.missing_rows() == 0 and self.missing_scale_rows() == 0 and self._scale_known

    def missing_rows(self) -> int:
        return self.num_rows - sum(e - s for s, e in self._loaded)

    def missing_scale_rows(self) -> int:
        """Rows whose nvfp4 block scales are not loaded yet (0 for formats without them)."""
        if self._scale_shape is None:
            return 0
        return self.num_rows - sum(e - s for s, e in self._loaded_scales)

    def _alloc(self, on: torch.device, pin: bool, huge_pages: bool, interleave: bool = False) -> None:
        """Allocate uninitialized tensors; ``interleave`` puts nvfp4 scales inside each data row.

        Interleaved nvfp4 rows (``[packed D/2 | scales D/16]``) make a row lookup touch one
        host region instead of two; ``data``/``block_scales`` are then row-strided views.
        """
        shape = (self.num_rows, self._width)
        if interleave and self._scale_shape is not None:
            s_w = self._scale_shape[0]
            fused_shape = (self.num_rows, self._width + s_w)
            if on.type == "cpu":
                fused = alloc_host_tensor(fused_shape, torch.uint8, pin, huge_pages)
            else:
                fused = torch.empty(fused_shape, dtype=torch.uint8, device=on)
            self.data = fused[:, : self._width]
            self.block_scales = fused[:, self._width :]
            return
        if on.type == "cpu":
            self.data = alloc_host_tensor(shape, self._dtype, pin, huge_pages)
        else:
            self.data = torch.empty(shape, dtype=self._dtype, device=on)
        if self._scale_shape is not None:
            s_shape = (self.num_rows, self._scale_shape[0])
            if on.type == "cpu":
                self.block_scales = alloc_host_tensor(s_shape, torch.uint8, pin, huge_pages)
            else:
                self.block_scales = torch.empty(s_shape, dtype=torch.uint8, device=on)

    def _overlap(self, row_start: int, n: int) -> tuple[slice, slice, int, int] | None:
        a = max(int(row_start), self.vocab_start)
        b = min(int(row_start) + n, self.vocab_end)
        if a >= b:
            return None
        return slice(a - row_start, b - row_start), slice(a - self.vocab_start, b - self.vocab_start), a, b

    def load_data_rows(self, row_start: int, rows: torch.Tensor) -> int:
        """Copy the storage-layout ``rows`` (first row = GLOBAL id ``row_start``) that this rank owns.

        Separate from the block scales because checkpoints keep them in separate tensors; each is
        copied straight into the allocation as it arrives (no staging copy of a shard).
        """
        if rows.dim() != 2 or rows.shape[1] != self._width or rows.dtype != self._dtype:
            raise ValueError(
                f"rows must be {self._dtype} [n, {self._width}], got {rows.dtype} {list(rows.shape)}"
            )
        ov = self._overlap(row_start, rows.shape[0])
        if ov is None:
            return 0
        src, dst, a, b = ov
        self.data[dst].copy_(rows[src])
        self._loaded = _merge_interval(self._loaded, a, b)
        return b - a

    def load_block_scale_rows(self, row_start: int, block_scales: torch.Tensor) -> int:
        """nvfp4: copy the owned part of uint8 E4M3 block scales ``[n, D/16]`` into the allocation."""
        if self._scale_shape is None:
            raise ValueError(f"{self.format} tables have no block scales")
        s_w = self._scale_shape[0]
        if block_scales.dim() != 2 or block_scales.shape[1] != s_w or block_scales.dtype != torch.uint8:
            raise ValueError(
                f"nvfp4 block scales must be uint8 [n, {s_w}], got "
                f"{block_scales.dtype} {list(block_scales.shape)}"
            )
        ov = self._overlap(row_start, block_scales.shape[0])
        if ov is None:
            return 0
        src, dst, a, b = ov
        assert self.block_scales is not None
        self.block_scales[dst].copy_(block_scales[src])
        self._loaded_scales = _merge_interval(self._loaded_scales, a, b)
        return b - a

    def load_rows(
        self,
        row_start: int,
        rows: torch.Tensor,
        block_scales: torch.Tensor | None = None,
        *,
        global_scale: float | None = None,
    ) -> int:
        """Copy checkpoint rows whose first row has GLOBAL id ``row_start`` into the allocation.

        ``rows`` (and, for nvfp4, ``block_scales``) are in storage layout. Only the part that
        overlaps this rank's range is copied, so every rank can be handed whole checkpoint shards.
        ``global_scale``, when given, must equal the storage's (or fixes it if still unknown):
        data quantized with another scale would silently decode wrong. Returns the number of rows
        stored.
        """
        if rows.dim() != 2 or rows.shape[1] != self._width or rows.dtype != self._dtype:
            raise ValueError(
                f"rows must be {self._dtype} [n, {self._width}], got {rows.dtype} {list(rows.shape)}"
            )
        if self._scale_shape is not None:
            if block_scales is None or tuple(block_scales.shape) != (rows.shape[0], self._scale_shape[0]):
                raise ValueError(f"nvfp4 rows need uint8 block_scales [n, {self._scale_shape[0]}]")
        elif block_scales is not None:
            raise ValueError(f"{self.format} tables have no block scales")
        if global_scale is not None and self.format != "bf16":
            self.set_global_scale(global_scale)
        elif global_scale is not None and fp32_exact(global_scale) != 1.0:
            raise ValueError("bf16 tables have no global scale")
        n = self.load_data_rows(row_start, rows)
        if block_scales is not None:
            self.load_block_scale_rows(row_start, block_scales)
        return n

    def load_table(self, table: PleTable) -> int:
        """Load every overlapping row of ``table`` (a full table or any shard of it)."""
        if table.format != self.format or table.dim != self.dim:
            raise ValueError("table format/dim mismatch")
        return self.load_rows(
            table.vocab_start, table.data, table.block_scales, global_scale=table.global_scale
        )

    # ---- lookups ---------------------------------------------------------------------------

    def _prep_out(
        self, ids: torch.Tensor, out: torch.Tensor | None, width: int, dtype: torch.dtype
    ) -> torch.Tensor:
        shape = (*ids.shape, width)
        if out is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        if out.numel() != ids.numel() * width or out.dtype != dtype or out.device != self.device:
            raise ValueError(
                f"out must be {dtype} {list(shape)} on {self.device}, got {out.dtype} {list(out.shape)}"
            )
        return out

    def lookup(
        self, ids: torch.Tensor, out: torch.Tensor | None = None, *, side_stream: bool = False
    ) -> torch.Tensor:
        """Rows for GLOBAL ``ids`` (any integer shape), dequantized to ``out_dtype``: ``[..., D]``.

        Ids this rank does not own give zero rows. With ``out`` given nothing is allocated on the
        kernel path (safe for CUDA-graph capture) and ``out`` is returned. ``side_stream``: the
        call is a prefetch (pinned storage then caps the kernel's grid, see its docstring).
        """
        if not self._scale_known:
            raise RuntimeError(
                f"{self.format} PLE table: its global scale was never loaded, rows cannot be dequantized"
            )
        o = self._prep_out(ids, out, self.dim, out.dtype if out is not None else self.out_dtype)
        if not o.dtype.is_floating_point:
            raise ValueError("lookup writes floating-point rows")
        self._lookup_impl(ids, o, side_stream)
        return o

    def lookup_raw(
        self,
        ids: torch.Tensor,
        out: torch.Tensor | None = None,
        out_scales: torch.Tensor | None = None,
        *,
        side_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows in the storage dtype (bf16 rows / fp8 codes / nvfp4 packed + block scales).

        Non-owned rows are zero bytes, so an integer sum over ETP ranks gives the owner's bytes;
        dequantize afterwards with ``model.ple.tables.dequantize_rows``.
        """
        o = self._prep_out(ids, out, self._width, self._dtype)
        os_ = None
        if self._scale_shape is not None:
            os_ = self._prep_out(ids, out_scales, self._scale_shape[0], torch.uint8)
        self._lookup_raw_impl(ids, o, os_, side_stream)
        return o, os_

    def _torch_lookup(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        res = lookup_ref(self.table, ids, out_dtype=out.dtype)
        out.copy_(res.reshape(out.shape))

    def _torch_lookup_raw(
        self, ids: torch.Tensor, out: torch.Tensor, out_scales: torch.Tensor | None
    ) -> None:
        d, s = lookup_raw_ref(self.table, ids)
        out.copy_(d.reshape(out.shape))
        if out_scales is not None and s is not None:
            out_scales.copy_(s.reshape(out_scales.shape))

    def _lookup_impl(self, ids: torch.Tensor, out: torch.Tensor, side_stream: bool) -> None:
        self._torch_lookup(ids, out)

    def _lookup_raw_impl(
        self, ids: torch.Tensor, out: torch.Tensor, out_scales: torch.Tensor | None, side_stream: bool
    ) -> None:
        self._torch_lookup_raw(ids, out, out_scales)

    # ---- side-stream prefetch (state in ``self.prefetch``, model.ple.prefetch) ---------

    def reserve_prefetch(
        self, max_ids: int, stream: torch.cuda.Stream | None = None, *, raw: bool = False
    ) -> None:
        """Preallocate the prefetch output, side stream and events (before CUDA-graph capture)."""
        self.prefetch.reserve(max_ids, stream, raw=raw)

    def start_prefetch(
        self, ids: torch.Tensor, stream: torch.cuda.Stream | None = None, *, raw: bool = False
    ) -> None:
        """Begin ``lookup(ids)`` (``lookup_raw`` with ``raw``) on the side stream."""
        self.prefetch.start(ids, stream, raw=raw)

    @property
    def prefetch_pending(self) -> bool:
        return self.prefetch.pending

    def wait_prefetch(self) -> torch.Tensor:
        """Join the prefetch; its ``[..., D]`` rows (a view the next prefetch overwrites)."""
        return self.prefetch.wait()

    def wait_prefetch_raw(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Join a ``raw=True`` prefetch: ``(rows [..., W], nvfp4 scales [..., S] | None)``."""
        return self.prefetch.wait_raw()


class DevicePleStorage(PleStorage):
    """Tables resident on the compute device (GPU or CPU); lookups use the plain torch path.

    For models whose tables fit in memory, and as the reference backend on GPUs.
    """

    mode = "device"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._alloc(self.device, pin=False, huge_pages=False)


class PinnedHostPleStorage(PleStorage):
    """Tables in page-locked host memory, gathered by the Triton kernel through UVA on CUDA.

    Without CUDA (vLLM's CPU platform) the tables are ordinary host memory and the torch path
    is used, so the same model code runs everywhere. ``kernel_config`` holds launch overrides
    (``rows_per_program``, ``num_warps``, ``max_programs``) for :func:`ple_gather`;
    ``prefetch_kernel_config`` is merged over it for side-stream prefetches.

    Why prefetches cap the grid: a gather over PCIe keeps its programs resident while they wait
    on host memory; with one program per row block it fills every SM and the layer it should
    overlap with cannot start. Measured on an H200 (132 SMs; 8,192 rows of 256 B beside a
    decode-sized bf16 layer, CUDA graphs): the uncapped grid hid 4-6% of the lookup, 8 programs
    70-87%, 16 programs 71-77%, 64 programs 52%; with 2,048 rows 8 programs hid all of it.
    Lookups on the main stream keep the uncapped grid (capping only slows a lone gather).

    nvfp4 scales are interleaved into each row by default (``interleave_scales``): a random row
    then touches one host region instead of two, which measured 2.1x faster at 8,192 rows and
    1.6x at 65,536 (H200, the host-side address translation being the bottleneck, see
    ``bench/gpu_ple_gather.py``).
    """

    mode = "pinned"

    def __init__(self, *args, huge_pages: bool = False, interleave_scales: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._uva = self.device.type == "cuda"
        if self._uva:
            check_uva_support(self.device)
        self.huge_pages = huge_pages
        self.kernel_config: dict[str, int | None] = {}
        self.prefetch_kernel_config: dict[str, int | None] = {}
        if self._uva:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.prefetch_kernel_config["max_programs"] = max(8, sms // PREFETCH_SM_DIVISOR)
        with torch.cuda.device(self.device) if self._uva else contextlib.nullcontext():
            self._alloc(
                torch.device("cpu"), pin=self._uva, huge_pages=huge_pages, interleave=interleave_scales
            )

    def pinned_bytes(self) -> int:
        return self.table_bytes() if self._uva else 0

    @property
    def location(self) -> str:
        return "pinned" if self._uva else "cpu"

    def _lookup_impl(self, ids: torch.Tensor, out: torch.Tensor, side_stream: bool) -> None:
        if not self._uva:
            self._torch_lookup(ids, out)
            return
        _pg.ple_gather(
            self.format,
            self.data,
            ids,
            self.vocab_start,
            out,
            block_scales=self.block_scales,
            global_scale=self.global_scale,
            assume_pinned=True,
            **self._cfg(side_stream),
        )

    def _cfg(self, side_stream: bool) -> dict[str, int | None]:
        if side_stream:
            return {**self.kernel_config, **self.prefetch_kernel_config}
        return self.kernel_config

    def _lookup_raw_impl(
        self, ids: torch.Tensor, out: torch.Tensor, out_scales: torch.Tensor | None, side_stream: bool
    ) -> None:
        if not self._uva:
            self._torch_lookup_raw(ids, out, out_scales)
            return
        _pg.ple_gather(
            self.format,
            self.data,
            ids,
            self.vocab_start,
            out,
            block_scales=self.block_scales,
            global_scale=self.global_scale,
            raw=True,
            out_scales=out_scales,
            assume_pinned=True,
            **self._cfg(side_stream),
        )


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_storage(
    mode: StorageMode,
    fmt: str,
    vocab_start: int,
    vocab_end: int,
    dim: int,
    *,
    global_scale: float | None = 1.0,
    device: torch.device | str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    huge_pages: bool = False,
    interleave_scales: bool = True,
) -> PleStorage:
    """Allocate (uninitialized) storage for rows ``[vocab_start, vocab_end)``; fill with ``load_rows``.

    ``global_scale=None`` (fp8/nvfp4) leaves the scale to be set by ``set_global_scale`` or
    ``load_rows(global_scale=...)``, as checkpoint loading does.

    ``huge_pages`` and ``interleave_scales`` (nvfp4 scales stored inside each row, one host
    access per looked-up row) apply to ``"pinned"`` only. ``mode="pinned"`` on a CUDA platform
    raises ValueError when the GPU cannot read pinned host
    memory through the Triton kernel (checked by an actual probe); it never falls back to
    ``"device"`` silently, since that would try to put tens of GiB in VRAM.
    """
    kw = dict(global_scale=global_scale, device=device, out_dtype=out_dtype)
    if mode == "device":
        return DevicePleStorage(fmt, vocab_start, vocab_end, dim, **kw)
    if mode == "pinned":
        return PinnedHostPleStorage(
            fmt, vocab_start, vocab_end, dim, huge_pages=huge_pages, interleave_scales=interleave_scales, **kw
        )
    raise ValueError(f"unknown PLE storage mode {mode!r}; expected 'device' or 'pinned'")


def storage_from_table(
    mode: StorageMode,
    table: PleTable,
    vocab_start: int | None = None,
    vocab_end: int | None = None,
    **kwargs,
) -> PleStorage:
    """Allocate storage for ``[vocab_start, vocab_end)`` (default: the table's range) and load it."""
    a = table.vocab_start if vocab_start is None else vocab_start
    b = table.vocab_end if vocab_end is None else vocab_end
    st = make_storage(mode, table.format, a, b, table.dim, global_scale=table.global_scale, **kwargs)
    st.load_table(table)
    return st
