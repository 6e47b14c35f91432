"""The align-mode copy functions of the PLE state, without an engine.

vLLM copies a Mamba-style layer's states between blocks only for the states that have a copy
function (``v1/worker/mamba_utils.py``, ``collect_mamba_copy_meta`` zips states with functions), so
a PLE state left without one is silently stale after every block boundary and every prefix hit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model.ours.model import Qwen4ExpForCausalLM
from model.ours.ple_layer import copy_whole_state, ple_state_dtypes, ple_state_shapes


def test_every_ple_state_has_a_copy_function():
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as M

    config = SimpleNamespace(ngram_size=3, ple_conv_kernel_size=4, hc_count=2, hidden_size=128)
    funcs = Qwen4ExpForCausalLM.get_mamba_state_copy_funcs({M.SHORT_CONV, M.GDN_ATTN})
    assert len(funcs[M.SHORT_CONV]) == len(ple_state_shapes(config))
    assert len(funcs[M.GDN_ATTN]) == 2  # vLLM's own GDN functions: conv and recurrent state


@pytest.mark.parametrize("index", [0, 1])
def test_copy_whole_state_covers_the_block(index):
    config = SimpleNamespace(ngram_size=3, ple_conv_kernel_size=4, hc_count=2, hidden_size=128)
    shape = ple_state_shapes(config)[index]
    dtype = ple_state_dtypes(torch.bfloat16)[index]
    state = torch.zeros((6, *shape), dtype=dtype)
    spec = copy_whole_state(state, [4, 2, 5], 1, 1)
    assert spec.start_addr == state[2].data_ptr()
    assert spec.num_elements == state[2].numel()


def test_speculative_copy_is_refused():
    state = torch.zeros((4, 2), dtype=torch.int64)
    with pytest.raises(NotImplementedError):
        copy_whole_state(state, [0, 1, 2], 0, 2)
