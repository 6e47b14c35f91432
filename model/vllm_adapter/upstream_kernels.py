"""Which of upstream Qwen4-Exp's optional CUDA kernels can run in this installation.

Why: on sm_90+ upstream's hyper-connection picks a CuTe-DSL "down projection + SiLU" kernel for
1-48 tokens, and both its warm-up and its first call import ``cutlass.cute`` (``nvidia-cutlass-dsl``)
and ``quack`` (``quack-kernels``). ``pip install vllm==0.32.*`` brings both, so the image has them;
an environment assembled without them (our GPU test bundle, a ``--no-deps`` install) cannot start
the engine at all. Where they are missing, the same merged projection then runs through vLLM's
linear layer and upstream's own SiLU, which is upstream's path for every other batch size; the
numbers are the same GEMM in another kernel. A warning says so. An RTX 3090 (sm_86) never selects
the CuTe-DSL kernel, so there this changes nothing.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging

logger = logging.getLogger(__name__)

CUTE_DSL_PACKAGES = ("cutlass", "quack")
_PATCHED = "_qwen4exp_hc_down_silu_gated"


def missing_cute_dsl_packages() -> list[str]:
    """The CuTe-DSL kernel's packages that are not importable here (empty: it can run)."""
    return [name for name in CUTE_DSL_PACKAGES if importlib.util.find_spec(name) is None]


def disable_cute_dsl_hc_if_missing(missing: list[str] | None = None) -> str | None:
    """Keep upstream's HC layers off the CuTe-DSL kernel when its packages are missing; idempotent.

    Returns the note that was logged, or None when nothing needed changing. ``missing``: the
    missing packages (default: looked up); tests pass it.
    """
    missing = missing_cute_dsl_packages() if missing is None else missing
    if not missing:
        return None
    from vllm.models.qwen4_exp.nvidia import hyperconnection, model

    cls = hyperconnection.GatedResidual
    if not getattr(cls, _PATCHED, False):
        if "self._use_hc_down_silu" not in inspect.getsource(cls.__init__):
            raise RuntimeError(
                "vLLM's qwen4_exp GatedResidual no longer sets _use_hc_down_silu, so the CuTe-DSL kernel "
                f"cannot be turned off while {', '.join(missing)} is missing; install it "
                "(pip install nvidia-cutlass-dsl quack-kernels) or re-check model/vllm_adapter/upstream_kernels.py"
            )
        original_init = cls.__init__

        def init_without_cute_dsl(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            if hasattr(self, "_use_hc_down_silu"):
                self._use_hc_down_silu = False

        cls.__init__ = init_without_cute_dsl
        setattr(cls, _PATCHED, True)
        model.request_hc_down_silu_warmup = lambda *args, **kwargs: None
    note = (
        f"upstream Qwen4-Exp: CuTe-DSL HC down+SiLU kernel off ({', '.join(missing)} not installed; "
        "pip install vllm installs them); the projection runs through vLLM's linear layer"
    )
    logger.warning(note)
    return note
