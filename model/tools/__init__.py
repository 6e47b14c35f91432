"""Offline tools, run as ``python -m model.tools.<name>``: the fit planner (``planner``,
``planner_speed``; its expert formats live in ``model.runtime.expert_format``), the checkpoint
converters (``quantize``, ``quantize_gptq_awq``, ``ple_quantize``) and the test checkpoints and
inputs (``checkpoints``, ``cases``).

The model code that vLLM runs never imports them; the service's preflight checks and its converter
(``python -m service.convert``) import the planner.
"""
