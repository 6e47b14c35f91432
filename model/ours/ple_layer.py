"""PLE (per-layer n-gram embeddings) as a vLLM module.

``PLEState`` is the layer vLLM sees: a Mamba-style per-request state with two parts, the last
``ngram_size - 1`` token ids (so hashing continues across steps and prefill chunks) and the
last ``(kernel - 1) * dilation`` inputs of the dilated causal conv. Both depend only on the
tokens before the next one, so with prefix caching (vLLM's align mode) the state saved at a block
boundary is exactly what a later request sharing that prefix resumes from: the layer reads and
writes the slot of the step's last block (``StepMetadata.state_slots``) and vLLM copies both parts
whole between blocks (``copy_whole_state``). ``Qwen4ExpPLE`` owns the
projections, norms, conv weight and the n-gram table, and adds its output to every residual
stream.

The n-gram table (``NgramTable``, ``model.ple.vllm_table``) is the big part: ~45B values
in page-locked host memory by default, sharded by rows over the tensor-parallel ranks.

Prefetch: the rows a PLE layer needs depend only on the token ids and the layer's own state, so
``PLEPrefetcher`` computes them for every PLE layer at the start of the forward and starts each
layer's gather on a side stream while the decoder layer before it runs; the layer joins it just
before use. Without CUDA the lookup runs synchronously in the layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaCopySpec
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from model.deployment import resolve
from model.ours.hyper_connection import WeightOnly, ZeroCenteredRMSNorm
from model.ours.qsa_attention import register_layer
from model.ours.step_metadata import StepMetadataBackend, step_metadata
from model.ple.ngram_hash import next_context, ngram_row_ids, token_windows
from model.ple.reference import dilated_causal_conv, ple_gated_values
from model.ple.vllm_table import NgramTable


def ple_state_shapes(config, num_spec: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(token history, conv inputs) per request; the int64 history comes first for alignment."""
    conv_len = (config.ple_conv_kernel_size - 1) * config.ngram_size
    return (config.ngram_size - 1,), (conv_len + num_spec, config.hc_count * config.hidden_size)


def ple_state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    return torch.int64, model_dtype


def copy_whole_state(
    state: torch.Tensor, block_ids: list[int], cur_block_idx: int, num_accepted_tokens: int
) -> MambaCopySpec:
    """vLLM's align-mode state copy for one PLE state: the whole source block.

    With prefix caching vLLM moves a request's running state to a new block whenever the request
    crosses a block boundary, and starts a prefix-cache hit from the block of the hit's last token
    (``v1/worker/mamba_utils.py``: ``preprocess_mamba`` -> ``collect_mamba_copy_meta``). Only states
    that have a copy function are copied; a PLE state left behind would make the next step read an
    uninitialised block. Both PLE states (the token history and the conv inputs) are small and
    describe "everything before the next token" as a whole, so each is copied entire. A partial
    copy (vLLM's ``get_conv_copy_spec``) only makes sense with speculative tokens, which this
    layer does not roll back: refuse them instead of copying a wrong state.
    """
    if num_accepted_tokens != 1:
        raise NotImplementedError("the PLE state does not support speculative decoding")
    src = state[block_ids[cur_block_idx]]
    return MambaCopySpec(start_addr=src.data_ptr(), num_elements=src.numel())


PLE_STATE_COPY_FUNCS = (copy_whole_state, copy_whole_state)  # token history, conv inputs


def eos_of(config) -> int:
    eos = config.eos_token_id
    return int(eos[0] if isinstance(eos, list) else eos)


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------


