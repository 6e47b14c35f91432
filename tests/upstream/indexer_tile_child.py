"""Child process of ``test_indexer_tiles_launch.py``: upstream's indexer prefill kernel under Triton's
interpreter (float32 operands), launched by upstream's own launcher and by ours with a smaller tile,
both against a torch reference of the score. Prints one JSON line."""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from tests.kernels.sm86_compile import load_ops  # noqa: E402  (real Triton for upstream's modules)


def main() -> None:
    ops = load_ops()["qsa_indexer"]
    upstream_launcher = ops._prefill_logits
    from model.upstream import indexer_tiles as tiles

    tiles._device_facts.cache_clear()
    tiles._tile_for.cache_clear()
    tiles._device_facts = lambda: (101376, 86)  # a 3090: 16 heads of 128 take TILE_R=16
    tiles.install()
    ours = ops._prefill_logits
    g = torch.Generator().manual_seed(0)
    heads, dim, page, pages = 16, 128, 20, 7
    lens = [37, 70]  # two requests, query rows packed
    rows = sum(lens)
    q = torch.randn(rows, heads, dim, generator=g)
    k_cache = torch.randn(pages * 2, page, dim, generator=g)
    page_table = torch.tensor([[3, 1, 4, 0, 5, 2, 6], [7, 9, 11, 13, 8, 10, 12]], dtype=torch.int32)
    qsl = torch.tensor([0, lens[0], rows], dtype=torch.int32)
    visible = torch.cat([torch.arange(1, n + 1) * 1 for n in lens]).to(torch.int32)  # causal-like
    width = 128
    args = (q, k_cache, page_table, qsl, visible)
    out_up = upstream_launcher(*args, torch.full((rows * width,), -7.0), max(lens), width, 0, rows).clone()
    out_ours = ours(*args, torch.full((rows * width,), -7.0), max(lens), width, 0, rows).clone()
    # reference: score[r, c] = sum_h relu(k[c] . q[r, h]) for c < visible[r]
    ref = torch.full((rows, width), -7.0)
    for r in range(rows):
        req = 0 if r < lens[0] else 1
        for c in range(int(visible[r])):
            key = k_cache[page_table[req, c // page], c % page]
            ref[r, c] = torch.relu(q[r] @ key).sum()
    print(json.dumps({
        "tile": tiles._tile_for(heads, dim, False)[0],
        "upstream_vs_ref": float((out_up - ref).abs().max()),
        "ours_vs_ref": float((out_ours - ref).abs().max()),
        "ours_vs_upstream": float((out_ours - out_up).abs().max()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
