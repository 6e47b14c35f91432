"""The ``qsa512`` preset: the checkpoint the ours-vs-upstream GPU bench runs on.

Upstream vLLM's Qwen4-Exp only takes 512/1024/2048 selected blocks and rejects a null
``output_gate_type``, so a preset change that breaks either would only show on the GPU machine;
this catches it on CPU. No training (``train_steps=0``): the shapes and the saved config are what
matter here, and an untrained save takes seconds.
"""

from __future__ import annotations

import json

from model.tools.checkpoints import PRESETS, make_checkpoint


def test_qsa512_selects_512_blocks_and_loads(tmp_path):
    spec = PRESETS["qsa512"]
    assert spec["indexer_budget"] // spec["indexer_compress_ratio"] == 512
    assert spec["indexer_budget"] % spec["indexer_compress_ratio"] == 0

    out = make_checkpoint("qsa512", tmp_path / "qsa512", train_steps=0)
    config = json.loads((out / "config.json").read_text())
    # transformers treats null as hidden_act; upstream needs the value written out.
    assert config["output_gate_type"] == "silu" == config["hidden_act"]
    assert config["layer_types"].count("indexed_attention") == 2

    from transformers import AutoConfig, Qwen4ExpForCausalLM

    loaded = AutoConfig.from_pretrained(out)
    assert loaded.indexer_budget // loaded.indexer_compress_ratio == 512
    model = Qwen4ExpForCausalLM.from_pretrained(out)
    assert model.config.indexer_head_dim == 128
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size < 60 * 2**20, size


def test_real_compute_preset_is_served_by_upstream_on_both_cards():
    """``real-compute`` (GPU timing only, ~4B parameters, never saved here): upstream must take it on
    an H200 and an RTX 3090 (top-k 512, output gate written out, index heads within the 3090's shared
    memory), with the real config's per-token shapes, RoPE width included."""
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from model.deployment.implementation import problems_for_upstream

    spec = PRESETS["real-compute"]
    written = {**spec, "eos_token_id": 2}  # make_checkpoint writes the tokenizer's EOS id
    for capability, shared in (((9, 0), 232448), ((8, 6), 101376)):
        facts = dict(cuda=True, capability=capability, kv_cache_dtype="auto", v2_runner=True)
        assert problems_for_upstream(written, {}, shared_memory_per_block=shared, **facts) == []
    config = Qwen4ExpTextConfig(**spec, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    assert config.layer_types.count("indexed_attention") == 10
    # RoPE on 64 of the 256 dimensions: transformers' rotary embedding interleaves its MRoPE sections
    # over exactly that many, and upstream's fused QSA prepare needs it (indexer_qsa.py,
    # _supports_fused_pre_indexer: rotary_dim 64, index heads of 128, one key head, ratio a power of 2).
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

    rotary_dim = int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
    rope = Qwen4ExpTextRotaryEmbedding(config)
    assert rotary_dim == 2 * rope.inv_freq.numel() == 2 * sum(rope.mrope_section) == 64
    assert config.indexer_head_dim == 128 and config.indexer_kv_heads == 1
    assert config.indexer_compress_ratio & (config.indexer_compress_ratio - 1) == 0
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    assert 3.5e9 < params < 4.5e9, params


def test_weights_drawn_off_the_cpu_are_never_trained(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="training runs on the CPU only"):
        make_checkpoint("tiny", tmp_path / "t", train_steps=5, device="cuda")
