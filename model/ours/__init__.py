"""Our own vLLM implementation of Qwen4-Exp: decoder layers, QSA attention, Gated DeltaNet, PLE, hyper-connections.

It serves on vLLM's CPU build (the test reference) and wherever ``QWEN4EXP_CUDA_MODEL=ours``; vLLM imports
``model.ours.model`` through the lazy target that ``model.plugin`` registers. Its math is ``model.ops``
and ``model.kernels``, its PLE storage ``model.ple``; ``upstream_stand_ins`` are what ``upstream`` registers
on vLLM's CPU build (ours, refusing to be built).
"""
