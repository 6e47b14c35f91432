"""Per-step request metadata for our QSA cache and PLE state layers.

Both layers need the same facts about the batch: request boundaries, how many tokens of each
request were computed before this step, the block table (for QSA pages) or the state slot (for a
PLE state) and the slot of every new token. vLLM's ``CommonAttentionMetadata`` carries all of
them, so one tiny builder serves both layers; it works on the CPU runner, which cannot run
vLLM's Triton-based helpers.

State slot of a Mamba-style layer (the PLE state): with prefix caching off (``mamba_cache_mode``
``"none"``) a request owns one state block, column 0 of its block-table row. With prefix caching on
(``"align"``) the row has one column per ``mamba_block_size`` tokens; the running state lives in
the column of the step's last token, ``(seq_len - 1) // block_size``. Before the step vLLM's runner
copies the previous state into that column (``preprocess_mamba``, through the model's
``get_mamba_state_copy_funcs``), and after a chunk that ends on a block boundary the column keeps
the state of exactly that prefix, which is what a later prefix-cache hit resumes from. Column 0
is then only the first block's checkpoint, and once vLLM frees skipped blocks it is the shared
null block: reading or writing it there gives other requests' state (wrong tokens, no error).
We pick the column with vLLM's own ``mamba_get_block_table_tensor``, the function vLLM's GDN
builder uses, so the PLE and GDN states of a request always move together.
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
from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor
from vllm.v1.kv_cache_interface import MambaSpec


@dataclass
class StepMetadata:
    query_start_loc: torch.Tensor  # [R+1] int64, CPU
    seq_lens: torch.Tensor  # [R] int64, CPU: tokens of each request after this step
    num_computed: torch.Tensor  # [R] int64, CPU: tokens computed before this step
    block_table: torch.Tensor  # [R, max_blocks] int32, on the model's device
    slot_mapping: torch.Tensor  # [T] int64, on the model's device
    num_actual_tokens: int
    # [R] int64 running-state slot of each request (Mamba-style layers only, see the module doc)
    state_slots: torch.Tensor | None = None

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
        block_table = m.block_table_tensor[: m.num_reqs]
        state_slots = None
        if isinstance(self.kv_cache_spec, MambaSpec):
            state_slots = mamba_get_block_table_tensor(
                block_table,
                m.seq_lens[: m.num_reqs],
                self.kv_cache_spec,
                self.vllm_config.cache_config.mamba_cache_mode,
            )[:, 0].long()
        return StepMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            num_computed=seq_lens - query_lens,
            block_table=block_table,
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            num_actual_tokens=m.num_actual_tokens,
            state_slots=state_slots,
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
