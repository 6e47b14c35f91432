"""The ``qsa512`` preset: the checkpoint the ours-vs-upstream GPU bench runs on.

Upstream vLLM's Qwen4-Exp only takes 512/1024/2048 selected blocks and rejects a null
``output_gate_type``, so a preset change that breaks either would only show on the GPU machine;
this catches it on CPU. No training (``train_steps=0``): the shapes and the saved config are what
matter here, and an untrained save takes seconds.
"""

from __future__ import annotations

import json

from model.checkpoints import PRESETS, make_checkpoint


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
