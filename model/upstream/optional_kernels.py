"""Which of upstream Qwen4-Exp's optional CUDA kernels can run here, and whether its CUDA-graph
break points were installed.

Why: on sm_90+ upstream's hyper-connection picks a CuTe-DSL "down projection + SiLU" kernel for
1-48 tokens, and both its warm-up and its first call import ``cutlass.cute`` (``nvidia-cutlass-dsl``)
and ``quack`` (``quack-kernels``). ``pip install vllm==0.32.*`` brings both, so the image has them;
an environment assembled without them (an offline bundle, a ``--no-deps`` install) cannot start
the engine at all. Where they are missing, the same merged projection then runs through vLLM's
linear layer and upstream's own SiLU, which is upstream's path for every other batch size; the
numbers are the same GEMM in another kernel. A warning says so. An RTX 3090 (sm_86) never selects
the CuTe-DSL kernel, so ``QWEN4EXP_FORCE_SM86=1`` turns it off too: a Hopper card then runs the
hyper-connection as a 3090 does.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os

logger = logging.getLogger(__name__)

CUTE_DSL_PACKAGES = ("cutlass", "quack")
_PATCHED = "_qwen4exp_hc_down_silu_gated"


def missing_cute_dsl_packages() -> list[str]:
    """The CuTe-DSL kernel's packages that are not importable here (empty: it can run)."""
    return [name for name in CUTE_DSL_PACKAGES if importlib.util.find_spec(name) is None]


def disable_cute_dsl_hc(missing: list[str] | None = None, force_sm86: bool = False) -> str | None:
    """Keep upstream's HC layers off the CuTe-DSL kernel when its packages are missing or the
    3090's choices are forced (``force_sm86``); idempotent.

    Returns the note that was logged, or None when nothing needed changing. ``missing``: the
    missing packages (default: looked up); tests pass it.
    """
    missing = missing_cute_dsl_packages() if missing is None else missing
    if not missing and not force_sm86:
        return None
    why = f"{', '.join(missing)} not installed; pip install vllm installs them" if missing else ""
    if force_sm86:
        why = "QWEN4EXP_FORCE_SM86: an RTX 3090 never selects it" + (f"; {why}" if why else "")
    from vllm.models.qwen4_exp.nvidia import hyperconnection, model

    cls = hyperconnection.GatedResidual
    if not getattr(cls, _PATCHED, False):
        if "self._use_hc_down_silu" not in inspect.getsource(cls.__init__):
            raise RuntimeError(
                "vLLM's qwen4_exp GatedResidual no longer sets _use_hc_down_silu, so the CuTe-DSL kernel "
                f"cannot be turned off ({why}); install nvidia-cutlass-dsl and quack-kernels, unset "
                "QWEN4EXP_FORCE_SM86, or re-check model/upstream/optional_kernels.py"
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
        f"upstream Qwen4-Exp: CuTe-DSL HC down+SiLU kernel off ({why}); the projection runs "
        "through vLLM's linear layer"
    )
    logger.warning(note)
    return note


# Upstream's functions that must run outside a captured piecewise graph, on the live batch's
# metadata (GDN state indices, QSA selection, PLE short-conv state): vLLM wraps them with
# ``eager_break_during_capture``, which decides *at import* (``functools.wraps`` leaves
# ``__wrapped__`` on the wrapper only when it installed the break).
GRAPH_BREAKS = (
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "qwen_gdn_attention_core"),
    (
        "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
        "qwen_gdn_attention_core_fused_norm_packed",
    ),
    ("vllm.models.qwen4_exp.nvidia.qsa", "Qwen4ExpQSAAttention._run_qsa"),
    ("vllm.models.qwen4_exp.nvidia.ple_layer", "Qwen4ExpPLELayer._short_conv"),
)


def missing_graph_breaks() -> list[str]:
    """Upstream functions imported without their graph break although vLLM runs breakable CUDA
    graphs now (empty when breakable graphs are off, or every break is in place).

    Why it matters: ``VLLM_USE_BREAKABLE_CUDAGRAPH`` is set by ``VllmConfig`` for Qwen4-Exp, and a
    module imported before that keeps its plain functions. The piecewise graphs are then captured
    whole, on a dummy decode batch, and a small prefill replayed through one (e.g. the remainder
    after the last full block in prefix-caching align mode) updates the dummy's state instead of
    the request's. Seen on an H200: a harness imported upstream before ``LLM()``, and
    the 8-token tail of 4,088-token prompts was lost.
    """
    import importlib

    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    if not is_breakable_cudagraph_enabled():
        return []
    missing = []
    for module, qualname in GRAPH_BREAKS:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not hasattr(obj, "__wrapped__"):
            missing.append(f"{module}.{qualname}")
    return missing


def refuse_missing_graph_breaks() -> None:
    """Raise ``ValueError`` naming the functions if :func:`missing_graph_breaks` finds any. Called by
    the upstream subclasses before they build anything, when vLLM will capture CUDA graphs."""
    missing = missing_graph_breaks()
    if missing:
        raise ValueError(
            "vLLM runs breakable CUDA graphs, but upstream Qwen4-Exp modules were imported before it "
            f"enabled them, so {', '.join(missing)} would be captured inside the graphs and small "
            "prefills would run on the capture's dummy batch (wrong tokens); fix: import nothing from "
            "vllm.models.qwen4_exp or vllm.model_executor.layers.mamba before the engine is built "
            "(or set VLLM_USE_BREAKABLE_CUDAGRAPH=1 first), or --enforce-eager"
        )


def prepare_upstream_without_plugin(graphs: bool, force_sm86: bool = False) -> str | None:
    """For a process that builds vLLM's own Qwen4-Exp with our plugin off (the benches' baseline)
    and whose engine core runs in this process: turn off the CuTe-DSL HC kernel where that is our
    rule (:func:`disable_cute_dsl_hc`), which imports upstream before ``LLM()``. Upstream decides its
    graph breaks at import, so with CUDA graphs the caller enables breakable graphs first
    (``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` in its environment, as vLLM's config would for Qwen4-Exp;
    refused here otherwise), and missing breaks are refused: without them the engine timed would
    capture its GDN/QSA/PLE calls and be a different, wrong one. Returns the note logged, if any."""
    if graphs and os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "").strip() != "1":
        raise ValueError(
            "upstream with CUDA graphs and the plugin off needs VLLM_USE_BREAKABLE_CUDAGRAPH=1 set before "
            "vLLM is imported; fix: set it in the environment first, or run eagerly"
        )
    note = disable_cute_dsl_hc(force_sm86=force_sm86)
    refuse_missing_graph_breaks()
    return note
