"""The planner reads the checkpoint's quantization_config and sizes the experts as vLLM allocates them."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from model.runtime.expert_format import ExpertFormat, checkpoint_expert_format
from model.tools.planner import GIB, Machine, Options, load_config, main, make_plan, weights_per_rank
from tests.deploy.tools import EXAMPLE_CONFIG

from .test_vllm_quant import _flags, probe

DTYPE_BYTES = {
    "torch.bfloat16": 2,
    "torch.float32": 4,
    "torch.int32": 4,
    "torch.float8_e4m3fn": 1,
    "torch.int64": 8,
}


@pytest.mark.parametrize(
    ("case", "want"),
    [
        ("tiny", ExpertFormat("bf16", source="checkpoint")),
        ("tiny-w4a16", ExpertFormat("int4", 64, source="checkpoint")),
        ("tiny-fp8", ExpertFormat("fp8", 64, source="checkpoint")),
        ("wide-fp8", ExpertFormat("fp8", 32, source="checkpoint")),
    ],
)
def test_reads_the_expert_format_from_quantization_config(quant_checkpoints, case, want):
    assert checkpoint_expert_format(load_config(quant_checkpoints[case])) == want


def test_refuses_what_it_does_not_model(quant_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"quantizes dense layers too \(model\.layers\.0\.self_attn\.q_proj"):
        checkpoint_expert_format(load_config(quant_checkpoints["wide-w4a16"]))
    dst = shutil.copytree(quant_checkpoints["tiny-w4a16"], tmp_path / "odd")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (dst / "config.json").write_text(json.dumps(cfg))
    assert main([str(dst), "--gpus", "1", "--device", "cpu"]) == 2


@pytest.mark.parametrize("case", ["tiny-w4a16", "tiny-fp8", "wide-fp8"])
def test_weights_equal_the_parameters_vllm_allocates(quant_checkpoints, case):
    """Byte for byte against the parameters vLLM's quantization methods created for our model
    (load probe: this host has no kernel to start an engine with quantized experts)."""
    result = probe(quant_checkpoints[case], *_flags(case, quant_checkpoints[case]))
    assert "error" not in result, result["error"]
    vllm_bytes = sum(DTYPE_BYTES[d] * math.prod(shape) for d, shape in result["params"].values())
    config = load_config(quant_checkpoints[case])
    parts = weights_per_rank(config, 1, checkpoint_expert_format(config))
    assert sum(p.bytes_per_rank for p in parts) == vllm_bytes
    experts = sum(
        DTYPE_BYTES[d] * math.prod(s) for n, (d, s) in result["params"].items() if ".routed_experts." in n
    )
    assert next(p.bytes_per_rank for p in parts if p.name.startswith("routed experts")) == experts


def test_cli_plans_the_checkpoint_as_stored(quant_checkpoints, capsys):
    assert (
        main([str(quant_checkpoints["tiny-w4a16"]), "--gpus", "1", "--device", "cpu", "--kv-cache-gib", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "routed experts int4, group 64 (checkpoint)" in out
    assert "| routed experts (int4, group 64) |" in out


def test_real_config_at_tp4_on_3090s_fits_with_fp8_or_int4_experts_only():
    plans = {
        f: make_plan(EXAMPLE_CONFIG, Machine(4, 23.7, 128), Options(expert_weights=f, ple_format="fp8_e4m3"))
        for f in ("bf16", "fp8", "int4")
    }
    assert plans["bf16"].capacity.sequences_fit == 0 and plans["bf16"].weights_bytes_per_rank > 30 * GIB
    assert 0 < plans["fp8"].capacity.sequences_fit < plans["int4"].capacity.sequences_fit
    assert any("stores bf16 routed experts; this plan assumes int4" in n for n in plans["int4"].notes)
    # fp8 block 128 experts per rank: 1 byte per weight + one fp32 scale per 128x128 block.
    routed = next(p for p in plans["fp8"].weights if p.name.startswith("routed experts"))
    assert routed.bytes_per_rank == pytest.approx(routed.params_per_rank * (1 + 4 / 128**2))
