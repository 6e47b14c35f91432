"""Thin subclasses of vLLM's own CUDA ``qwen4_exp`` that add the RTX 3090's parts.

Our FP8 QSA cache and PLE table formats, short GDN prefills in one launch, indexer tiles sized for the
GPU, checks of optional kernels. vLLM imports ``model.upstream.model`` through the lazy target that
``model.plugin`` registers where upstream serves; ``UPSTREAM_CUDA.md`` here maps upstream's code.
"""
