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
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Mapping
from typing import Literal

import torch

from model import envs
from model.kernels import ple_gather as _pg
from model.ops.ple_tables import FORMATS, PleTable, fp32_exact, lookup_raw_ref, lookup_ref, row_shapes

StorageMode = Literal["device", "pinned"]

CPU_OFFLOAD_ENV = envs.PLE_CPU_OFFLOAD
PREFETCH_ENV = envs.PLE_PREFETCH

# Side-stream prefetches use at most max(8, SM count / this) programs; see PinnedHostPleStorage.
PREFETCH_SM_DIVISOR = 16

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2


# --------------------------------------------------------------------------------------------
# Page-locked host buffers of exact size
# --------------------------------------------------------------------------------------------


class _RegisteredMmap(mmap.mmap):
    """Anonymous mapping that is ``cudaHostRegister``-ed and unregistered when it is freed.

    Tensors made with ``torch.frombuffer`` keep this object alive, so the registration lasts
    exactly as long as any tensor can still be handed to a kernel.
    """

    registered_ptr: int = 0
    registered_size: int = 0

    def __del__(self) -> None:
        if self.registered_ptr:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.registered_ptr)
            except Exception:
                pass
            self.registered_ptr = 0


def _meminfo_kib(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def alloc_pinned_host(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """A uint8 host tensor of exactly ``nbytes``, page-locked and mapped for device access.

    Why not ``torch.empty(..., pin_memory=True)``: PyTorch's caching host allocator rounds every
    block up to a power of two, which for a 10-20 GiB shard can waste up to half the host RAM.
    An anonymous mmap + ``cudaHostRegister`` pins the exact size, and optionally asks for
    transparent huge pages first (``madvise(MADV_HUGEPAGE)``; measured to help small decode
    gathers on the H200 where THP is in ``madvise`` mode).
    """
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    page = mmap.PAGESIZE
    size = (nbytes + page - 1) // page * page
    mm = _RegisteredMmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    ptr = t.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(
        ptr, size, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
    )
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister({size} bytes) failed with cudaError {code}")
    mm.registered_ptr, mm.registered_size = ptr, size
    return t[:nbytes]


def _alloc_host_tensor(
    shape: tuple[int, int], dtype: torch.dtype, pin: bool, huge_pages: bool
) -> torch.Tensor:
    if not pin:
        return torch.empty(shape, dtype=dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    raw = alloc_pinned_host(shape[0] * shape[1] * elem, huge_pages=huge_pages)
    return raw.view(dtype).view(shape)


# --------------------------------------------------------------------------------------------
# UVA capability probe
# --------------------------------------------------------------------------------------------

_UVA_OK: dict[int, str | None] = {}
_UVA_LOCK = threading.Lock()


def _probe_uva(index: int) -> str | None:
    """None if a Triton kernel on GPU ``index`` reads registered host memory correctly, else why not.

    Conservative by design: rather than trusting a capability flag, pin a small buffer and
    gather rows from it with the real kernel, comparing against the expected bytes.
    """
    props = torch.cuda.get_device_properties(index)
    name = f"{props.name} (sm_{props.major}{props.minor})"
    if getattr(torch.version, "hip", None):
        return f"{name}: pinned PLE storage is only validated on CUDA, not ROCm"
    if not _pg.is_supported(torch.device("cuda", index)):
        return f"{name}: Triton has no usable GPU backend for the UVA gather kernel"
    try:
        with torch.cuda.device(index):
            host = alloc_pinned_host(64 * 16).view(64, 16)
            host.copy_(torch.arange(64 * 16, dtype=torch.int64).remainder(251).to(torch.uint8).view(64, 16))
            ids = torch.tensor([3, 0, 63, 64, -1, 17], dtype=torch.int64, device=f"cuda:{index}")
            out = torch.empty((6, 16), dtype=torch.uint8, device=f"cuda:{index}")
            _pg.ple_gather("fp8_e4m3", host, ids, 0, out, raw=True, assume_pinned=True)
            torch.cuda.synchronize(index)
            want = host[[3, 0, 63, 0, 0, 17]].clone()
            want[3:5] = 0
            if not torch.equal(out.cpu(), want):
                return f"{name}: a kernel read of registered host memory returned wrong data"
    except Exception as e:  # registration refused, illegal address, ...
        return f"{name}: pinned host memory is not accessible from the GPU ({type(e).__name__}: {e})"
    return None


def check_uva_support(device: torch.device | str | int | None = None) -> None:
    """Raise ValueError unless pinned host tables can be gathered on this CUDA ``device``."""
    if not torch.cuda.is_available():
        raise ValueError("CUDA is not available")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"UVA gather needs a CUDA device, got {dev}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _UVA_LOCK:
        if index not in _UVA_OK:
            _UVA_OK[index] = _probe_uva(index)
        why = _UVA_OK[index]
    if why is not None:
        raise ValueError(f"PLE storage mode 'pinned' is not supported on cuda:{index}: {why}")


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
        # prefetch state
        self._pf_buf: torch.Tensor | None = None
        self._pf_raw: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._pf_raw_views: tuple[torch.Tensor, torch.Tensor | None] = (torch.empty(0), None)
        self._pf_pending_raw = False
        self._pf_stream: torch.cuda.Stream | None = None
        self._pf_fork: torch.cuda.Event | None = None
        self._pf_join: torch.cuda.Event | None = None
        self._pf_pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._in_prefetch = False

    @classmethod
    def allocate(cls, fmt: str, vocab_start: int, vocab_end: int, dim: int, **kwargs) -> PleStorage:
        """Reserve uninitialized storage for rows ``[vocab_start, vocab_end)``; then ``load_rows``."""
        return cls(fmt, vocab_start, vocab_end, dim, **kwargs)

    # ---- shape / bookkeeping -------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self.vocab_end - self.vocab_start

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
                fused = _alloc_host_tensor(fused_shape, torch.uint8, pin, huge_pages)
            else:
                fused = torch.empty(fused_shape, dtype=torch.uint8, device=on)
            self.data = fused[:, : self._width]
            self.block_scales = fused[:, self._width :]
            return
        if on.type == "cpu":
            self.data = _alloc_host_tensor(shape, self._dtype, pin, huge_pages)
        else:
            self.data = torch.empty(shape, dtype=self._dtype, device=on)
        if self._scale_shape is not None:
            s_shape = (self.num_rows, self._scale_shape[0])
            if on.type == "cpu":
                self.block_scales = _alloc_host_tensor(s_shape, torch.uint8, pin, huge_pages)
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

    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for GLOBAL ``ids`` (any integer shape), dequantized to ``out_dtype``: ``[..., D]``.

        Ids this rank does not own give zero rows. With ``out`` given nothing is allocated on the
        kernel path (safe for CUDA-graph capture) and ``out`` is returned.
        """
        if not self._scale_known:
            raise RuntimeError(
                f"{self.format} PLE table: its global scale was never loaded, rows cannot be dequantized"
            )
        o = self._prep_out(ids, out, self.dim, out.dtype if out is not None else self.out_dtype)
        if not o.dtype.is_floating_point:
            raise ValueError("lookup writes floating-point rows")
        self._lookup_impl(ids, o)
        return o

    def lookup_raw(
        self,
        ids: torch.Tensor,
        out: torch.Tensor | None = None,
        out_scales: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows in the storage dtype (bf16 rows / fp8 codes / nvfp4 packed + block scales).

        Non-owned rows are zero bytes, so an integer sum over ETP ranks gives the owner's bytes;
        dequantize afterwards with ``model.ops.ple_tables.dequantize_rows``.
        """
        o = self._prep_out(ids, out, self._width, self._dtype)
        os_ = None
        if self._scale_shape is not None:
            os_ = self._prep_out(ids, out_scales, self._scale_shape[0], torch.uint8)
        self._lookup_raw_impl(ids, o, os_)
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

    def _lookup_impl(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        self._torch_lookup(ids, out)

    def _lookup_raw_impl(self, ids: torch.Tensor, out: torch.Tensor, out_scales: torch.Tensor | None) -> None:
        self._torch_lookup_raw(ids, out, out_scales)

    # ---- side-stream prefetch --------------------------------------------------------------

    def reserve_prefetch(
        self, max_ids: int, stream: torch.cuda.Stream | None = None, *, raw: bool = False
    ) -> None:
        """Preallocate the prefetch output (``max_ids`` rows), side stream and events.

        ``raw`` reserves storage-layout buffers (rows + nvfp4 scales) for :meth:`lookup_raw`
        prefetches, used when ETP ranks reduce raw bytes. Call before CUDA-graph capture:
        nothing may be allocated or created while capturing.
        """
        if raw:
            have = self._pf_raw[0].shape[0] if self._pf_raw is not None else -1
            if have < max_ids:
                data = torch.empty((max_ids, self._width), dtype=self._dtype, device=self.device)
                scales = None
                if self._scale_shape is not None:
                    scales = torch.empty(
                        (max_ids, self._scale_shape[0]), dtype=torch.uint8, device=self.device
                    )
                self._pf_raw = (data, scales)
        elif self._pf_buf is None or self._pf_buf.shape[0] < max_ids:
            self._pf_buf = torch.empty((max_ids, self.dim), dtype=self.out_dtype, device=self.device)
        if self.device.type == "cuda":
            if stream is not None:
                self._pf_stream = stream
            elif self._pf_stream is None:
                self._pf_stream = torch.cuda.Stream(self.device)
            if self._pf_fork is None:
                self._pf_fork = torch.cuda.Event()
                self._pf_join = torch.cuda.Event()

    def _reserved_rows(self, raw: bool) -> int:
        if raw:
            return -1 if self._pf_raw is None else self._pf_raw[0].shape[0]
        return -1 if self._pf_buf is None else self._pf_buf.shape[0]

    def start_prefetch(
        self, ids: torch.Tensor, stream: torch.cuda.Stream | None = None, *, raw: bool = False
    ) -> None:
        """Begin ``lookup(ids)`` (or ``lookup_raw`` with ``raw``) on a side stream.

        :meth:`wait_prefetch` (:meth:`wait_prefetch_raw`) joins and returns it. The side stream
        first waits for the current stream (so ``ids`` are ready), runs the gather into the
        reserved buffer, and records a join event. Capturable in a CUDA graph (fork/join via
        events). Without CUDA (vLLM's CPU build) the lookup simply runs now.
        """
        if self._pf_pending is not None:
            raise RuntimeError("a prefetch is already in flight; call wait_prefetch() first")
        n = ids.numel()
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        have = self._reserved_rows(raw)
        if have < n or (stream is not None and stream != self._pf_stream):
            if capturing:
                raise RuntimeError("call reserve_prefetch(max_ids) before CUDA-graph capture")
            self.reserve_prefetch(max(n, have), stream, raw=raw)

        def run() -> torch.Tensor:
            if raw:
                assert self._pf_raw is not None
                d, sc = self._pf_raw
                d_view = d[:n].view(*ids.shape, d.shape[1])
                s_view = None if sc is None else sc[:n].view(*ids.shape, sc.shape[1])
                self.lookup_raw(ids, out=d_view, out_scales=s_view)
                self._pf_raw_views = (d_view, s_view)
                return d_view
            assert self._pf_buf is not None
            view = self._pf_buf[:n].view(*ids.shape, self.dim)
            self.lookup(ids, out=view)
            return view

        if self.device.type != "cuda":
            self._pf_pending = (ids, run())
            self._pf_pending_raw = raw
            return
        assert self._pf_stream is not None and self._pf_fork is not None and self._pf_join is not None
        self._pf_fork.record(torch.cuda.current_stream(self.device))
        self._pf_stream.wait_event(self._pf_fork)
        with torch.cuda.stream(self._pf_stream):
            self._in_prefetch = True
            try:
                view = run()
            finally:
                self._in_prefetch = False
        self._pf_join.record(self._pf_stream)
        # Holding ids until the join keeps the caching allocator from reusing its memory while the
        # side stream may still read it.
        self._pf_pending = (ids, view)
        self._pf_pending_raw = raw

    @property
    def prefetch_pending(self) -> bool:
        return self._pf_pending is not None

    def _join(self, raw: bool) -> None:
        if self._pf_pending is None:
            raise RuntimeError("no prefetch in flight")
        if self._pf_pending_raw != raw:
            want = "wait_prefetch_raw" if self._pf_pending_raw else "wait_prefetch"
            raise RuntimeError(
                f"the prefetch in flight was started with raw={self._pf_pending_raw}; use {want}()"
            )
        if self.device.type == "cuda":
            assert self._pf_join is not None
            torch.cuda.current_stream(self.device).wait_event(self._pf_join)
        self._pf_pending = None

    def wait_prefetch(self) -> torch.Tensor:
        """Make the current stream wait for the prefetch and return its ``[..., D]`` rows.

        The returned tensor is a view of the reserved buffer: it is overwritten by the next
        prefetch, so consume (or copy) it first.
        """
        pending = self._pf_pending
        self._join(raw=False)
        assert pending is not None
        return pending[1]

    def wait_prefetch_raw(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Join a ``raw=True`` prefetch: ``(rows [..., W], nvfp4 scales [..., S] | None)`` views."""
        self._join(raw=True)
        return self._pf_raw_views


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

    def _lookup_impl(self, ids: torch.Tensor, out: torch.Tensor) -> None:
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
            **(self._cfg()),
        )

    def _cfg(self) -> dict[str, int | None]:
        if self._in_prefetch:
            return {**self.kernel_config, **self.prefetch_kernel_config}
        return self.kernel_config

    def _lookup_raw_impl(self, ids: torch.Tensor, out: torch.Tensor, out_scales: torch.Tensor | None) -> None:
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
            **(self._cfg()),
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


# --------------------------------------------------------------------------------------------
# Releasing checkpoint pages after a shard was copied
# --------------------------------------------------------------------------------------------

_MADV_DONTNEED = 4


def _checkpoint_mapping(addr: int, end: int) -> bool:
    """Whether ``[addr, end)`` lies in one mapping of a ``*.safetensors`` file in this process."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= addr < hi:
                    inode = fields[4]
                    path = fields[5].strip() if len(fields) > 5 else ""
                    return (
                        end <= hi and inode != "0" and path.startswith("/") and path.endswith(".safetensors")
                    )
    except (OSError, ValueError, IndexError):
        return False
    return False


def release_file_pages(t: torch.Tensor) -> int:
    """Drop this process's resident pages of ``t`` if it is a view of a mapped safetensors file.

    Why: vLLM's default safetensors iterator hands out tensors that are views of the mmapped
    checkpoint. After a shard was copied into the storage allocation its pages would stay mapped
    (and counted in RSS) until the whole file is closed, so RSS would peak at two copies of the
    tables. ``madvise(MADV_DONTNEED)`` on a file mapping unmaps the pages; a later read faults
    them in again from the file, so the tensor keeps reading the checkpoint's bytes (only an
    in-place modification of this very tensor, which loading never makes, would be undone).
    Only whole pages inside the tensor are released, and only inside a ``*.safetensors``
    mapping: anonymous memory is never touched (there it would zero the data). Linux only;
    returns the bytes released (0 if nothing was done).
    """
    if (
        t.device.type != "cpu"
        or t.numel() == 0
        or not t.is_contiguous()
        or not os.path.exists("/proc/self/maps")
    ):
        return 0
    page = mmap.PAGESIZE
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = (start + page - 1) // page * page  # only whole pages inside the tensor
    hi = end // page * page
    if hi <= lo or not _checkpoint_mapping(start, end):
        return 0
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
        return 0
    return hi - lo


# --------------------------------------------------------------------------------------------
# Environment switches (declared, parsed and documented in model.envs)
# --------------------------------------------------------------------------------------------


def storage_mode_from_env(environ: Mapping[str, str] | None = None) -> StorageMode:
    """The PLE storage mode selected by ``VLLM_PLE_CPU_OFFLOAD`` (default: on, i.e. ``"pinned"``).

    On CUDA, ``"pinned"`` keeps tables in page-locked host memory read through UVA (start-up
    fails if the GPU cannot); ``"device"`` puts them in GPU memory. On vLLM's CPU build both
    keep them in ordinary RAM and look rows up with torch; only the storage class differs.
    """
    return "pinned" if envs.read(CPU_OFFLOAD_ENV, environ) else "device"


def prefetch_from_env(cuda: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Whether PLE lookups are started early (``VLLM_PLE_PREFETCH``; default: only with CUDA).

    On CPU a "prefetch" runs synchronously at the earlier point (there is no side stream); it is
    off by default there and can be switched on to exercise the same code path in tests.
    """
    flag = envs.read(PREFETCH_ENV, environ)
    return cuda if flag is None else flag
