"""The PLE UVA gather on an 8 GiB pinned table: row offsets beyond 2**31 elements read the right rows.

The real model's per-rank PLE tables are several GiB of pinned host memory, so the kernel's row
address arithmetic must not overflow 32 bits; the small-table judges in ``test_ple_gather.py`` cannot
reach such offsets. Needs 8 GiB of page-locked host memory.
"""

from __future__ import annotations

import torch

from model.ple.gather_kernel import ple_gather
from model.ple.host_memory import alloc_pinned_host

GiB = 1 << 30
DIM = 128  # bf16: 256-byte rows, as the benchmark's table


def test_gather_from_an_8_gib_pinned_table_equals_index_select():
    dev = torch.device("cuda", 0)
    nbytes = 8 * GiB
    rows = nbytes // (2 * DIM)
    host = alloc_pinned_host(nbytes)
    chunk = torch.empty(GiB, dtype=torch.uint8, device=dev)
    for off in range(0, nbytes, GiB):
        chunk.random_(0, 256)
        host[off : off + GiB].copy_(chunk)
    torch.cuda.synchronize()
    del chunk
    table = host.view(torch.bfloat16).view(rows, DIM)
    ids = torch.randint(0, rows, (8192,), device=dev)
    ids[:2] = torch.tensor([rows - 1, rows // 2], device=dev)
    out = torch.empty((8192, DIM), dtype=torch.bfloat16, device=dev)
    ple_gather("bf16", table, ids, 0, out, assume_pinned=True)
    torch.cuda.synchronize()
    expected = table.index_select(0, ids.cpu())
    assert torch.equal(out.cpu().view(torch.int16), expected.view(torch.int16))
