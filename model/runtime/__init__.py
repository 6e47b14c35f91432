"""What every vLLM process runs, on the floor above the math: variables, guards, metrics, vLLM fixes.

``envs`` declares every model environment variable with its one parser; ``additional_config`` names
this project's section of vLLM's configuration; ``engine_guard``, ``vllm_fixes`` and
``detokenize_prime`` are installed by ``model.plugin`` in each vLLM process. Nothing here imports a
higher floor (see ``model/__init__.py``).
"""
