"""The fit planner on the real-size example config, and the defaults that come from it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from model.tools.planner import (
    GIB,
    Machine,
    Options,
    load_config,
    main,
    make_plan,
    plan_cache,
    ple_tables,
    weights_per_rank,
)
from tests.conftest import ROOT

from .tools import EXAMPLE_CONFIG


@pytest.fixture(scope="module")
def plan():
    return make_plan(
        EXAMPLE_CONFIG, Machine(gpus=4, gpu_mem_gib=23.7, host_ram_gib=128), Options(ple_format="fp8_e4m3")
    )


def test_example_config_is_transformers_defaults_plus_stated_ple_qsa_settings():
    from transformers import Qwen4ExpTextConfig

    ours = json.loads(EXAMPLE_CONFIG.read_text())
    defaults = Qwen4ExpTextConfig().to_dict()
    stated = {
        "ple_layer_ids", "ple_embed_dim", "ngram_vocab_size_base", "number_of_conv_states", "indexer_n_heads",
        "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio", "eos_token_id",
        "pad_token_id", "rope_parameters", "architectures", "dtype",
    }  # fmt: skip
    differing = {k for k, v in ours.items() if k in defaults and defaults[k] != v}
    assert differing <= stated, differing - stated
    assert ours["indexer_budget"] == 2048 and ours["indexer_compress_ratio"] == 4


def test_ple_is_about_45b_parameters(plan):
    assert 44e9 < plan.ple.params_total < 46e9
    assert plan.ple.bytes_total["bf16"] == 2 * plan.ple.params_total
    # ETP: each of 4 ranks holds a quarter of the rows (the first ranks one row more).
    assert plan.ple.bytes_per_rank["fp8_e4m3"] * 4 == pytest.approx(
        plan.ple.bytes_total["fp8_e4m3"], rel=1e-6
    )
    assert plan.recommended_ple_format == "fp8_e4m3"


def test_sharding_rules():
    c = load_config(EXAMPLE_CONFIG)
    one = {p.name.split(" (")[0]: p for p in weights_per_rank(c, 1)}
    four = {p.name.split(" (")[0]: p for p in weights_per_rank(c, 4)}
    for part in ("routed experts", "shared expert", "embed_tokens + lm_head"):
        assert four[part].params_per_rank * 4 == one[part].params_per_rank, part
    # GDN: everything sharded except the per-head-dim norm (128 params per layer).
    assert four["GDN"].params_per_rank * 4 - one["GDN"].params_per_rank == 30 * 3 * 128
    for part in (
        "QSA indexer",
        "hyper-connections",
        "router + shared-expert gate",
        "PLE projections/norms/conv",
    ):
        assert four[part].params_per_rank == one[part].params_per_rank, part
    # 2 KV heads over 4 ranks: each rank keeps one (replicated) KV head, so K/V do not shrink 4x.
    assert four["QSA attention"].params_per_rank * 4 > one["QSA attention"].params_per_rank
    bf16 = plan_cache(c, 4, kv_dtype="bf16")
    fp8 = plan_cache(c, 4, kv_dtype="fp8")
    assert bf16.qsa_row_bytes == 2 * (2 * 1 * 256 + 128) and fp8.qsa_row_bytes == 2 * 256 + 2 * 128
    assert fp8.gdn_state_bytes == 3 * (8192 // 4) * 2 + (32 // 4) * 128 * 128 * 2


def test_bf16_experts_do_not_fit_a_3090(plan):
    assert plan.weights_fit_by_format["bf16"] > 23.7
    assert plan.weights_fit_by_format["int4"] < 12
    bf16 = make_plan(EXAMPLE_CONFIG, Machine(), Options(expert_weights="bf16"))
    assert bf16.capacity.sequences_fit == 0 and any("does not fit" in n for n in bf16.notes)


def test_compose_and_chart_defaults_come_from_the_plan(plan):
    assert plan.capacity.sequences_fit >= 32
    values = yaml.safe_load((ROOT / "k8s/qwen4exp/values.yaml").read_text())
    env = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if "=" in line and line[0] != "#"
    )
    for max_seqs in (values["engine"]["maxNumSeqs"], int(env["QWEN4EXP_MAX_NUM_SEQS"])):
        assert max_seqs <= plan.capacity.sequences_fit
    assert int(env["QWEN4EXP_MAX_MODEL_LEN"]) == values["engine"]["maxModelLen"] == plan.seq_len
    assert float(env["QWEN4EXP_GPU_MEMORY_UTILIZATION"]) == values["engine"]["gpuMemoryUtilization"]
    assert values["engine"]["gpuMemoryUtilization"] == plan.options.gpu_memory_utilization
    assert env["QWEN4EXP_KV_CACHE_DTYPE"] == values["engine"]["kvCacheDtype"] == plan.options.kv_cache_dtype
    assert (
        int(values["resources"]["memory"].removesuffix("Gi")) >= plan.memory_request_gib
    )  # requests == limits
    assert values["shmSize"] == f"{int(plan.options.shm_gib)}Gi"


def test_cli_prints_the_plan_and_json(capsys):
    args = [str(EXAMPLE_CONFIG), "--ple-format", "fp8_e4m3"]
    proc = subprocess.run(
        [sys.executable, "-m", "model.tools.planner", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for heading in (
        "Weights per GPU",
        "KV cache and per-request state",
        "sequences of 32,768 tokens",
        "PLE tables",
    ):
        assert heading in proc.stdout
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["capacity"]["kv_cache_bytes"] < 23.7 * GIB
    assert main([str(EXAMPLE_CONFIG), "--tp", "3"]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_tiny_ple_rows_match_checkpoint_shards():
    from safetensors import safe_open

    from tests.conftest import ensure_checkpoint

    ckpt = ensure_checkpoint("tiny")
    tables = ple_tables(load_config(ckpt), tp=1)
    rows = {}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if ".ngram_embedding.shard_" in name:
                layer = name.split(".ple.")[0]
                rows[layer] = rows.get(layer, 0) + f.get_slice(name).get_shape()[0]
    assert sorted(rows.values()) == sorted(tables.rows_per_layer)
