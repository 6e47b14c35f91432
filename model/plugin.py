"""vLLM general plugin: registers our Qwen4-Exp implementation for both architecture names.

vLLM runs ``register()`` in every process (API server, engine core, workers). Registering under
the upstream names replaces vLLM's built-in CUDA-only Qwen4Exp with ours, which also runs on
vLLM's CPU build. It also installs the engine guard (``model.engine_guard``), so that one failing
model step fails its requests instead of the whole engine.
"""

from __future__ import annotations

ARCHITECTURES = {
    "Qwen4ExpForCausalLM": "model.vllm_adapter.model:Qwen4ExpForCausalLM",
    "Qwen4ExpForConditionalGeneration": "model.vllm_adapter.model:Qwen4ExpForConditionalGeneration",
}


def register() -> None:
    from vllm import ModelRegistry

    from model import engine_guard

    engine_guard.install()

    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
