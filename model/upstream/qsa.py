"""Upstream's QSA attention with our FP8 E4M3 KV cache: what an RTX 3090 (sm_86) needs from it.

vLLM's own CUDA Qwen4-Exp stores an FP8 QSA cache as uint8 and reads it by viewing the bytes as
``float8_e4m3fn`` inside Triton, and its fused prepare launch writes it the same way: both are
native FP8 converts that Triton cannot lower below sm_89 (``model/upstream/UPSTREAM_CUDA.md``
section 1). It also reads host-float scales that checkpoint scales never reach (section 2), and has
no calibration collector or clip counter (section 3). This module swaps in, for every QSA layer:

* :class:`Qwen4ExpQSAAttentionSm86`, the owner: builds our :class:`model.qsa_kv.state.QSAKVState`
  (the ``VLLM_QSA_KV_SCALES`` sidecar, ``VLLM_QSA_KV_COLLECT``, ``VLLM_QSA_KV_CLIP_COUNT``, all
  validated at construction exactly as ours does), turns upstream's fused prepare off where K/V
  must exist as tensors, and applies the scales in vLLM's post-load hook, before warm-up and graph
  capture, to our device scalars *and* to upstream's own scale attributes;
* :class:`Sm86FP8QSAImpl`, the attention impl: with an FP8 cache it writes E4M3 codes with our
  encoder (bit-exact with our CPU reference) and reads them with our Triton kernel's bit-trick
  decode; with a BF16 cache it is upstream's impl, plus statistics when calibrating.

Our reader serves every FP8 deployment, on any GPU, not only below sm_89: one writer and one reader
mean one set of scales, clip counts and tokens wherever the model runs, and the H200 we test on
then runs the 3090's code. A BF16 deployment that does not calibrate keeps upstream's fused path
untouched.

:func:`install` rebinds the name upstream's decoder layer constructs its QSA layer by
(``vllm.models.qwen4_exp.nvidia.model.Qwen4ExpQSAAttention``; MTP reuses that decoder layer) and
keeps upstream's start-up warm-up away from FP8 caches. This module imports upstream, so only the
CUDA build (or a test through ``tests.upstream.importer``) imports it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from vllm import ir
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.models.qwen4_exp.nvidia import model as upstream_model
from vllm.models.qwen4_exp.nvidia import qsa as upstream_qsa
from vllm.v1.attention.backend import AttentionType

from model.deployment import resolve
from model.qsa_kv.layer_names import qsa_layer_names
from model.qsa_kv.settings import resolve_kv_format
from model.qsa_kv.state import QSAKVState
from model.runtime import envs
from model.runtime.execution_mode import runs_eagerly
from model.upstream import qsa_glue as glue

_UpstreamOwner = upstream_qsa.Qwen4ExpQSAAttention
_UpstreamImpl = upstream_qsa.Qwen4ExpQSAFlashAttentionImpl


class Sm86FP8QSAImpl(_UpstreamImpl):
    """Upstream's QSA impl; an FP8 cache is written and read by our E4M3 code (``kv_state`` set by the owner)."""

    kv_state: QSAKVState

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.kv_state.quantized:
            glue.write_kv(self.kv_state, key, value, kv_cache, slot_mapping)
            return
        glue.observe_kv(self.kv_state, key, value, slot_mapping)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward_qsa(self, *args, **kwargs):
        if self.kv_state.quantized:
            return self._forward_fp8(*args, **kwargs)
        return super().forward_qsa(*args, **kwargs)

    def _forward_fp8(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        token_to_req,
        use_prefill_config,
        output_gate,
        output_scale=None,
        output_block_scale=None,
    ):
        """``forward_qsa`` (same arguments) over an FP8 cache: our reader, upstream's gate rounding."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("QSA does not support fused output quantization")
        num_tokens = attn_metadata.num_actual_tokens
        output.zero_()
        if num_tokens == 0:
            return output
        if query.dtype != torch.bfloat16:
            raise NotImplementedError(f"Qwen4Exp QSA with an FP8 cache needs BF16 queries, got {query.dtype}")
        output[:num_tokens] = glue.attend_fp8(
            self.kv_state,
            query[:num_tokens],
            kv_cache,
            attn_metadata.block_table,
            token_to_req[:num_tokens],
            layer.topk_indices_buffer[:num_tokens],
            self.scale,
            output_gate[:num_tokens],
        )
        return output


def unfused_qkv_mapping(mapping: dict[str, list[str]]) -> dict[str, list[str]]:
    """Upstream's ``packed_modules_mapping`` without the indexer in ``qkv_proj``.

    A quantization config decides whether a fused layer is quantized from its shards' names; with
    the indexer listed as a ``qkv_proj`` shard, a checkpoint that keeps the indexer in bf16 (ours
    always do, ``model.tools.quantize``) while q/k/v are quantized fails at start-up ("Detected some but
    not all shards ... are quantized"). Our owner keeps the indexer projection separate whenever a
    quantization config is active, so the mapping must say so."""
    return {**mapping, "qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def keeps_indexer_projection_separate(quant_config) -> bool:
    """Whether a QSA owner keeps its indexer Q/K projection its own layer: with any quantization
    config but ModelOpt FP4 (see :func:`unfused_qkv_mapping`), or where
    ``QWEN4EXP_SEPARATE_INDEXER_PROJECTION`` asks for it (a bf16 twin of a quantized checkpoint)."""
    return upstream_model.without_modelopt_fp4(quant_config) is not None or envs.read(
        envs.SEPARATE_INDEXER_PROJECTION
    )


@contextlib.contextmanager
def _indexer_projection_kept_separate():
    """While upstream's owner constructor runs: its fusing step returns the plain QKV projection.

    Upstream fuses the indexer's Q/K projection into the QKV GEMM unless LoRA is on, and only its
    constructor can decide it; the module attribute it looks the fused class up by is swapped for
    the constructor's duration (model construction is single-threaded)."""
    fused = upstream_qsa.Qwen4ExpQSAQKVIndexerLinear
    upstream_qsa.Qwen4ExpQSAQKVIndexerLinear = lambda qkv_proj, index_size, quant_config: qkv_proj
    try:
        yield
    finally:
        upstream_qsa.Qwen4ExpQSAQKVIndexerLinear = fused


def gemma_rmsnorm_vllm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """FlashInfer's ``gemma_rmsnorm`` signature, computed by vLLM's own RMS-norm op with ``1 + weight``.

    Why: upstream's unfused indexer path (the one FP8 caches and calibration need, see
    ``needs_unfused_prepare``) calls ``flashinfer.norm.gemma_rmsnorm``, which runs either FlashInfer's
    CuTe-DSL kernel (the ``nvidia-cutlass-dsl`` package) or a kernel it JIT-compiles with nvcc. Our
    image is a CUDA *runtime* image without nvcc, so that call could not run there. vLLM's
    ``GemmaRMSNorm`` (which the rest of upstream's QSA layer uses for the same norms) computes
    ``x / rms(x) * (1 + w)`` in fp32 through vLLM's compiled op, rounding once to the input dtype."""
    result = ir.ops.rms_norm(input, weight.float() + 1.0, eps)
    if out is None:
        return result
    out.copy_(result)
    return out


@contextlib.contextmanager
def _vllm_gemma_rmsnorm():
    """While upstream's indexer runs: ``flashinfer.norm.gemma_rmsnorm`` is :func:`gemma_rmsnorm_vllm`
    (upstream imports the name at call time; restored afterwards, so nothing else sees it)."""
    try:
        import flashinfer.norm as flashinfer_norm
    except ImportError:  # no FlashInfer: upstream's unfused path cannot run anyway
        yield
        return
    original = flashinfer_norm.gemma_rmsnorm
    flashinfer_norm.gemma_rmsnorm = gemma_rmsnorm_vllm
    try:
        yield
    finally:
        flashinfer_norm.gemma_rmsnorm = original


def _with_vllm_gemma_rmsnorm(forward):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        with _vllm_gemma_rmsnorm():
            return forward(*args, **kwargs)

    return wrapper


class Qwen4ExpQSAAttentionSm86(_UpstreamOwner):
    """Upstream's QSA owner with our KV state and impl (see the module docstring).

    With a quantization config (other than ModelOpt FP4, which upstream leaves out of these layers)
    the indexer projection stays its own layer, unquantized where the checkpoint's ignore list says
    so, instead of a fourth shard of the quantized QKV GEMM (:func:`unfused_qkv_mapping`).
    ``QWEN4EXP_SEPARATE_INDEXER_PROJECTION=1`` does the same without one, so that a bf16 twin has
    the quantized checkpoint's layer structure (upstream loads either way: ``load_weights`` maps
    the indexer into ``qkv_proj`` only while ``fuse_indexer_projection`` holds)."""

    # vLLM's ``load_format=dummy`` draws every parameter at random, the K/V scales too (set per engine).
    dummy_weights: bool = False

    def __init__(self, *, vllm_config, config, layer_id, quant_config=None, reduce_results=True, prefix=""):
        separate = keeps_indexer_projection_separate(quant_config)
        with _indexer_projection_kept_separate() if separate else contextlib.nullcontext():
            super().__init__(
                vllm_config=vllm_config,
                config=config,
                layer_id=layer_id,
                quant_config=quant_config,
                reduce_results=reduce_results,
                prefix=prefix,
            )
        if separate and self.fuse_indexer_projection:
            # The constructor deleted the indexer's projection when it "fused" it: build it again,
            # as upstream's own unfused (LoRA) path has it.
            indexer = self.indexer
            indexer.index_qk_proj = ReplicatedLinear(
                int(config.hidden_size),
                (indexer.index_n_heads + indexer.index_kv_heads) * indexer.index_head_dim,
                bias=False,
                quant_config=quant_config,
                prefix=f"{prefix}.indexer.index_qk_proj",
            )
            self.fuse_indexer_projection = False
        # Named like ours (the owner's prefix, e.g. "model.layers.3.self_attn"), so one sidecar and
        # one calibration dump serve either implementation.
        self.kv_state = QSAKVState(
            layer_name=prefix,
            kv_format=resolve_kv_format(self.kv_cache_dtype, vllm_config.model_config.dtype),
            settings=resolve.of(vllm_config).qsa_kv,
            expected_layers=qsa_layer_names(prefix, config.layer_types),
            eager=runs_eagerly(vllm_config),
            model=str(vllm_config.model_config.model),
            cache_dtype=str(self.kv_cache_dtype),
            engine=vllm_config.instance_id,
        )
        impl = Sm86FP8QSAImpl(
            self.num_heads,
            self.head_dim,
            self.scaling,
            self.num_kv_heads,
            None,
            None,
            self.kv_cache_dtype,
            None,
            AttentionType.DECODER,
            None,
        )
        impl.kv_state = self.kv_state
        self.impl = impl
        load_format = getattr(getattr(vllm_config, "load_config", None), "load_format", "auto")
        self.dummy_weights = str(getattr(load_format, "value", load_format)) == "dummy"
        if glue.needs_unfused_prepare(self.kv_state):
            self.use_fused_qsa_prepare = False
            self.indexer.forward = _with_vllm_gemma_rmsnorm(self.indexer.forward)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """vLLM's post-load hook (before warm-up and capture): one scale source for every reader.

        Our device scalars get the sidecar's values (``QSAKVState.apply``); upstream's ``_k_scale``/
        ``_v_scale`` buffers and their host copies get the same numbers, so nothing upstream still
        reads (its BF16-path writer, logs) disagrees. A checkpoint's own scales must match."""
        glue.reconcile_checkpoint_scales(
            self.kv_state.layer_name,
            float(self._k_scale.item()),
            float(self._v_scale.item()),
            self.kv_state,
            dummy_weights=self.dummy_weights,
        )
        self.kv_state.apply()
        k, v = self.kv_state.k_scale_value, self.kv_state.v_scale_value
        self._k_scale.fill_(k)
        self._v_scale.fill_(v)
        self._k_scale_float, self._v_scale_float = k, v
        self._k_scale_cpu = torch.tensor(k, dtype=torch.float32)
        self._v_scale_cpu = torch.tensor(v, dtype=torch.float32)


def _skip_warmup_for_uint8(warmup):
    """Upstream's QSA sparse-attention warm-up, except for uint8 (FP8) caches: it would compile
    upstream's native-FP8 kernel, which our FP8 path never runs (and sm_86 cannot compile). Our
    kernel compiles at its first call, in vLLM's profiling run before serving."""

    @functools.wraps(warmup)
    def wrapper(kv_cache, *args, **kwargs):
        if kv_cache.dtype == torch.uint8:
            return ()
        return warmup(kv_cache, *args, **kwargs)

    wrapper.qwen4exp_sm86 = True
    return wrapper


def install() -> None:
    """Make upstream's decoder layers build :class:`Qwen4ExpQSAAttentionSm86`; idempotent."""
    upstream_model.Qwen4ExpQSAAttention = Qwen4ExpQSAAttentionSm86
    from vllm.models.qwen4_exp.nvidia.ops import qsa as upstream_ops

    if not getattr(upstream_ops.warmup_qsa_sparse_paged_attention, "qwen4exp_sm86", False):
        upstream_ops.warmup_qsa_sparse_paged_attention = _skip_warmup_for_uint8(
            upstream_ops.warmup_qsa_sparse_paged_attention
        )
