"""Qwen4-Exp for vLLM: decoder layers, the model, and the two architectures we register.

A decoder layer works on ``hc_count`` residual streams stacked as ``[T, hc_count * hidden]``:
optional PLE adds n-gram features to every stream; a gated residual mixes the streams into the
mixer's input (Gated DeltaNet, or gated attention with QSA on every 4th layer), whose output is
injected back; the same again around the MoE. A final mixer turns the streams into one hidden
state for the LM head (there is no final norm).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.qwen3_next import Qwen3NextSparseMoeBlock
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    extract_layer_index,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

from model.deployment import resolve
from model.ours.ple_layer import (
    PLE_STATE_COPY_FUNCS,
    PLEPrefetcher,
    Qwen4ExpPLE,
    ple_state_dtypes,
    ple_state_shapes,
)
from model.runtime.config_checks import validate_text_config
from model.runtime.engine_guard import fault_injector
from model.runtime.quant_checks import (
    TensorChecker,
    check_cpu_kernels,
    check_must_stay_unquantized,
    explain_construction_error,
    int4_group_sizes,
)

from .gdn import Qwen4ExpGatedDeltaNet
from .hyper_connection import GatedResidual
from .qsa_attention import Qwen4ExpQSAAttention

logger = init_logger(__name__)

_PLE_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


def _gdn_config(config):
    """vLLM's GDN layer reads ``output_gate_type`` directly; resolve the reference's default."""
    gdn_config = copy.copy(config)
    gdn_config.output_gate_type = config.output_gate_type or config.hidden_act
    return gdn_config


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.layer_idx = extract_layer_index(prefix)
        self.layer_type = config.layer_types[self.layer_idx]
        self.ple = None
        if self.layer_idx + 1 in config.ple_layer_ids:
            ple_index = sorted(config.ple_layer_ids).index(self.layer_idx + 1)
            self.ple = Qwen4ExpPLE(config, vllm_config, ple_index, prefix=f"{prefix}.ple")
        if self.layer_type == "linear_attention":
            self.linear_attn = Qwen4ExpGatedDeltaNet(
                _gdn_config(config), vllm_config=vllm_config, prefix=f"{prefix}.linear_attn"
            )
        else:
            self.self_attn = Qwen4ExpQSAAttention(config, vllm_config, prefix=f"{prefix}.self_attn")
        self.mlp = Qwen3NextSparseMoeBlock(vllm_config=vllm_config, prefix=f"{prefix}.mlp")
        hc = (config.hc_count, config.hidden_size, config.hc_lowrank, config.rms_norm_eps)
        self.attn_hyper_connection = GatedResidual(*hc)
        self.mlp_hyper_connection = GatedResidual(*hc)

    def forward(
        self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.ple is not None:
            streams = self.ple(streams, input_ids)
        block_input, injection = self.attn_hyper_connection.mix(streams)
        if self.layer_type == "linear_attention":
            block_output = self.linear_attn(block_input)
        else:
            block_output = self.self_attn(block_input, positions)
        streams = GatedResidual.inject(streams, block_output, injection)
        block_input, injection = self.mlp_hyper_connection.mix(streams)
        streams = GatedResidual.inject(streams, self.mlp(block_input), injection)
        return streams


class Qwen4ExpModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        validate_text_config(config, vllm_config.model_config.model)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen4ExpDecoderLayer(vllm_config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.hyper_connection_mixer = GatedResidual(
            config.hc_count, config.hidden_size, config.hc_lowrank, config.rms_norm_eps, with_injection=False
        )
        self.ple_prefetch = PLEPrefetcher(self.layers)
        # None unless a resilience test asks for it
        self.fault_check = fault_injector(resolve.of(vllm_config).fault_tokens)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds=None) -> torch.Tensor:
        if input_ids is None:
            raise ValueError(
                "Qwen4-Exp needs the token ids (PLE hashes them); embeddings alone are not enough"
            )
        if self.fault_check is not None:
            self.fault_check(input_ids)
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        streams = hidden.repeat(1, self.config.hc_count)
        self.ple_prefetch.begin(input_ids)
        for i, layer in enumerate(self.layers):
            self.ple_prefetch.before_layer(i)
            streams = layer(streams, positions, input_ids)
        out, _ = self.hyper_connection_mixer.mix(streams)
        return out


class Qwen4ExpForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """Text Qwen4-Exp (``Qwen4ExpForCausalLM`` checkpoints)."""

    # Checkpoint projections that vLLM fuses (q/k/v, GDN in_proj, shared expert), as in its Qwen3.5.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
            ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
            ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
            ".in_proj_z": (".in_proj_qkvz", 3),
            ".in_proj_b": (".in_proj_ba", 0),
            ".in_proj_a": (".in_proj_ba", 1),
        }
    )
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        resolve.of(vllm_config).require("ours")
        config = vllm_config.model_config.hf_text_config
        self.config = config
        quant_name = vllm_config.quant_config and vllm_config.quant_config.get_name()
        try:
            self.model = Qwen4ExpModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        except NotImplementedError as exc:
            raise explain_construction_error(
                exc, quant_name, int4_group_sizes(vllm_config.quant_config)
            ) from exc
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        self._quant_name = quant_name
        self._hf_quant_config = getattr(vllm_config.model_config.hf_config, "quantization_config", None)
        check_must_stay_unquantized(self, self._quant_name)
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if positions.ndim > 1:  # M-RoPE positions of a text-only prompt: all rows are equal
            positions = positions[0]
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # ---- hybrid-cache hooks -------------------------------------------------------------------

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        c = vllm_config.model_config.hf_text_config
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size,
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
            c.linear_conv_kernel_dim,
            vllm_config.num_speculative_tokens,
        )

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> tuple[MambaSpec, ...]:
        """Every Mamba-style state: GDN layers and, when present, PLE layers (which can be larger)."""
        specs = [
            MambaSpec(
                shapes=cls.get_mamba_state_shape_from_config(vllm_config),
                dtypes=cls.get_mamba_state_dtype_from_config(vllm_config),
                block_size=-1,
            )
        ]
        c = vllm_config.model_config.hf_text_config
        if c.ple_layer_ids:
            specs.append(
                MambaSpec(
                    shapes=ple_state_shapes(c),
                    dtypes=ple_state_dtypes(vllm_config.model_config.dtype),
                    block_size=-1,
                    tp_replicated=True,
                )
            )
        return tuple(specs)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types: set[MambaAttentionBackendEnum]):
        funcs = {
            MambaAttentionBackendEnum.GDN_ATTN: cls.get_mamba_state_copy_func(),
            # Our PLE state (the model's only SHORT_CONV-typed layer): both of its states.
            MambaAttentionBackendEnum.SHORT_CONV: PLE_STATE_COPY_FUNCS,
        }
        return {t: funcs[t] for t in mamba_types}

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        tables = {
            f"model.layers.{i}.ple.ple_embedding": layer.ple.ple_embedding
            for i, layer in enumerate(self.model.layers)
            if layer.ple is not None
        }
        seen_buffers: set[str] = set()
        checker = TensorChecker(self, self._quant_name, self._hf_quant_config)

        def route(stream: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in stream:
                name = _strip_prefix(name)
                if name.startswith("model.visual.") or name.startswith("visual."):
                    continue  # vision tower: not served (text-only), see Qwen4ExpForConditionalGeneration
                if name.startswith("mtp."):
                    continue
                match = _PLE_PARAM.match(name)
                if match and match.group(1) in tables:
                    owner, rest = match.group(1), match.group(2)
                    table = tables[owner]
                    if table.load_tensor(rest, tensor, name):
                        continue
                    if rest in _PLE_BUFFERS:
                        table.check_buffer(rest, tensor, name)
                        seen_buffers.add(name)
                        continue
                checker.check(name, tensor)
                yield name, tensor

        loader = AutoWeightsLoader(self)
        with checker.guard():
            loaded |= loader.load_weights(route(weights), mapper=self.hf_to_vllm_mapper)
        checker.check_all_loaded(loaded)
        check_cpu_kernels(checker.quantized)
        for owner, table in tables.items():
            missing = table.missing_shards()
            if missing:
                raise ValueError(
                    f"checkpoint is missing PLE table shards {missing} of {owner}.ngram_embedding "
                    f"(expected shard_0..shard_{table.num_shards - 1}, split_ngram_parts="
                    f"{table.split_parts}); re-export the checkpoint or fix split_ngram_parts in config.json"
                )
            for short in _PLE_BUFFERS:
                if f"{owner}.{short}" not in seen_buffers:
                    raise ValueError(
                        f"checkpoint is missing {owner}.{short}, needed to verify the PLE hash layout"
                    )
            table.finish_loading(owner)
        return loaded


class Qwen4ExpForConditionalGeneration(Qwen4ExpForCausalLM):
    """A ``Qwen4ExpForConditionalGeneration`` checkpoint served text-only.

    Its language-model weights (``model.language_model.*``) load into the text model; the vision
    tower is not served yet, so its weights are skipped and image/video inputs are not accepted
    (the class does not declare multimodal support, so vLLM rejects them with its own error).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        logger.warning(
            "Qwen4ExpForConditionalGeneration: serving the language model only; the vision tower is not loaded"
        )


_LM_PREFIX = re.compile(r"^model\.language_model\.")
_PLE_PARAM = re.compile(r"^(model\.layers\.\d+\.ple\.ple_embedding)\.(.+)$")


def _strip_prefix(name: str) -> str:
    return _LM_PREFIX.sub("model.", name)
