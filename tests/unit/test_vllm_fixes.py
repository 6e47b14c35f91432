"""``model.runtime.vllm_fixes`` against vLLM's own functions, on the CPU (the GPU pairs in
``tests/gpu/test_quant_marlin.py`` show the effect on tokens)."""

from __future__ import annotations

import pytest
import torch

from model.runtime import vllm_fixes


def test_marlin_moe_w13_scales_get_the_grouped_permutation():
    from vllm.model_executor.layers.quantization.utils import marlin_utils

    experts, hidden, width, group = 2, 128, 64, 64  # the tiny preset: expert width == group < hidden
    w13 = torch.randn(experts, hidden // group, 2 * width)
    fixed = vllm_fixes.fixed_marlin_moe_permute_scales(marlin_utils.marlin_moe_permute_scales)
    # What vLLM 0.32 calls (size_k = the expert width) ...
    buggy = marlin_utils.marlin_moe_permute_scales(w13, width, 2 * width, group)
    got = fixed(w13, width, 2 * width, group)
    want = torch.stack(
        [marlin_utils.marlin_permute_scales(w13[e], hidden, 2 * width, group) for e in range(experts)]
    )
    assert torch.equal(got, want)
    moved = (buggy != want).float().mean().item()
    assert moved > 0.3, f"the test shape must expose the bug ({moved:.0%} of scales moved)"

    # w2 (K = the expert width, which vLLM already passes) and channelwise scales are unchanged.
    w2 = torch.randn(experts, width // group, hidden)
    assert torch.equal(
        fixed(w2, width, hidden, group), marlin_utils.marlin_moe_permute_scales(w2, width, hidden, group)
    )
    channelwise = torch.randn(experts, 1, hidden)
    assert torch.equal(
        fixed(channelwise, width, hidden, -1),
        marlin_utils.marlin_moe_permute_scales(channelwise, width, hidden, -1),
    )
    # 32-wide groups: both permutations agree (the GPU's control pair).
    w13_g32 = torch.randn(experts, hidden // 32, 2 * width)
    assert torch.equal(
        fixed(w13_g32, width, 2 * width, 32),
        marlin_utils.marlin_moe_permute_scales(w13_g32, width, 2 * width, 32),
    )


def test_install_rebinds_once_and_refuses_another_vllm(monkeypatch):
    import vllm
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    # vLLM may have loaded our plugin in this process already (then the name holds the fix).
    original = getattr(
        int_wna16.marlin_moe_permute_scales, "__wrapped__", int_wna16.marlin_moe_permute_scales
    )
    monkeypatch.setattr(int_wna16, "marlin_moe_permute_scales", original)
    vllm_fixes.install()
    vllm_fixes.install()
    assert int_wna16.marlin_moe_permute_scales.qwen4exp_fixed
    assert int_wna16.marlin_moe_permute_scales.__wrapped__ is original
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"written for vLLM 0\.32\.x and this is vLLM 0\.33\.0"):
        vllm_fixes.install()
