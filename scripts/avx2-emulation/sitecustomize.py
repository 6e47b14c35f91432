"""Makes torch and vLLM's CPU build in this Python process take an AVX2-only CPU's paths.

Loaded by ``scripts/as-avx2.sh`` (it puts this folder first on ``PYTHONPATH``), so it runs in every
Python process of the command, vLLM's engine and workers included. vLLM picks its CPU kernels from
``torch.cpu._is_avx512_supported`` / ``_is_avx512_bf16_supported`` / ``_is_amx_tile_supported``
(``vllm/platforms/cpu.py``: the ``_C_AVX2`` library, GDN states in bf16 and so 128-token prefix
blocks, the torch causal conv, no AMX or AVX-512 attention); answering False to each sends it down
those paths. torch's own kernels are limited by the variables the script sets.
"""

import os

if os.environ.get("EMULATE_CPU_KIND_AVX2") == "1":
    import torch

    for _name in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_avx512_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
