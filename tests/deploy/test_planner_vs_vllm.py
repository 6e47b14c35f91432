"""The fit planner against a real vLLM engine (CPU build) serving the tiny checkpoint.

What is compared, and why it carries over to the GPUs: the planner does not measure anything, it
re-derives the numbers vLLM derives. On the CPU the same code paths run as on CUDA, with two
platform constants that are planner options (default block size 128 instead of 16; the KV budget is
``VLLM_CPU_KVCACHE_SPACE`` instead of gpu_memory_utilization minus weights and activations). So:

* weights: the parameter bytes our vLLM model allocates (worker process, TP=1) equal the planner's
  per-rank weights to the byte, and each PLE table's storage equals the planner's ETP row count x
  row bytes;
* KV/state: the per-layer specs vLLM collected (QSA row width, FP8 row of uint8, GDN and PLE state
  sizes) and the block size/page size after vLLM's hybrid alignment and page unification equal the
  planner's ``plan_cache``;
* capacity: vLLM's own start-up line "KV cache size: N tokens, Maximum concurrency for L tokens per
  request: Xx" and the number of blocks equal the planner's ``capacity`` for the same KV budget.

The engine runs with the FP8 KV cache, so the planner's FP8 row (1-byte K/V codes, bf16 index key)
and the non-trivial block growth (128 -> 256 tokens to fit the GDN state) are both exercised.

It runs twice: with vLLM's default SSM-state dtype, which is the model dtype on most CPUs but
float32 on CPUs with AVX512-BF16 (vLLM's CPU platform resets it there; the planner detects the
host), and with ``mamba_ssm_cache_dtype=float32`` explicitly, so that the AVX512-BF16 hosts'
page and block arithmetic (a 2x larger GDN state, blocks of 384 tokens) is checked against vLLM
on every host.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from model.tools.planner import (
    DEFAULT_BLOCK_SIZE,
    GIB,
    capacity,
    load_config,
    plan_cache,
    ple_tables,
    weights_per_rank,
)
from tests.conftest import ROOT, ensure_checkpoint

MAX_LEN = 1024
KV_SPACE_GIB = 1


# vLLM's --mamba-ssm-cache-dtype -> the planner's name for it
SSM_DTYPES = {"auto": "auto", "float32": "fp32"}


@pytest.fixture(scope="module", params=list(SSM_DTYPES))
def ssm_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def probe(tmp_path_factory, ssm_dtype) -> dict:
    ckpt = ensure_checkpoint("tiny")
    scales = tmp_path_factory.mktemp("scales") / "qsa-kv-scales.json"
    scales.write_text(json.dumps({"model.layers.3.self_attn": {"k_scale": 0.02, "v_scale": 0.02}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_QSA_", "VLLM_PLE_", "QWEN4EXP_"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB),
        VLLM_CACHE_ROOT=str(ROOT / ".cache" / "vllm"),
        VLLM_QSA_KV_SCALES=str(scales),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.deploy.vllm_probe", str(ckpt), str(MAX_LEN), "fp8", ssm_dtype],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_JSON=")]
    assert proc.returncode == 0 and marker, (
        f"vLLM probe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    result = json.loads(marker[0].removeprefix("PROBE_JSON="))
    log = proc.stdout + proc.stderr
    size = re.search(
        r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", log
    )
    assert size, f"vLLM's capacity log line not found in the probe output:\n{log[-5000:]}"
    result["log_kv_cache_tokens"] = int(size.group(1).replace(",", ""))
    result["log_max_len"] = int(size.group(2).replace(",", ""))
    result["log_max_concurrency"] = float(size.group(3))
    result["log_lines"] = [ln for ln in log.splitlines() if "KV cache" in ln or "page size" in ln]
    return result


@pytest.fixture(scope="module")
def config():
    return load_config(ensure_checkpoint("tiny"))


def test_weights_equal_vllm_parameters(probe, config):
    parts = weights_per_rank(config, tp=1, expert_format="bf16")
    assert sum(p.params_per_rank for p in parts) == probe["param_count"]
    assert sum(p.bytes_per_rank for p in parts) == probe["param_bytes"]


def test_ple_tables_equal_vllm_storage(probe, config):
    tables = ple_tables(config, tp=1)
    assert tables.layers == len(probe["ple_table_bytes"])
    assert [r * tables.row_dim * 2 for r in tables.rows_per_layer] == probe["ple_table_bytes"]
    assert tables.bytes_per_rank["bf16"] == sum(probe["ple_table_bytes"])


def test_cache_specs_equal_vllm(probe, config, ssm_dtype):
    plan = plan_cache(config, tp=1, kv_dtype="fp8", device="cpu", mamba_ssm_dtype=SSM_DTYPES[ssm_dtype])
    qsa = [g for g in probe["groups"] if g["type"] == "FullAttentionSpec"]
    gdn = [g for g in probe["groups"] if g["type"] == "MambaSpec" and g["layers"][0].endswith("linear_attn")]
    ple = [g for g in probe["groups"] if g["type"] == "MambaSpec" and g["layers"][0].endswith("ple.state")]
    assert (len(qsa), len(gdn), len(ple)) == (plan.qsa_groups, plan.gdn_layers, plan.ple_layers)
    # One uint8 "head" per token: K and V codes of both KV heads + the bf16 index key's bytes.
    assert qsa[0]["dtype"] == "torch.uint8"
    assert qsa[0]["head_size"] == plan.qsa_row_bytes
    assert gdn[0]["real_page_size_bytes"] == plan.gdn_state_bytes
    assert ple[0]["real_page_size_bytes"] == plan.ple_state_bytes
    assert {g["page_size_bytes"] for g in probe["groups"]} == {plan.page_bytes}
    assert qsa[0]["block_size"] == plan.block_size > DEFAULT_BLOCK_SIZE["cpu"]  # grown to fit the GDN state
    assert len(probe["groups"]) == plan.num_groups


def test_capacity_equals_vllm_log_line(probe, config, ssm_dtype):
    plan = plan_cache(config, tp=1, kv_dtype="fp8", device="cpu", mamba_ssm_dtype=SSM_DTYPES[ssm_dtype])
    cap = capacity(plan, KV_SPACE_GIB * GIB, MAX_LEN)
    assert probe["num_blocks"] == cap.num_blocks
    assert probe["log_max_len"] == MAX_LEN, f"vLLM's capacity line not found in: {probe['log_lines']}"
    assert probe["log_kv_cache_tokens"] == cap.kv_cache_tokens
    assert probe["log_max_concurrency"] == pytest.approx(cap.max_concurrency, abs=0.005)
    assert probe["generated"].strip(), "the engine should also generate"
