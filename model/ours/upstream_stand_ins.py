"""What ``QWEN4EXP_CUDA_MODEL=upstream`` registers on vLLM's CPU build: ours, refusing to be built.

Why stand-ins rather than an error at registration: vLLM registers model classes in every process
before any configuration exists, and its inspection and config checks before construction must
behave as for a real class; the refusal then comes at construction, listing every reason upstream
cannot serve (the first being that upstream needs CUDA), instead of serving ours under the name
``upstream``. Own class names, so vLLM's model-info cache (keyed by module and class name) never
mixes them with ours.
"""

from __future__ import annotations

from model.deployment.implementation import refuse_unless_upstream_can_serve
from model.ours.model import Qwen4ExpForCausalLM as _OursForCausalLM
from model.ours.model import Qwen4ExpForConditionalGeneration as _OursForConditionalGeneration


class Qwen4ExpForCausalLMRefusedOnCpuBuild(_OursForCausalLM):
    """``QWEN4EXP_CUDA_MODEL=upstream`` on vLLM's CPU build: refuses to be constructed."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        refuse_unless_upstream_can_serve(vllm_config, cpu_build=True)
        raise AssertionError("unreachable: the CPU build is always a problem for upstream")


class Qwen4ExpForConditionalGenerationRefusedOnCpuBuild(_OursForConditionalGeneration):
    """``QWEN4EXP_CUDA_MODEL=upstream`` on vLLM's CPU build: refuses to be constructed."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        refuse_unless_upstream_can_serve(vllm_config, cpu_build=True)
        raise AssertionError("unreachable: the CPU build is always a problem for upstream")
