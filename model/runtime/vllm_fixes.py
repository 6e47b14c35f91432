"""Corrections of vLLM 0.32 bugs that make a supported deployment silently wrong, applied by our plugin.

Each fix names the bug (file:line in vLLM 0.32), is applied only to the exact vLLM minor it was
written for (another version raises at start-up instead of guessing), and is tested on CPU against
vLLM's own functions (``tests/unit/test_vllm_fixes.py``) and on the GPU by the pairs that exposed
it (``tests/gpu/test_quant_marlin.py``).

**Marlin MoE gate/up scales permuted as if K were the expert width.** vLLM's int4 Marlin MoE weight
conversion (``model_executor/layers/fused_moe/oracle/int_wna16.py:686-692`` for GPTQ/compressed-
tensors, ``:834-840`` for AWQ) permutes the w13 (gate/up) scales with
``size_k=layer.intermediate_size_per_partition``; w13's K is the hidden size. The permutation
``marlin_permute_scales`` chooses (``quantization/utils/marlin_utils.py:528``) depends only on
whether ``group_size < size_k``, so whenever the per-rank expert width is <= the group size while
the hidden size is larger, it takes the per-channel ("single") permutation although the kernel
reads grouped scales: about half of the w13 scales then sit on a wrong output column (measured on
our ``tiny`` preset, experts 64 wide with 64-wide groups: 1954 of 4096, each 2x or 0.5x off). On an
RTX 3090 the real model hits it whenever a rank's expert slice is no wider than its int4 group
(e.g. 128-wide slices with group 128). The fix derives K from the scale tensor itself
(``[experts, K / group, N]``: K = groups x group size), which is right for w13 and w2 alike; for
w2 it equals what vLLM passes, and channelwise scales (group -1) are left to vLLM's argument.
"""

from __future__ import annotations

import functools

VLLM_MINOR = "0.32."


def require_vllm_minor(module: str, recheck: str) -> None:
    """Refuse to patch vLLM from ``module`` on another minor than :data:`VLLM_MINOR`; ``recheck``
    says what to re-check against the new version's code."""
    import vllm

    if not vllm.__version__.startswith(VLLM_MINOR):
        raise RuntimeError(
            f"{module} was written for vLLM {VLLM_MINOR}x and this is vLLM {vllm.__version__}: "
            f"{recheck}, then update VLLM_MINOR in model/runtime/vllm_fixes.py"
        )


def marlin_scale_size_k(scales_shape: tuple[int, ...], size_k: int, group_size: int) -> int:
    """The K a Marlin scale tensor ``[..., K / group, N]`` belongs to (``size_k`` for channelwise)."""
    if group_size > 0:
        return scales_shape[-2] * group_size
    return size_k


def fixed_marlin_moe_permute_scales(permute):
    """vLLM's ``marlin_moe_permute_scales`` with ``size_k`` taken from the scales' own group count."""
    if getattr(permute, "qwen4exp_fixed", False):
        return permute

    @functools.wraps(permute)
    def wrapper(s, size_k, size_n, group_size, is_a_8bit=False):
        return permute(
            s, marlin_scale_size_k(tuple(s.shape), size_k, group_size), size_n, group_size, is_a_8bit
        )

    wrapper.qwen4exp_fixed = True
    return wrapper


def install() -> None:
    """Apply every fix (idempotent). Called by the plugin in each vLLM process before a model loads."""
    require_vllm_minor(
        "model.runtime.vllm_fixes",
        "re-check each fix in model/runtime/vllm_fixes.py against this version's code (drop the ones it has fixed)",
    )
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    int_wna16.marlin_moe_permute_scales = fixed_marlin_moe_permute_scales(int_wna16.marlin_moe_permute_scales)
