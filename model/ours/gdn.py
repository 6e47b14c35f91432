"""vLLM's Gated DeltaNet layer with one correction to its CPU path.

Root cause of the fix (vLLM 0.32, ``QwenGatedDeltaNetAttention.forward_cpu``): with the flat
``[q, k, v, z]`` in_proj layout our checkpoints use, ``mixed_qkv`` is a column slice of the
``[T, qkv + z]`` projection output, so its row stride is ``qkv + z``. vLLM then calls
``.contiguous()`` before the conv. For ``T >= 2`` that copies; for ``T == 1`` torch calls a
``[1, qkv]`` tensor contiguous whatever its row stride (a size-1 dimension's stride does not
count), so no copy happens. On CPUs with AVX512-BF16 vLLM's C++ causal-conv kernel then receives
``x = mixed_qkv.T`` with strides ``(1, qkv + z)`` and rejects it (it requires ``x.stride(-1) ==
x.size(-2)``, "expect x to be transposed"): every one-token prefill, such as a readiness probe or a
client's one-token prompt, killed the engine. The torch conv path (other CPUs) does not check.

We hand the kernel a compact copy, which costs the same as vLLM's own copy for ``T >= 2`` and a
few hundred bytes for ``T == 1``.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.utils.torch_utils import _encode_layer_name


def compact_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with row stride equal to its width (a copy unless it already is), for any row count."""
    if x.stride(-1) == 1 and x.stride(0) == x.size(-1):
        return x
    return x.clone(memory_format=torch.contiguous_format)


class Qwen4ExpGatedDeltaNet(QwenGatedDeltaNetAttention):
    """vLLM's GDN layer (flat in_proj layout) whose CPU path accepts one-token prefills."""

    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
        z_size = self.value_dim // self.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, z_size], dim=-1)
        mixed_qkv = compact_rows(mixed_qkv)  # see the module docstring
        z = z.reshape(z.size(0), -1, self.head_v_dim)
        b, a = ba.chunk(2, dim=-1)
        core_attn_out = torch.zeros(
            (hidden_states.size(0), self.num_v_heads // self.tp_size, self.head_v_dim),
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        torch.ops.vllm.cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, _encode_layer_name(self.prefix))
        return self._output_projection(core_attn_out, z)
