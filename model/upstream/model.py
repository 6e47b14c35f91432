"""vLLM's own CUDA Qwen4-Exp behind a start-up check: what ``QWEN4EXP_CUDA_MODEL=upstream`` serves.

Why this module exists: on an H200, vLLM 0.32's built-in ``qwen4_exp`` (``vllm.models.qwen4_exp
.nvidia``) matched transformers as closely as ours and ran 9-16x faster, so on CUDA it is where this
project is heading. It does not yet do everything ours does, though, and serving a deployment that
relies on one of those features without it would be silently wrong (an FP8 cache read without its
calibrated scales, a missing calibration dump, FP8/NVFP4 PLE codes read as bf16). So the classes
here are thin subclasses of upstream's that fail closed: their ``__init__`` gathers the deployment's
facts from ``vllm_config`` and raises one ``ValueError`` listing every problem
(:func:`model.deployment.implementation.problems_for_upstream`) before upstream builds anything.

What they carry, installed by :func:`model.upstream.patches.apply` when the first of them is
constructed (never on import), with the deployment's switches; from :mod:`model.upstream.qsa`: the FP8 E4M3 QSA cache written by our encoder and read by our
kernel's bit-trick decode on any GPU (sm_86, the RTX 3090, has no native FP8), the static per-layer
K/V scale sidecar (``VLLM_QSA_KV_SCALES``), the calibration collector (``VLLM_QSA_KV_COLLECT``) and
the device-side clip counters (``VLLM_QSA_KV_CLIP_COUNT``).

From :mod:`model.upstream.gdn`, unless ``QWEN4EXP_GDN_SHORT_PREFILL=0`` (judged on the H200
on an H200, docs/benchmarks.md): GDN prefills shorter than one FLA chunk (a prefix-cache hit's tail) in FLA's fused
recurrent kernel on the Triton path (the 3090's), one launch instead of ~8.

From :mod:`model.upstream.hc_mix`, unless ``QWEN4EXP_HC_REFERENCE_ROUNDING=0``: the
hyper-connection gate mix rounded where transformers and ours round, so that MoE routing near-ties
fall as in the reference (docs/fidelity.md has the checkpoint where upstream's order doubled the error).

From :mod:`model.upstream.ple`: our FP8 E4M3 and NVFP4 PLE tables (``model.ple.format``),
decoded exactly as ours decodes them, and PLE tables kept away from the weight quantizer (so AWQ/GPTQ
configs construct). With any weight quantization the QSA indexer projection stays its own
(unquantized) layer, as our checkpoints keep it; a quantization config that would quantize it stops
start-up, as on ours. AWQ and GPTQ checkpoints (the AutoAWQ / AutoGPTQ layouts, written by
``python -m model.tools.quantize --format awq|gptq``) load through vLLM's own configs and Marlin kernels,
checked against their bf16 twins on the H200 (``tests/gpu/test_upstream_cuda.py``).

Upstream also needs settings ours does not: Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``),
``output_gate_type`` written in config.json, and a QSA top-k of 512, 1024 or 2048 blocks; those are
refused the same way (the service sets the V2 runner itself). Since these classes passed on an H200
(``tests/gpu/test_upstream_cuda.py``, docs/validation.md), they are what ``QWEN4EXP_CUDA_MODEL=auto`` (the
default) serves on CUDA.

vLLM imports this module only when the class is needed (``model.plugin`` registers lazy
``module:Class`` strings), and only on CUDA: on vLLM's CPU build ``upstream`` registers the stand-ins
of :mod:`model.ours.upstream_stand_ins` instead, which refuse to be built.
"""

from __future__ import annotations

from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForCausalLM as _UpstreamForCausalLM
from vllm.models.qwen4_exp.nvidia.model import (
    Qwen4ExpForConditionalGeneration as _UpstreamForConditionalGeneration,
)

from model.deployment import resolve
from model.deployment.implementation import captures_cuda_graphs, refuse_unless_upstream_can_serve
from model.runtime.quant_checks import check_must_stay_unquantized
from model.upstream import optional_kernels, patches
from model.upstream import qsa as upstream_qsa


def _prepare(vllm_config) -> None:
    """What every upstream subclass does first, before upstream builds anything: read the
    deployment vLLM was given, refuse what upstream cannot serve (every reason at once), install our
    patches of upstream's modules (:func:`model.upstream.patches.apply`) and, where vLLM captures CUDA graphs,
    check that upstream's graph breaks are in place."""
    deployment = resolve.of(vllm_config)
    deployment.require("upstream")
    _read_output_gate_as_transformers_does(vllm_config)
    refuse_unless_upstream_can_serve(vllm_config)
    patches.apply(deployment)
    if captures_cuda_graphs(vllm_config):
        optional_kernels.refuse_missing_graph_breaks()


def _read_output_gate_as_transformers_does(vllm_config) -> None:
    """A null ``output_gate_type`` is ``hidden_act`` in transformers (``configuration_qwen4_exp``:
    ``self.output_gate_type or self.hidden_act``); upstream's GDN layer asserts on null, so the
    config object it reads gets the value transformers uses before the layers are built."""
    text = vllm_config.model_config.hf_text_config
    if getattr(text, "output_gate_type", None) is None:
        text.output_gate_type = getattr(text, "hidden_act", "silu")


def _refuse_quantized_indexer(model, vllm_config) -> None:
    """A checkpoint whose quantization config reaches the QSA indexer projection stops start-up,
    as it does on ours (``model.runtime.quant_checks``): token selection must not move with the weight
    format. Our subclass keeps that projection its own layer under any weight quantization, so
    an AWQ/GPTQ/compressed-tensors config that does not exclude it would quantize it."""
    quant_config = vllm_config.quant_config
    check_must_stay_unquantized(model, None if quant_config is None else quant_config.get_name())


class Qwen4ExpForCausalLM(_UpstreamForCausalLM):
    """Upstream's text model; refuses, before building anything, what upstream cannot serve
    (see the module docstring for the list and what this class will gain)."""

    packed_modules_mapping = upstream_qsa.unfused_qkv_mapping(_UpstreamForCausalLM.packed_modules_mapping)

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        _prepare(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        _refuse_quantized_indexer(self, vllm_config)


class Qwen4ExpForConditionalGeneration(_UpstreamForConditionalGeneration):
    """Upstream's vision-language model (its multimodal processor is inherited); refuses what
    upstream cannot serve, like :class:`Qwen4ExpForCausalLM`."""

    packed_modules_mapping = upstream_qsa.unfused_qkv_mapping(
        _UpstreamForConditionalGeneration.packed_modules_mapping
    )

    def __init__(self, *, vllm_config, prefix: str = "model") -> None:
        _prepare(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        _refuse_quantized_indexer(self, vllm_config)
