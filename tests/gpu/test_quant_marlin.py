"""Quantized checkpoints through vLLM on CUDA (Marlin on sm_80+/sm_86): token parity with their twins.

The same pairs as ``tests/quant/test_cpu_parity.py``: the converter's int4 (compressed-tensors
W4A16, pack-quantized) and FP8 block-scaled checkpoints of the test presets against bf16 twins that
hold exactly the dequantized values (power-of-two scales). On an RTX 3090 (no FP8 math) vLLM runs
W4A16 experts and linears through Marlin and FP8 block weights as W8A16 Marlin where the shapes
allow (Marlin MoE needs hidden % 128: tiny's 128 does, wide's 192 does not, so wide exercises vLLM's
other W4A16 kernels; Marlin linears need input % 128 and output % 64 per rank); on Hopper vLLM may
pick other kernels for FP8. Every pair is checked the same way, whatever kernel ran. Skipped without CUDA and vLLM's CUDA
build (``tests/gpu/conftest.py``). Not yet run: written on a CPU-only machine.

Run: ``python -m pytest tests/gpu/test_quant_marlin.py -v``
"""

from __future__ import annotations

import pytest

from model.quantize import convert_checkpoint
from tests.conftest import ensure_checkpoint
from tests.parity.prompts import parity_prompts
from tests.quant.parity import compare, greedy_with_logprobs

from .engine import cuda_engine_args

pytestmark = pytest.mark.vllm_cuda

MAX_NEW_TOKENS = 16
# name -> (preset, format, scope)
PAIRS = {
    "tiny-w4a16-experts": ("tiny", "w4a16", "experts"),
    "tiny-w4a16-all": ("tiny", "w4a16", "all"),
    "tiny-fp8-experts": ("tiny", "fp8-block", "experts"),
    "wide-w4a16-all": ("wide", "w4a16", "all"),
    "wide-fp8-experts": ("wide", "fp8-block", "experts"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_marlin")
    out = {}
    for name, (preset, fmt, scope) in PAIRS.items():
        src = ensure_checkpoint(preset)
        for deq in (False, True):
            key = f"{name}-deq" if deq else name
            out[key] = convert_checkpoint(src, root / key, fmt, scope=scope, scales="pow2", dequantized=deq)
    return out


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_quantized_generation_equals_dequantized_twin_on_cuda(checkpoints, name):
    from transformers import AutoTokenizer

    prompts = parity_prompts(AutoTokenizer.from_pretrained(checkpoints[name]))
    engine = cuda_engine_args(max_num_seqs=8, gpu_memory_utilization=0.3)
    got = greedy_with_logprobs(checkpoints[name], prompts, MAX_NEW_TOKENS, **engine)
    want = greedy_with_logprobs(checkpoints[f"{name}-deq"], prompts, MAX_NEW_TOKENS, **engine)
    problems = compare(got, want)
    # Printed at once (run with -s): a step limit that kills pytest would lose the assertion text.
    print(f"{name}: {len(problems)} problem(s)", *problems, sep="\n", flush=True)
    assert not problems, f"{name} differs from its dequantized twin on CUDA:\n" + "\n".join(problems)
