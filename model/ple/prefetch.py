"""Side-stream prefetch of one PLE table's rows: the single owner of all prefetch state.

Why: the PCIe latency of a gather from pinned host memory hides behind the decoder layer that
runs before the PLE layer needs its rows. This object holds everything such a prefetch needs
and everything about the one in flight: the output buffers (reserved before CUDA-graph
capture, since nothing may be allocated while capturing), the side stream, the fork/join
events, the ids being read (kept alive until the join so the caching allocator cannot reuse
them while the side stream reads), whether it is a raw-bytes lookup, and the caller's context
(the PLE layer's step), so no other object needs to remember that a prefetch was started.

Without CUDA (vLLM's CPU build) a prefetch simply runs the lookup at ``start``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class RowLookups(Protocol):
    """What a prefetch needs from a table's storage (``model.ple.storage.PleStorage``).

    A protocol rather than an import: the storage owns its prefetch, so importing it back here
    would make the two modules import each other.
    """

    device: torch.device
    dim: int
    out_dtype: torch.dtype

    @property
    def row_layout(self) -> tuple[tuple[int, torch.dtype], tuple[int, torch.dtype] | None]: ...

    def lookup(self, ids: torch.Tensor, out: torch.Tensor, *, side_stream: bool) -> Any: ...

    def lookup_raw(
        self, ids: torch.Tensor, out: torch.Tensor, out_scales: Any, *, side_stream: bool
    ) -> Any: ...


@dataclass
class _InFlight:
    ids: torch.Tensor
    rows: torch.Tensor  # dequantized [..., D], or raw data [..., W]
    scales: torch.Tensor | None  # raw nvfp4 scales [..., S]
    raw: bool
    context: Any


class SideStreamPrefetch:
    """``reserve`` once, then per step ``start(ids)`` ... ``wait()`` (or ``wait_raw()``)."""

    def __init__(self, storage: RowLookups) -> None:
        self.storage = storage
        self._buf: torch.Tensor | None = None
        self._raw: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._fork: torch.cuda.Event | None = None
        self._join: torch.cuda.Event | None = None
        self._in_flight: _InFlight | None = None

    @property
    def _cuda(self) -> bool:
        return self.storage.device.type == "cuda"

    def reserve(self, max_ids: int, stream: torch.cuda.Stream | None = None, *, raw: bool = False) -> None:
        """Preallocate the output (``max_ids`` rows), side stream and events.

        ``raw`` reserves storage-layout buffers (rows + nvfp4 scales) for ``lookup_raw``
        prefetches, used when ETP ranks reduce raw bytes. Call before CUDA-graph capture.
        """
        st = self.storage
        (width, dtype), scale_shape = st.row_layout
        if raw:
            if self._reserved_rows(raw=True) < max_ids:
                data = torch.empty((max_ids, width), dtype=dtype, device=st.device)
                scales = None
                if scale_shape is not None:
                    scales = torch.empty((max_ids, scale_shape[0]), dtype=torch.uint8, device=st.device)
                self._raw = (data, scales)
        elif self._reserved_rows(raw=False) < max_ids:
            self._buf = torch.empty((max_ids, st.dim), dtype=st.out_dtype, device=st.device)
        if self._cuda:
            if stream is not None:
                self._stream = stream
            elif self._stream is None:
                self._stream = torch.cuda.Stream(st.device)
            if self._fork is None:
                self._fork = torch.cuda.Event()
                self._join = torch.cuda.Event()

    def _reserved_rows(self, raw: bool) -> int:
        if raw:
            return -1 if self._raw is None else self._raw[0].shape[0]
        return -1 if self._buf is None else self._buf.shape[0]

    @property
    def pending(self) -> bool:
        return self._in_flight is not None

    @property
    def context(self) -> Any:
        """What the caller passed to :meth:`start` for the prefetch in flight (None if none)."""
        return None if self._in_flight is None else self._in_flight.context

    def start(
        self,
        ids: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
        *,
        raw: bool = False,
        context: Any = None,
    ) -> None:
        """Begin ``lookup(ids)`` (``lookup_raw`` with ``raw``) on the side stream.

        The side stream first waits for the current stream (so ``ids`` are ready), gathers into
        the reserved buffer and records the join event; capturable in a CUDA graph.
        """
        if self._in_flight is not None:
            raise RuntimeError("a prefetch is already in flight; call wait_prefetch() first")
        n = ids.numel()
        have = self._reserved_rows(raw)
        if have < n or (stream is not None and stream != self._stream):
            if self._cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("call reserve_prefetch(max_ids) before CUDA-graph capture")
            self.reserve(max(n, have), stream, raw=raw)
        if not self._cuda:
            self._in_flight = self._run(ids, raw, context)
            return
        assert self._stream is not None and self._fork is not None and self._join is not None
        self._fork.record(torch.cuda.current_stream(self.storage.device))
        self._stream.wait_event(self._fork)
        with torch.cuda.stream(self._stream):
            self._in_flight = self._run(ids, raw, context)
        self._join.record(self._stream)

    def _run(self, ids: torch.Tensor, raw: bool, context: Any) -> _InFlight:
        st = self.storage
        n = ids.numel()
        if raw:
            assert self._raw is not None
            d, sc = self._raw
            rows = d[:n].view(*ids.shape, d.shape[1])
            scales = None if sc is None else sc[:n].view(*ids.shape, sc.shape[1])
            st.lookup_raw(ids, out=rows, out_scales=scales, side_stream=True)
            return _InFlight(ids, rows, scales, raw, context)
        assert self._buf is not None
        rows = self._buf[:n].view(*ids.shape, st.dim)
        st.lookup(ids, out=rows, side_stream=True)
        return _InFlight(ids, rows, None, raw, context)

    def _take(self, raw: bool) -> _InFlight:
        f = self._in_flight
        if f is None:
            raise RuntimeError("no prefetch in flight")
        if f.raw != raw:
            want = "wait_prefetch_raw" if f.raw else "wait_prefetch"
            raise RuntimeError(f"the prefetch in flight was started with raw={f.raw}; use {want}()")
        if self._cuda:
            assert self._join is not None
            torch.cuda.current_stream(self.storage.device).wait_event(self._join)
        self._in_flight = None
        return f

    def wait(self) -> torch.Tensor:
        """Make the current stream wait for the prefetch and return its ``[..., D]`` rows.

        A view of the reserved buffer: the next prefetch overwrites it, so consume it first.
        """
        return self._take(raw=False).rows

    def wait_raw(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Join a ``raw=True`` prefetch: ``(rows [..., W], nvfp4 scales [..., S] | None)`` views."""
        f = self._take(raw=True)
        return f.rows, f.scales

    def drop(self) -> None:
        """Join and discard the prefetch in flight, if any (its step was abandoned)."""
        if self._in_flight is not None:
            self._take(self._in_flight.raw)
