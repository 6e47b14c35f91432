"""Everything PLE (per-layer n-gram embeddings): hashing, table format and codes, host storage, prefetch,
the Triton gather kernel, the plain-torch layer math (``reference``) and the vLLM table module.

Both implementations import it (``model.ours.ple_layer`` and ``model.upstream.ple`` through ``tables`` and
``vllm_table``); ``format``, the one reader of a checkpoint's PLE format, also serves the planner, the
quantizer and the choice of implementation (``model.deployment``).
"""
