"""Hyper-connection mixing and injection against transformers' gated residual."""

from __future__ import annotations

import pytest
import torch

from model.ops.hyper_connection import gated_residual_mix, inject

from .helpers import preset_config, randomize


@pytest.mark.parametrize("preset", ["tiny", "wide"])
@pytest.mark.parametrize("with_injection", [True, False])
def test_gated_residual_matches_reference(preset, with_injection):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual

    config = preset_config(preset)
    ref = randomize(Qwen4ExpTextGatedResidual(config, use_combine=with_injection)).to(torch.bfloat16)
    streams = torch.randn(1, 9, config.hc_count * config.hidden_size).to(torch.bfloat16)
    block_out = torch.randn(1, 9, config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        result = ref(streams)
        mixed, injection = gated_residual_mix(
            streams[0],
            ref.hc_norm.weight,
            ref.input_mix_weight_down.weight,
            ref.input_mix_weight_up.weight,
            ref.block_inject_weight.weight if with_injection else None,
            config.hc_count,
            config.hidden_size,
            config.rms_norm_eps,
        )
    if not with_injection:
        assert injection is None
        torch.testing.assert_close(mixed, result[0], rtol=0, atol=0)
        return
    ref_mixed, _, ref_injection = result
    torch.testing.assert_close(mixed, ref_mixed[0], rtol=0, atol=0)
    torch.testing.assert_close(injection, ref_injection[0], rtol=0, atol=0)
    # The decoder layer's injection: every stream gets the block output times its weight.
    expected = streams + (block_out.unsqueeze(-2) * ref_injection.unsqueeze(-1)).flatten(-2)
    torch.testing.assert_close(inject(streams[0], block_out[0], injection), expected[0], rtol=0, atol=0)
