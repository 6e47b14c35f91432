"""Host memory for PLE tables: exact-size page-locked buffers, and releasing checkpoint pages.

Why its own module: both are about this process's host address space (``mmap``,
``cudaHostRegister``, ``/proc/self/maps`` + ``madvise``), not about table formats or lookups,
and both are what keeps a ~45B-parameter table set within the host RAM of one node.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2


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


def alloc_host_tensor(
    shape: tuple[int, int], dtype: torch.dtype, pin: bool, huge_pages: bool
) -> torch.Tensor:
    """An uninitialized 2-D host tensor: page-locked (:func:`alloc_pinned_host`) or ordinary."""
    if not pin:
        return torch.empty(shape, dtype=dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    raw = alloc_pinned_host(shape[0] * shape[1] * elem, huge_pages=huge_pages)
    return raw.view(dtype).view(shape)


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
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
        return 0
    return hi - lo
