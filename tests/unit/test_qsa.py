"""QSA token selection and QSA attention against transformers' modules on the same weights."""

from __future__ import annotations

import pytest
import torch

from model.ops.norms import rms_norm_one_plus
from model.ops.qsa_indexer import pooled_block_keys, select_tokens
from model.ops.qsa_sparse_attention import sparse_paged_attention_ref
from model.ops.rope import apply_rope, inverse_frequencies, rope_cos_sin

from .helpers import preset_config, randomize

LENGTH = 150  # several times the budget of both presets


def _reference_inputs(config, length: int, dtype=torch.bfloat16):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

    hidden = torch.randn(1, length, config.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    positions = torch.arange(length).unsqueeze(0)
    cos, sin = Qwen4ExpTextRotaryEmbedding(config)(hidden, positions)
    mask = torch.tril(torch.ones(length, length, dtype=torch.bool)).view(1, 1, length, length)
    return hidden, (cos, sin), mask


def _inv_freq(config):
    rope = config.rope_parameters
    rotary = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
    return inverse_frequencies(rotary, rope["rope_theta"])


def _selection(indexer, config, hidden):
    """Our selection for every position of one request, as the reference's boolean mask."""
    length = hidden.shape[0]
    cos, sin = rope_cos_sin(torch.arange(length), _inv_freq(config), hidden.dtype)
    qk = torch.nn.functional.linear(hidden, indexer.index_qk_proj.weight)
    heads, dim = config.indexer_n_heads, config.indexer_head_dim
    q, raw = qk.split([heads * dim, dim], dim=-1)
    q = apply_rope(
        rms_norm_one_plus(q.view(length, heads, dim), indexer.q_layernorm.weight, config.rms_norm_eps),
        cos,
        sin,
    )
    keys = pooled_block_keys(
        raw, config.indexer_compress_ratio, indexer.k_layernorm.weight, config.rms_norm_eps, _inv_freq(config)
    )
    return select_tokens(q, torch.arange(length), keys, config.indexer_budget, config.indexer_compress_ratio)


@pytest.mark.parametrize("preset", ["tiny", "wide"])
def test_indexer_selection_matches_reference(preset):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    config = preset_config(preset)
    indexer = randomize(Qwen4ExpTextQSAIndexer(config, layer_idx=3)).to(torch.bfloat16)
    hidden, pos_emb, mask = _reference_inputs(config, LENGTH)
    with torch.no_grad():
        expected = indexer(hidden, pos_emb, mask, None)[0, 0]
        selected, counts = _selection(indexer, config, hidden[0])
    got = torch.zeros_like(expected)
    for i in range(LENGTH):
        got[i, selected[i, : counts[i]].long()] = True
    assert torch.equal(got, expected)
    # Selection is really sparse at the end and never exceeds budget + tail.
    width = config.indexer_budget + config.indexer_compress_ratio - 1
    assert int(counts.max()) <= width and int(counts[-1]) < LENGTH


@pytest.mark.parametrize("preset", ["tiny", "wide"])
def test_qsa_attention_matches_reference(preset):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention

    config = preset_config(preset)
    config._attn_implementation = "sdpa"
    attn = randomize(Qwen4ExpTextAttention(config, layer_idx=3)).to(torch.bfloat16)
    hidden, pos_emb, mask = _reference_inputs(config, LENGTH)
    with torch.no_grad():
        expected = attn(hidden, pos_emb, mask)[0][0]

        x = hidden[0]
        heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        eps = config.rms_norm_eps
        cos, sin = rope_cos_sin(torch.arange(LENGTH), _inv_freq(config), x.dtype)
        q, gate = (
            torch.nn.functional.linear(x, attn.q_proj.weight).view(LENGTH, heads, 2 * d).chunk(2, dim=-1)
        )
        q = apply_rope(rms_norm_one_plus(q, attn.q_norm.weight, eps), cos, sin)
        k = torch.nn.functional.linear(x, attn.k_proj.weight).view(LENGTH, kv_heads, d)
        k = apply_rope(rms_norm_one_plus(k, attn.k_norm.weight, eps), cos, sin)
        v = torch.nn.functional.linear(x, attn.v_proj.weight).view(LENGTH, kv_heads, d)
        selected, counts = _selection(attn.indexer, config, x)
        # The request's cache as pages of 16 tokens scattered over a larger pool, as vLLM lays it out.
        block, pages = 16, -(-LENGTH // 16)
        table = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:pages].int().unsqueeze(0)
        k_cache = torch.zeros(64, block, kv_heads, d, dtype=x.dtype)
        v_cache = torch.zeros_like(k_cache)
        pos = torch.arange(LENGTH)
        k_cache[table[0, pos // block].long(), pos % block] = k
        v_cache[table[0, pos // block].long(), pos % block] = v
        out = sparse_paged_attention_ref(
            q, k_cache, v_cache, table, torch.zeros(LENGTH, dtype=torch.int32), selected, counts, d**-0.5
        )
        out = out.reshape(LENGTH, -1) * torch.sigmoid(gate.reshape(LENGTH, -1))
        got = torch.nn.functional.linear(out, attn.o_proj.weight)
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02)
