"""Our own vLLM implementation of Qwen4-Exp: decoder layers, QSA attention, Gated DeltaNet, hyper-connections.

It serves on vLLM's CPU build and wherever ``QWEN4EXP_CUDA_MODEL=ours``; vLLM imports ``model.adapter.model``
through the lazy target that ``model.runtime.plugin`` registers. Its PLE layer is ``model.ple.vllm_layer``,
its math ``model.ops`` and ``model.kernels``; ``model.upstream`` reuses its QSA pieces.
"""
