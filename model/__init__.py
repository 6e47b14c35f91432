"""Qwen4-Exp on vLLM: the plugin, two model implementations and the offline tools.

- ``runtime``: what every vLLM process and the service import at run time (plugin, variables, guards).
- ``adapter``: our own vLLM implementation of the model; ``upstream``: vLLM's own CUDA one with our parts.
- ``ple``: everything PLE; ``qsa_kv``: the FP8 QSA KV cache; ``ops``/``kernels``: torch references, Triton.
- ``tools``: offline command-line tools (``python -m model.tools.planner`` ...) and the test checkpoints.
"""
