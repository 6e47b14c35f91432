"""Offline tools, run as ``python -m model.tools.<name>``: the fit planner (``planner``, ``planner_quant``,
``planner_speed``), the checkpoint converters (``quantize``, ``quantize_gptq_awq``, ``ple_quantize``) and
the test checkpoints and inputs (``checkpoints``, ``cases``).

No vLLM process imports them; the service imports the planner for its preflight and its converter.
"""