class PLEState(nn.Module, MambaBase):
    def __init__(self, config, model_dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self._shapes = ple_state_shapes(config)
        self._dtypes = ple_state_dtypes(model_dtype)
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        register_layer(get_current_vllm_config(), prefix, self)

    def get_state_shape(self):
        return self._shapes

    def get_state_dtype(self):
        return self._dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return True

    def get_attn_backend(self):
        return StepMetadataBackend


@dataclass
class PLEStep:
    """What one PLE layer needs from this step before its lookup: request layout, ids, state slots."""

    qsl: torch.Tensor  # [R+1] int64 on CPU
    qsl_dev: torch.Tensor  # the same on the model's device
    has_state: torch.Tensor  # [R] bool on CPU
    slots: torch.Tensor | None  # [R] int64 state slots, None in profiling runs
    context: torch.Tensor  # [R, n-1] tokens preceding each request's first new token
    windows: torch.Tensor  # [T, n] token windows
    rows: torch.Tensor  # [T, heads] global table rows


class Qwen4ExpPLE(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, ple_index: int, prefix: str) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.hc_count = config.hc_count
        self.eps = config.rms_norm_eps
        self.dilation = config.ngram_size
        self.eos = eos_of(config)
        width = self.hidden_size * self.hc_count
        embed = config.ple_embed_dim
        self.key_proj = WeightOnly(width, embed)
        self.value_proj = WeightOnly(self.hidden_size, embed)
        self.norm_key = ZeroCenteredRMSNorm(width, self.eps, self.hidden_size)
        self.norm_query = ZeroCenteredRMSNorm(width, self.eps, self.hidden_size)
        self.norm_conv = ZeroCenteredRMSNorm(width, self.eps, self.hidden_size)
        self.conv1d = WeightOnly(width, 1, config.ple_conv_kernel_size)
        device = torch.device(vllm_config.device_config.device)
        deployment = resolve.of(vllm_config)
        self.prefetch = deployment.ple_prefetch
        self.ple_embedding = NgramTable(
            config,
            ple_index,
            layer_name=prefix,
            device=device,
            mode=deployment.ple_storage,
            out_dtype=vllm_config.model_config.dtype,
            prefetch=self.prefetch,
            max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        )
        self.state = PLEState(config, vllm_config.model_config.dtype, prefix=f"{prefix}.state")

    def prepare(self, input_ids: torch.Tensor) -> PLEStep:
        """Token windows and table rows for this step, from ``input_ids`` and this layer's state.

        Reads only this layer's own state (written at the end of its forward), so it may run at
        the start of the model's forward, before any decoder layer.
        """
        meta = step_metadata(self.state.prefix)
        table = self.ple_embedding
        device = input_ids.device
        if meta is None:  # profiling run: one fresh pseudo-request, no state written
            qsl = torch.tensor([0, input_ids.shape[0]], dtype=torch.int64)
            has_state = torch.zeros(1, dtype=torch.bool)
            slots = None
        else:
            qsl = meta.query_start_loc
            has_state = meta.num_computed > 0
            assert meta.state_slots is not None, "PLE state metadata comes from a Mamba-spec group"
            slots = meta.state_slots
        num_reqs = qsl.shape[0] - 1
        context = torch.full((num_reqs, table.layout.context_len), self.eos, dtype=torch.int64, device=device)
        if slots is not None:
            history = self.state.kv_cache[0][slots]
            context = torch.where(has_state.to(device).unsqueeze(1), history, context)
        qsl_dev = qsl.to(device)
        windows = token_windows(input_ids.long(), context, qsl_dev)
        rows = ngram_row_ids(windows, table.layout)
        return PLEStep(qsl, qsl_dev, has_state, slots, context, windows, rows)

    def start_lookup(self, step: PLEStep) -> None:
        """Begin the table gather for ``step``; :meth:`forward` joins it (the step travels with
        the prefetch in the table's storage, the one place that knows a gather is in flight)."""
        self.drop_pending()
        self.ple_embedding.start_prefetch(step.rows, context=step)

    def drop_pending(self) -> None:
        self.ple_embedding.drop_prefetch()

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.ple_embedding
        if table.prefetch_pending:
            step, embeddings = table.wait_prefetch_with_context()
            assert isinstance(step, PLEStep)
        else:  # synchronous lookup (CPU, prefetch off, or called outside the model)
            step = self.prepare(input_ids)
            embeddings = table.lookup(step.rows)
        gated, conv_in = ple_gated_values(
            streams,
            embeddings.to(streams.dtype),
            self.key_proj.weight,
            self.value_proj.weight,
            self.norm_key.weight,
            self.norm_query.weight,
            self.norm_conv.weight,
            self.hc_count,
            self.hidden_size,
            self.eps,
        )
        conv_out = torch.empty_like(conv_in)
        weight = self.conv1d.weight.squeeze(1)
        state_len = (weight.shape[1] - 1) * self.dilation
        bounds = step.qsl.tolist()
        slots, has_state = step.slots, step.has_state
        for r in range(len(bounds) - 1):
            start, end = bounds[r], bounds[r + 1]
            if start == end:
                continue
            if slots is not None and bool(has_state[r]):
                state = self.state.kv_cache[1][slots[r], :state_len]
            else:
                state = conv_in.new_zeros(state_len, conv_in.shape[1])
            conv_out[start:end], new_state = dilated_causal_conv(
                conv_in[start:end], state, weight, self.dilation
            )
            if slots is not None:
                self.state.kv_cache[1][slots[r], :state_len] = new_state
        if slots is not None:
            self.state.kv_cache[0][slots] = next_context(step.windows, step.qsl_dev, step.context)
        return streams + gated + conv_out


class PLEPrefetcher:
    """Starts each PLE layer's table gather while the decoder layer before it runs.

    ``begin(input_ids)`` at the start of the model's forward computes every PLE layer's rows
    (they depend only on the token ids and the layer's own state) and starts the gather of a PLE
    in the first decoder layer; ``before_layer(i)``, called just before decoder layer ``i`` runs,
    starts the gather of layer ``i + 1``'s PLE on the side stream, so it overlaps layer ``i``.
    Layers whose PLE has prefetch off (CPU by default) look up synchronously in their forward.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._ples: list[Qwen4ExpPLE | None] = [getattr(layer, "ple", None) for layer in layers]
        self.enabled = any(p is not None and p.prefetch for p in self._ples)
        self._steps: dict[int, PLEStep] = {}

    def begin(self, input_ids: torch.Tensor) -> None:
        if not self.enabled:
            return
        self._steps = {}
        for i, ple in enumerate(self._ples):
            if ple is not None and ple.prefetch:
                ple.drop_pending()
                self._steps[i] = ple.prepare(input_ids)
        self._start(0)

    def before_layer(self, index: int) -> None:
        if self.enabled:
            self._start(index + 1)

    def _start(self, index: int) -> None:
        step = self._steps.pop(index, None)
        if step is not None:
            ple = self._ples[index]
            assert ple is not None
            ple.start_lookup(step)
