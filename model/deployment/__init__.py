"""The deployment, decided once: ``resolve`` (the facts in, a frozen ``Deployment`` out),
``implementation`` (every reason vLLM's own CUDA Qwen4-Exp cannot serve, and the choice) and
``indexer_tile_fit`` (whether upstream's indexer prefill fits the GPU's shared memory).

Pure functions of injected facts, so every decision is tested on a CPU-only machine; the service's
start-up and preflight call ``resolve``, vLLM's processes read its result from ``additional_config``.
"""
