"""What every vLLM process and the service import at run time: the plugin and what it installs.

vLLM calls ``model.runtime.plugin:register`` (the ``vllm.general_plugins`` entry point) in each of its
processes; it registers ``model.adapter`` or ``model.upstream`` lazily and installs the engine guard,
the vLLM fixes and the detokenizer priming. The service validates ``envs`` and resolves the
implementation (``cuda_model_choice``) before vLLM starts; both implementations import the checks.
"""
