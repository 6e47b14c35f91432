"""Per-step request metadata for our QSA cache and PLE state layers.

Both layers need the same facts about the batch: request boundaries, how many tokens of each
request were computed before this step, the block table (for QSA pages, or column 0 as the PLE
state slot) and the slot of every new token. vLLM's ``CommonAttentionMetadata`` carries all of
them, so one tiny builder serves both layers; it works on the CPU runner, which cannot run
vLLM's Triton-based helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass
class StepMetadata:
    query_start_loc: torch.Tensor  # [R+1] int64, CPU
    seq_lens: torch.Tensor  # [R] int64, CPU: tokens of each request after this step
    num_computed: torch.Tensor  # [R] int64, CPU: tokens computed before this step
    block_table: torch.Tensor  # [R, max_blocks] int32, on the model's device
    slot_mapping: torch.Tensor  # [T] int64, on the model's device
    num_actual_tokens: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


class StepMetadataBuilder(AttentionMetadataBuilder[StepMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> StepMetadata:
        m = common_attn_metadata
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1].to(torch.int64)
        seq_lens = m.seq_lens[: m.num_reqs].to("cpu", torch.int64)
        query_lens = qsl[1:] - qsl[:-1]
        return StepMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            num_computed=seq_lens - query_lens,
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            num_actual_tokens=m.num_actual_tokens,
        )


class StepMetadataBackend(AttentionBackend):
    """Backend of our own cache layers: metadata only, the layers compute in their forward."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        return "QWEN4EXP_STEP_METADATA"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("Qwen4Exp cache layers compute in their own forward")

    @staticmethod
    def get_builder_cls() -> type[StepMetadataBuilder]:
        return StepMetadataBuilder


def step_metadata(layer_name: str) -> StepMetadata | None:
    """This step's metadata for a layer, or None in profiling/dummy runs (no real requests)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if metadata is None:
        return None
    if isinstance(metadata, list):
        raise NotImplementedError("Qwen4Exp does not support micro-batching (DBO/ubatch)")
    return metadata.get(layer_name)
