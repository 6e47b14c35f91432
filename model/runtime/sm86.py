"""``QWEN4EXP_FORCE_SM86=1``: make a newer NVIDIA GPU take every choice an RTX 3090 takes.

The product is built for RTX 3090s (sm_86), but where no 3090 is at hand its paths are tested on
Hopper (sm_90) cards, where vLLM and upstream would otherwise choose differently. With this switch:

- Gated DeltaNet prefill: Triton/FLA (``gdn_prefill_backend=triton``), what vLLM picks on sm_86;
  without it vLLM picks FlashInfer's sm_90 kernel on Hopper.
- Quantized weights: Marlin (vLLM's choice below sm_89 for FP8 and for int4 on Ampere); the
  service passes ``VLLM_TEST_FORCE_FP8_MARLIN=1``.
- QSA FP8 cache: our E4M3 bit-manipulation reader (used on every GPU already).
- Kernel tiles: sized for 101,376 bytes of shared memory per block (a 3090's opt-in limit), not
  the card's own (:mod:`model.upstream.indexer_tiles`).
- Hyper-connections: no CuTe-DSL down+SiLU kernel (sm_90+ only), vLLM's linear layer as on sm_86
  (:mod:`model.upstream.optional_kernels`).

Only the standard library and :mod:`model.runtime.envs` here: the service reads it before vLLM is imported.
"""

from __future__ import annotations

from collections.abc import Mapping

from model.runtime import envs

VARIABLE = envs.FORCE_SM86
SHARED_MEMORY_PER_BLOCK = 101376  # an RTX 3090's cudaDevAttrMaxSharedMemoryPerBlockOptin
CAPABILITY = (8, 6)


def forced(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``QWEN4EXP_FORCE_SM86`` asks for the 3090's choices (:class:`model.runtime.envs.EnvError` if
    malformed; the service validates it at start-up with the other variables)."""
    return bool(envs.read(VARIABLE, env))
