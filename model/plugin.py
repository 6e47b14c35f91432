"""vLLM general plugin: registers a Qwen4-Exp implementation for both architecture names.

vLLM runs ``register()`` in every process (API server, engine core, workers, its registry's
inspection subprocess). Registering under the upstream names replaces vLLM's built-in CUDA-only
Qwen4Exp; ``QWEN4EXP_CUDA_MODEL`` (:mod:`model.runtime.envs`) says with what:

* ``auto`` (default): ``ours`` on vLLM's CPU build (the only one there), ``upstream`` on CUDA
  (7-16x faster, the same tokens: ``docs/design/upstream-on-cuda.md``). The service resolves the
  deployment before vLLM starts (``model.deployment.resolve``), from config.json and the GPU, and
  hands vLLM's processes the implementation it chose (``ours`` where upstream cannot serve the
  checkpoint): registration happens before any configuration exists, so this one value comes
  through the environment (``Deployment.child_environment``), the rest through ``additional_config``.
* ``ours``: this plugin's implementation (``model.ours.model``), on vLLM's CPU build and on
  CUDA (V1 runner, no CUDA graphs; any checkpoint shape).
* ``upstream``, on CUDA: vLLM's own implementation behind thin subclasses
  (``model.upstream.model``) that add the RTX 3090's parts and stop start-up, listing
  every reason, where it lacks a feature ours has or needs a setting that is missing
  (``model.deployment.implementation``).
* ``upstream``, on vLLM's CPU build (decided by vLLM's own ``vllm_version_matches_substr``, as
  ``service.cuda_preflight`` does; no GPU is touched): upstream cannot run there, and serving ours
  under that name would hide the misconfiguration, so the registered classes are stand-ins
  (``model.ours.upstream_stand_ins``) whose construction raises the problem list naming
  ``QWEN4EXP_CUDA_MODEL``.

Targets are lazy ``module:Class`` strings, so upstream's module is imported only when vLLM needs
the class. A malformed ``QWEN4EXP_CUDA_MODEL`` raises here (the service refuses it earlier).

It also installs the engine guard (``model.runtime.engine_guard``), so that one failing model step fails
its requests instead of the whole engine, and our corrections of vLLM bugs that would make a
supported deployment silently wrong (``model.runtime.vllm_fixes``), and primes the front end's detokenizer
with the prompt's last tokens instead of the whole prompt (``model.runtime.detokenize_prime``: an 8k-token
prompt's first token waited milliseconds on decoding the prompt).
"""

from __future__ import annotations

from model.deployment import implementation
from model.runtime import envs


def register() -> None:
    from vllm import ModelRegistry

    from model.runtime import detokenize_prime, engine_guard, vllm_fixes

    engine_guard.install()
    vllm_fixes.install()
    detokenize_prime.install()

    targets = implementation.registration_targets(
        envs.cuda_model(), cpu_build=implementation.vllm_is_cpu_build()
    )
    for arch, target in targets.items():
        ModelRegistry.register_model(arch, target)
