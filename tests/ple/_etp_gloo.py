"""ETP lookup across members with different batches over real torch.distributed (gloo) collectives.

``python -m tests.ple._etp_gloo PORT CKPT...`` spawns 3 ranks; each keeps its shard of layer 0's
table of every checkpoint in storage, looks up its own batch through
``etp_lookup_raw_across_ranks`` and prints ``ETP rank R FORMAT equal`` when the dequantized rows
equal the full table's reference rows bit for bit.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 3


def member(rank: int, port: str, paths: list[str]) -> None:
    from model.ops.ple_storage import storage_from_table
    from model.ops.ple_tables import (
        TorchDistEtpCollectives,
        dequantize_rows,
        etp_lookup_raw_across_ranks,
        lookup_ref,
        shard_bounds,
        slice_table,
    )
    from model.ple_quantize import read_tables

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        comm = TorchDistEtpCollectives()
        for path in paths:
            full = read_tables(path)["model.layers.0.ple.ple_embedding"]
            lo, hi = shard_bounds(full.num_rows, rank, WORLD)
            storage = storage_from_table("pinned", slice_table(full, lo, hi), device="cpu")
            g = torch.Generator().manual_seed(rank)
            ids = torch.randint(-1, full.num_rows + 1, ((5, 0, 40)[rank], 4), generator=g)
            data, scales = etp_lookup_raw_across_ranks(
                full.format, full.dim, storage.lookup_raw, ids, 160, comm
            )
            got = dequantize_rows(full.format, data, scales, full.global_scale)
            want = lookup_ref(full, ids)
            if torch.equal(got.view(torch.int16), want.view(torch.int16)):
                print(f"ETP rank {rank} {full.format} equal", flush=True)
            else:
                print(f"ETP rank {rank} {full.format} DIFFERENT", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(member, args=(sys.argv[1], sys.argv[2:]), nprocs=WORLD)
