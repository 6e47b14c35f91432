"""Qwen4-Exp on vLLM: the plugin, two model implementations and the offline tools, on floors.

Each package imports only from the floors below it (``tests/unit/test_import_graph.py``):

0. ``ops`` (plain-torch references), ``kernels`` (Triton);
1. ``runtime``: what every vLLM process runs (variables, guards, metrics, vLLM fixes);
2. ``qsa_kv`` (the FP8 QSA KV cache), ``ple`` (everything PLE);
3. ``deployment``: the deployment resolved once, and which implementation can serve it;
4. ``ours`` (our vLLM implementation), ``upstream`` (vLLM's own CUDA one with our parts), ``tools``
   (offline command-line tools and the test checkpoints);
5. ``plugin``: vLLM's entry point, registering an implementation and installing our runtime patches.
"""
