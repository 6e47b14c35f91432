"""FLA's recurrent kernel for short GDN prefills (``model.vllm_adapter.upstream_gdn``) on a CUDA
device, against FLA's chunked kernel that upstream would otherwise run and the fp32 reference.

Inputs in bf16 as upstream's prefill passes them; both kernels are held to the plain-torch recurrence
(``tests/upstream/gdn_short_prefill_cases.py``), the recurrent one at least as closely as the chunked.
"""

from __future__ import annotations

import pytest
import torch

from tests.upstream.gdn_short_prefill_cases import CASES, batch, reference


@pytest.mark.parametrize("lengths", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_recurrent_matches_chunked_and_reference(lengths):
    from vllm.third_party.flash_linear_attention.ops.chunk import chunk_gated_delta_rule

    from model.vllm_adapter.upstream_gdn import recurrent_prefill

    # Real head sizes (128) and value heads per key head (2): the shapes the kernels tile for.
    q, k, v, g, beta, state, cu = batch(lengths, "cuda", torch.bfloat16, heads=4, value_heads=8, dim=128)
    before = state.clone()
    o_rec, final_rec = recurrent_prefill(q, k, v, g, beta, state, cu)
    o_chunk, final_chunk = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state.clone(), output_final_state=True, cu_seqlens=cu
    )
    o_ref, final_ref = reference(q, k, v, g, beta, state, cu)
    errors = {
        "recurrent": (
            (o_rec.float() - o_ref).abs().max().item(),
            (final_rec.float() - final_ref).abs().max().item(),
        ),
        "chunked": (
            (o_chunk.float() - o_ref).abs().max().item(),
            (final_chunk.float() - final_ref).abs().max().item(),
        ),
    }
    print(lengths, "max |error| (out, state) vs fp32 reference:", errors)
    assert torch.equal(state, before)
    assert o_rec.shape == o_chunk.shape and final_rec.shape == final_chunk.shape
    assert o_rec.dtype == o_chunk.dtype
    for mine, theirs in zip(errors["recurrent"], errors["chunked"], strict=True):
        assert mine <= max(2 * theirs, 2e-2), errors
