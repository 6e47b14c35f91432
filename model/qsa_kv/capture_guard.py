"""Keep our background readers off the GPU while a CUDA graph is being captured.

Why: PyTorch captures in ``"global"`` error mode by default (vLLM's breakable and piecewise
captures do), where a CUDA call from *any* thread that could touch the capturing stream (a copy,
an event wait, a pinned allocation) fails and invalidates the capture. Our clip-counter reader and
calibration collector copy their counters on a side stream from their own threads every interval;
one such read landing inside vLLM's start-up capture stops an FP8 engine ("operation not permitted
when stream is capturing"). Graph capture and those reads exclude each other through one lock: ``torch.cuda.CUDAGraph.capture_begin`` takes it (waiting
for a read in flight, a few milliseconds) and ``capture_end`` releases it; a reader that cannot get
it within its timeout skips that round (the counters are monotonic, the next round catches up).
Breakable graphs end a segment before each eager break and begin a new one after it, so readers
may also run during those breaks, when nothing is capturing.

:func:`install` wraps the two methods once per process (idempotent); it is called before the
readers start, which is before vLLM's capture (the readers start when the layers' scales are
applied after loading).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

_lock = threading.RLock()
_installed = False


def install() -> None:
    """Make every CUDA graph capture of this process hold the reader lock from begin to end."""
    global _installed
    import torch

    if _installed or not hasattr(torch.cuda, "CUDAGraph"):
        return
    graph = torch.cuda.CUDAGraph
    begin, end = graph.capture_begin, graph.capture_end

    @functools.wraps(begin)
    def capture_begin(self, *args, **kwargs):
        _lock.acquire()
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            _lock.release()
            raise

    @functools.wraps(end)
    def capture_end(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            _lock.release()

    graph.capture_begin, graph.capture_end = capture_begin, capture_end
    _installed = True


@contextlib.contextmanager
def gpu_access(timeout_s: float = 2.0) -> Iterator[bool]:
    """``with gpu_access() as ok:`` -- ``ok`` is False when a capture held the GPU past ``timeout_s``
    (then the caller must not touch the GPU this round)."""
    ok = _lock.acquire(timeout=timeout_s)
    try:
        yield ok
    finally:
        if ok:
            _lock.release()
