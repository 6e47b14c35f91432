"""n-gram ids and the PLE layer against transformers' modules on the same weights."""

from __future__ import annotations

import pytest
import torch

from model.ple.ngram_hash import layout_from_config, next_context, ngram_row_ids, token_windows
from model.ple.reference import dilated_causal_conv, ple_gated_values

from .helpers import preset_config, randomize, tokens_with_eos


def _chunked_rows(ids: torch.Tensor, layout, chunks: list[int]) -> torch.Tensor:
    """Row ids computed step by step, carrying the last n-1 tokens like the serving state does."""
    context = torch.full((1, layout.context_len), layout.eos_token_id, dtype=torch.long)
    rows, start = [], 0
    for size in chunks:
        part = ids[start : start + size]
        qsl = torch.tensor([0, part.numel()])
        windows = token_windows(part, context, qsl)
        rows.append(ngram_row_ids(windows, layout))
        context = next_context(windows, qsl, context)
        start += size
    return torch.cat(rows)


@pytest.mark.parametrize("preset", ["tiny", "wide"])
@pytest.mark.parametrize("ple_index", [0, 1])
def test_hash_layout_matches_reference_buffers(preset, ple_index):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    config = preset_config(preset)
    ref = Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, layer_idx=0, ple_layer_index=ple_index)
    layout = layout_from_config(config, ple_index)
    assert list(layout.multipliers) == ref.layer_multipliers.tolist()
    assert list(layout.head_vocab_sizes) == ref.ngram_heads_vocab_sizes.tolist()
    assert list(layout.head_offsets) == ref.ngram_heads_offsets.tolist()
    assert layout.padded_rows == ref.ngram_embedding.weight.shape[0]


@pytest.mark.parametrize("preset", ["tiny", "wide"])
@pytest.mark.parametrize("chunks", [[57], [20, 1, 1, 1, 34], [1] * 57, [3, 50, 4]])
def test_ngram_embeddings_match_reference_across_steps(preset, chunks):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    config = preset_config(preset)
    ref = randomize(Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, layer_idx=0, ple_layer_index=1))
    ids = tokens_with_eos(57, config.vocab_size, 2, seed=len(chunks))
    expected = ref(ids.unsqueeze(0), None)[0]
    rows = _chunked_rows(ids, layout_from_config(config, 1), chunks)
    got = ref.ngram_embedding.weight[rows].flatten(-2)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_batched_requests_hash_independently():
    config = preset_config("wide")
    layout = layout_from_config(config, 0)
    a, b = tokens_with_eos(30, config.vocab_size, 2, 1), tokens_with_eos(11, config.vocab_size, 2, 2)
    ctx = torch.full((2, layout.context_len), 2, dtype=torch.long)
    ctx[1] = torch.tensor([7, 8, 9])  # request b continues after three earlier tokens
    qsl = torch.tensor([0, 30, 41])
    batched = ngram_row_ids(token_windows(torch.cat([a, b]), ctx, qsl), layout)
    alone_a = ngram_row_ids(token_windows(a, ctx[:1], torch.tensor([0, 30])), layout)
    alone_b = ngram_row_ids(token_windows(b, ctx[1:], torch.tensor([0, 11])), layout)
    assert torch.equal(batched, torch.cat([alone_a, alone_b]))
    whole = ngram_row_ids(
        token_windows(torch.cat([torch.tensor([7, 8, 9]), b]), ctx[:1], torch.tensor([0, 14])), layout
    )
    assert torch.equal(alone_b, whole[3:])


@pytest.mark.parametrize("preset", ["tiny", "wide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ple_layer_matches_reference(preset, dtype):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

    config = preset_config(preset)
    ref = randomize(Qwen4ExpTextPLELayer(config, layer_idx=0, ple_layer_index=0)).to(dtype)
    length, width = 41, config.hc_count * config.hidden_size
    ids = tokens_with_eos(length, config.vocab_size, 2, seed=3)
    streams = torch.randn(1, length, width, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        expected = ref(streams, ids.unsqueeze(0), None)[0]

    layout = layout_from_config(config, 0)
    state_len = (config.ple_conv_kernel_size - 1) * config.ngram_size
    conv_state = torch.zeros(state_len, width, dtype=dtype)
    table = ref.ple_embedding.ngram_embedding.weight
    outs, start = [], 0
    rows = _chunked_rows(ids, layout, [17, 1, 1, 22])
    with torch.no_grad():
        for size in [17, 1, 1, 22]:
            sl = slice(start, start + size)
            gated, conv_in = ple_gated_values(
                streams[0, sl],
                table[rows[sl]].flatten(-2),
                ref.key_proj.weight,
                ref.value_proj.weight,
                ref.norm_key.weight,
                ref.norm_query.weight,
                ref.norm_conv.weight,
                config.hc_count,
                config.hidden_size,
                config.rms_norm_eps,
            )
            conv, conv_state = dilated_causal_conv(
                conv_in, conv_state, ref.conv1d.weight.squeeze(1), config.ngram_size
            )
            outs.append(gated + conv)
            start += size
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    torch.testing.assert_close(torch.cat(outs), expected, **tol)
