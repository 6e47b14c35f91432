"""Import vLLM's own CUDA Qwen4-Exp modules on vLLM's CPU build, for tests of our subclasses' glue.

Why: upstream's ``vllm.models.qwen4_exp.nvidia`` package imports ``qwen3_vl``, which imports
torchvision; vLLM's CPU wheel does not pull torchvision in, so the import fails on this build although
nothing we test needs torchvision (with the stand-in below, ``nvidia.model``,
``nvidia.qsa`` and ``common.ngram_embedding`` import on the CPU build). The stand-in is installed
only when torchvision is really absent, only for the test process that asks for it, and every
attribute of it is an inert placeholder: a test that reached torchvision's behaviour would be
testing nothing, so none may.

The CUDA kernels upstream calls are still absent here; tests built on this import exercise
constructors, weight creation, loaders and our own torch/Triton code paths, and the GPU judges in
``tests/gpu`` run the rest.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

_TORCHVISION_MODULES = (
    "torchvision",
    "torchvision.io",
    "torchvision.ops",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
    "torchvision.transforms.InterpolationMode",
)


class _Placeholder(types.ModuleType):
    """Any attribute is another placeholder; calling one returns a placeholder."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _Placeholder(f"{self.__name__}()")


def _install_torchvision_placeholder() -> None:
    if importlib.util.find_spec("torchvision") is not None or "torchvision" in sys.modules:
        return
    for name in _TORCHVISION_MODULES:
        module = _Placeholder(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        module.__version__ = "0.0.0+placeholder"
        sys.modules[name] = module


def import_upstream(module: str) -> types.ModuleType:
    """``importlib.import_module(module)`` for a module of (or importing) upstream's CUDA Qwen4-Exp."""
    _install_torchvision_placeholder()
    # Upstream's package has an import cycle (``nvidia.qsa`` <-> ``nvidia.model``) that resolves only
    # when ``nvidia.model`` is imported first, as vLLM's registry does.
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")
    return importlib.import_module(module)
