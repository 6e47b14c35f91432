"""FLA's recurrent kernel for short GDN prefills (``model.upstream.gdn``) on a CUDA
device, against FLA's chunked kernel that upstream would otherwise run and the fp32 reference.

Inputs in bf16 as upstream's prefill passes them; both kernels are held to the plain-torch recurrence
(``tests/upstream/gdn_short_prefill_cases.py``), the recurrent one at least as closely as the chunked.
"""

from __future__ import annotations

import pytest
import torch

from tests.upstream.gdn_short_prefill_cases import (
    CASES,
    IN_PLACE_CASES,
    batch,
    in_place_reference,
    raw_batch,
    reference,
)


@pytest.mark.parametrize("lengths", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_recurrent_matches_chunked_and_reference(lengths):
    from vllm.third_party.flash_linear_attention.ops.chunk import chunk_gated_delta_rule

    from model.upstream.gdn import recurrent_prefill

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


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16_state", "fp32_state"])
@pytest.mark.parametrize(
    "lengths,has_state", [(c[1], c[2]) for c in IN_PLACE_CASES], ids=[c[0] for c in IN_PLACE_CASES]
)
def test_in_place_path_matches_upstreams_prefill_sequence(lengths, has_state, state_dtype):
    """``gated_delta_in_place`` (one index fill + FLA's fused gating kernel on the state cache) against
    what upstream's ``_forward_core`` does for the same prefill batch (its gating launch, the state
    gather with new sequences zeroed, FLA's chunked kernel, the scatter) and the fp32 rule."""
    from vllm.third_party.flash_linear_attention.ops import fused_post_conv_prep
    from vllm.third_party.flash_linear_attention.ops.chunk import chunk_gated_delta_rule

    from model.upstream.gdn import gated_delta_in_place

    inputs = raw_batch(lengths, has_state, "cuda", torch.bfloat16, heads=4, value_heads=8, dim=128)
    inputs["ssm_state"] = inputs["ssm_state"].to(state_dtype)
    o_ref, after_ref = in_place_reference(inputs)

    ours = dict(inputs, ssm_state=inputs["ssm_state"].clone())
    o_ours = gated_delta_in_place(**ours)
    errors = {
        "ours": (
            (o_ours.float() - o_ref).abs().max().item(),
            (ours["ssm_state"][1:].float() - after_ref[1:]).abs().max().item(),
        )
    }
    if 0 not in lengths:  # upstream drops padded rows before its chunked call
        total, heads, dim = inputs["q"].shape[1:]
        conv_out = torch.cat([inputs[x].reshape(total, -1) for x in "qkv"], dim=-1)
        q, k, v, g, beta = fused_post_conv_prep(
            conv_output=conv_out, a=inputs["a"], b=inputs["b"], A_log=inputs["A_log"],
            dt_bias=inputs["dt_bias"], num_k_heads=heads, head_k_dim=dim, head_v_dim=dim,
            apply_l2norm=True, output_g_exp=False,
        )  # fmt: skip
        state = inputs["ssm_state"].clone()
        slots = inputs["state_indices"].long()
        initial = state[slots]
        initial[~inputs["has_initial_state"]] = 0
        o_up, final = chunk_gated_delta_rule(
            *(x.unsqueeze(0) for x in (q, k, v, g, beta)), initial_state=initial,
            output_final_state=True, cu_seqlens=inputs["cu_seqlens"],
        )  # fmt: skip
        state[slots] = final.to(state.dtype)
        errors["upstream"] = (
            (o_up.float() - o_ref).abs().max().item(),
            (state[1:].float() - after_ref[1:]).abs().max().item(),
        )
    print(lengths, has_state, state_dtype, "max |error| (out, state cache) vs fp32 rule:", errors)
    assert o_ours.shape == (1, sum(lengths), 8, 128) and o_ours.dtype == torch.bfloat16
    theirs = errors.get("upstream", (1e-2, 1e-2))
    for mine, their in zip(errors["ours"], theirs, strict=True):
        assert mine <= max(2 * their, 2e-2), errors
