"""Whether this GPU can gather PLE rows from page-locked host memory: probed, not assumed.

Why a probe kernel launch instead of a capability flag: pinned storage is the default
(``VLLM_PLE_CPU_OFFLOAD=1``) and a GPU that reports unified addressing but reads wrong bytes
would serve garbage silently. The probe pins a small buffer, gathers rows from it with the real
Triton kernel and compares; the verdict is cached per device.
"""

from __future__ import annotations

import threading

import torch

from model.ple import gather_kernel as _pg
from model.ple.host_memory import alloc_pinned_host

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
