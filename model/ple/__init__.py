"""Everything PLE (per-layer n-gram embeddings): hashing, table format and codes, host storage, prefetch,
the Triton gather kernel, the plain-torch layer math (``reference``) and the vLLM layer and table.

Both implementations import it (``model.adapter`` through ``vllm_layer``, ``model.upstream.ple`` through
``tables`` and ``vllm_table``); ``format``, the one reader of a checkpoint's PLE format, also serves the
planner, the quantizer and the service's choice of implementation.
"""
