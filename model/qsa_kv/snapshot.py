"""Read small device tensors from a background thread without stalling the model.

A plain ``tensor.cpu()`` from another thread would enqueue the copy on the compute stream (and a
``.item()`` in the forward would synchronise every step). Instead the copy goes on a private side
stream into pinned host memory (``non_blocking=True``) and only the reader thread waits for it, on
an event. The side stream does not wait for the compute stream either, so a read may miss the
additions of kernels still in flight; the counters are monotonic, so the next read catches up.
On the CPU there is no stream to protect and a plain copy is used. While a CUDA graph is being
captured the read waits, or returns ``None`` for that round (:mod:`model.qsa_kv.capture_guard`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import capture_guard


class DeviceSnapshot:
    """Copies of a fixed set of device tensors, refreshed by ``read()`` (call from one thread only).

    ``tensors`` is a callable returning the current tensors, so layers are looked up at read time
    (their buffers are what the forward updates, even if a module was moved after registration).
    """

    def __init__(self, tensors: Callable[[], Sequence[torch.Tensor]]) -> None:
        self._tensors = tensors
        self._stream: torch.cuda.Stream | None = None
        self._event: torch.cuda.Event | None = None
        self._host: list[torch.Tensor] = []
        self._device: torch.device | None = None
        if torch.cuda.is_available():
            capture_guard.install()  # before any capture: snapshots exist from attach time on

    def _prepare_cuda(self, current: Sequence[torch.Tensor]) -> None:
        device = current[0].device
        shapes = [(t.shape, t.dtype) for t in current]
        if self._device == device and [(h.shape, h.dtype) for h in self._host] == shapes:
            return
        torch.cuda.set_device(device)  # thread-local: this thread may not have used the GPU yet
        self._device = device
        self._stream = torch.cuda.Stream(device=device)
        self._event = torch.cuda.Event()
        self._host = [torch.empty(s, dtype=d, pin_memory=True) for s, d in shapes]

    def read(self) -> list[torch.Tensor] | None:
        """The tensors' current values on the host; ``None`` when a graph capture kept the GPU busy."""
        current = list(self._tensors())
        if not current:
            return []
        if current[0].device.type != "cuda":
            return [t.detach().to("cpu", copy=True) for t in current]
        with capture_guard.gpu_access() as ok:
            if not ok:
                return None
            self._prepare_cuda(current)
            assert self._stream is not None and self._event is not None
            with torch.cuda.stream(self._stream):
                for host, dev in zip(self._host, current, strict=True):
                    host.copy_(dev, non_blocking=True)
                self._event.record(self._stream)
            self._event.synchronize()  # blocks this reader thread only
            return [h.clone() for h in self._host]
