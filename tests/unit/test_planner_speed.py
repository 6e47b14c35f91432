"""The decode-speed estimate's arithmetic, its planner hook, and the bench that feeds it.

Why: the 4x RTX 3090 estimate splits a one-GPU measurement of the ``real-rank`` preset into memory
time and overhead, which is only sound if that preset's bytes per step are what one rank of the full
model at TP=4 reads, if expert parallelism is priced by the busiest rank, and if the estimate moves
the right way with each input it takes.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import Qwen4ExpTextConfig

from model.runtime.expert_format import ExpertFormat
from model.tools.checkpoints import preset_spec
from model.tools.planner import load_config, marlin_moe_misfit, weights_per_rank
from model.tools.planner_speed import (
    LINKS,
    SM_THROUGHPUT_RATIO,
    Inputs,
    decode_bytes_per_step,
    estimate_rtx3090,
    expected_distinct_experts,
    expected_max_experts_on_a_rank,
    fit_overhead,
)

ROOT = Path(__file__).resolve().parents[2]
FULL = ROOT / "deploy" / "qwen4-exp-config.example.json"
BENCH = ROOT / "bench" / "bench_real_shape.py"
SIBLING = ROOT / "bench" / "data" / "qwen38-flash-next-text-config.json"
MEASURED = {
    "gpu": "NVIDIA H200",
    "hbm_gbps": 4800.0,
    "results": [
        {"variant": "upstream", "experts": "bf16", "ok": False, "error": "RuntimeError: x"},
        {"variant": "served", "experts": "int4", "ok": True, "tps": {"1": 100.0, "16": 1000.0, "64": 2500.0}},
    ],
}


@pytest.fixture(scope="module")
def full():
    return load_config(FULL)


@pytest.fixture(scope="module")
def rank():
    return Qwen4ExpTextConfig(**preset_spec("real-rank"), eos_token_id=1, tie_word_embeddings=False)


def _bytes(config, tp, fmt="bf16", batch=1):
    return decode_bytes_per_step(config, tp, fmt, weights_per_rank=weights_per_rank, batch=batch)


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_real_rank_reads_what_one_rank_of_the_full_model_reads(full, rank, fmt):
    at_tp4, one_rank = _bytes(full, 4, fmt), _bytes(rank, 1, fmt)
    assert one_rank.parts == at_tp4.parts
    assert one_rank.total == pytest.approx(at_tp4.total, rel=1e-9)


def test_sharded_parts_quarter_replicated_parts_stay_experts_become_top_k(full):
    tp1, tp4 = _bytes(full, 1), _bytes(full, 4)
    for part in ("lm_head (vocab shard)", "GDN (linear attention)", "shared expert"):
        assert tp4.parts[part] == pytest.approx(tp1.parts[part] / 4, rel=1e-3), part
    for part in ("QSA indexer", "router + shared-expert gate", "hyper-connections"):
        assert tp4.parts[part] == tp1.parts[part], part
    # Two KV heads: replicated once TP exceeds them, so the attention part shrinks by less than 4x.
    assert tp1.parts["QSA attention (q/k/v/o)"] / 4 < tp4.parts["QSA attention (q/k/v/o)"]
    all_experts = next(p for p in weights_per_rank(full, 4, "bf16") if p.name.startswith("routed"))
    k, e = full.num_experts_per_tok, full.num_experts
    assert tp4.parts["routed experts (bf16)"] == pytest.approx(all_experts.bytes_per_rank * k / e, rel=1e-9)
    assert tp4.experts_read == k
    # The embedding is looked up, not read: half of "embed_tokens + lm_head".
    both = next(p for p in weights_per_rank(full, 4, "bf16") if p.name.startswith("embed_tokens"))
    assert tp4.parts["lm_head (vocab shard)"] == both.bytes_per_rank // 2


def test_int4_experts_read_fewer_bytes_and_larger_batches_read_more_experts(full):
    assert _bytes(full, 4, "int4").total < _bytes(full, 4, "bf16").total
    assert expected_distinct_experts(512, 10, 1) == 10
    assert 10 < expected_distinct_experts(512, 10, 16) < expected_distinct_experts(512, 10, 64) < 512
    assert _bytes(full, 4, batch=16).total > _bytes(full, 4, batch=1).total


def _tok_s(full, **kw):
    est = estimate_rtx3090(MEASURED, full, full, weights_per_rank=weights_per_rank, **kw)
    return {r.batch: r.tok_s for r in est.rows}


def test_estimate_is_monotone_in_each_input(full):
    base = _tok_s(full)
    assert sorted(base) == [1, 16, 64]
    link = LINKS["no-p2p"]
    variants = {
        "faster memory": (_tok_s(full, inputs=Inputs(rtx3090_gbps=1500.0)), 1),
        "more efficient memory": (_tok_s(full, inputs=Inputs(memory_efficiency=0.95)), 1),
        "slower link": (_tok_s(full, inputs=Inputs(link=replace(link, busbw_gbps=2.0))), -1),
        "more latency": (_tok_s(full, inputs=Inputs(link=replace(link, latency_us=100.0))), -1),
        "peer-to-peer": (_tok_s(full, inputs=Inputs(link=LINKS["p2p"])), 1),
        "slower SMs": (_tok_s(full, inputs=Inputs(overhead_scale=SM_THROUGHPUT_RATIO)), -1),
    }
    for name, (got, sign) in variants.items():
        for b in base:
            assert (got[b] - base[b]) * sign > 0, (name, b)
    for b in base:  # never faster than the measuring GPU, which has 5x the bandwidth and no collectives
        assert base[b] < MEASURED["results"][1]["tps"][str(b)]
    est = estimate_rtx3090(MEASURED, full, full, weights_per_rank=weights_per_rank)
    assert all(r.tok_s <= r.bound_tok_s for r in est.rows)


def test_the_overhead_fit_reproduces_the_measured_steps(full):
    """Memory time + fitted overhead at the measuring GPU's own bandwidth gives back each measured
    step (to the fit's residual): the split loses nothing of what was measured."""
    row = MEASURED["results"][1]
    over = fit_overhead(row, full, 4, weights_per_rank=weights_per_rank, hbm_gbps=4800.0, efficiency=0.85)
    assert over.per_expert_s > 0  # larger batches touch more experts and cost more per layer
    for b, per_layer in over.points.items():
        fitted = over.per_layer(expected_distinct_experts(512, 10, b))
        assert fitted == pytest.approx(per_layer, rel=0.15), b
    h200 = Inputs(rtx3090_gbps=4800.0, overhead_scale=1.0, link=replace(LINKS["p2p"], latency_us=0.0))
    for b, tok_s in _tok_s(full, inputs=h200, tp=1).items():
        assert tok_s == pytest.approx(row["tps"][str(b)], rel=0.2), b


def test_expert_parallel_keeps_the_bytes_and_prices_the_busiest_rank(full):
    tp_parts = {p.name: p.bytes_per_rank for p in weights_per_rank(full, 4, "int4")}
    ep_parts = {p.name: p.bytes_per_rank for p in weights_per_rank(full, 4, "int4", expert_parallel=True)}
    assert ep_parts == pytest.approx(tp_parts, rel=0.01)  # same bytes up to the scales' rounding
    # One token's 10 experts over 4 ranks of 128: the busiest rank holds more than the mean 2.5.
    most = expected_max_experts_on_a_rank(512, 10, 4)
    assert 2.5 < most < 10
    assert expected_max_experts_on_a_rank(512, 10, 1) == pytest.approx(10)
    ep1 = _bytes_ep(full, 1)
    assert ep1.experts_read == pytest.approx(most)
    assert ep1.total > _bytes(full, 4, "int4").total  # whole experts: the straggler reads more at batch 1
    assert _bytes_ep(full, 64).experts_read == pytest.approx(expected_distinct_experts(512, 10, 64) / 4)


def _bytes_ep(config, batch):
    return decode_bytes_per_step(
        config, 4, "int4", weights_per_rank=weights_per_rank, batch=batch, expert_parallel=True
    )


def test_marlin_refuses_the_sibling_at_tp4_without_expert_parallelism():
    """The sibling's experts are 640 wide: a quarter (160) is no multiple of the int4 group (128), so
    Marlin cannot take TP-sharded experts and expert parallelism is the layout that serves them;
    the planner says so instead of planning a deployment vLLM would refuse."""
    sibling, int4 = load_config(SIBLING), ExpertFormat("int4")
    why = marlin_moe_misfit(sibling, 4, int4, expert_parallel=False)
    assert "160" in why and "QWEN4EXP_EXPERT_PARALLEL=auto or on" in why
    assert marlin_moe_misfit(sibling, 4, int4, expert_parallel=True) is None
    assert marlin_moe_misfit(load_config(FULL), 4, int4, expert_parallel=False) is None
    planner = [sys.executable, "-m", "model.tools.planner", str(SIBLING), "--expert-parallel"]
    off = subprocess.run([*planner, "off"], cwd=ROOT, capture_output=True, text=True)
    assert off.returncode == 2 and "QWEN4EXP_EXPERT_PARALLEL=auto or on" in off.stderr
    auto = subprocess.run([*planner, "auto"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "expert-parallel (128 whole experts per rank)" in auto
    assert "expert parallelism planned (QWEN4EXP_EXPERT_PARALLEL=auto)" in auto
    ours = subprocess.run(
        [*planner[:3], str(FULL)], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "TP-sharded (intermediate)" in ours  # auto keeps the slices where they fit


def test_estimate_picks_the_served_row_and_refuses_a_measurement_where_nothing_ran(full):
    est = estimate_rtx3090(MEASURED, full, full, weights_per_rank=weights_per_rank)
    assert est.source == "served/int4" and est.expert_format == "int4"
    assert any("936" in a for a in est.assumptions)
    with pytest.raises(ValueError, match="no variant that ran"):
        estimate_rtx3090({"results": [MEASURED["results"][0]]}, full, full, weights_per_rank=weights_per_rank)


def test_planner_prints_the_estimate_beside_the_memory_table(tmp_path):
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps(MEASURED))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "model.tools.planner",
            str(FULL),
            "--speed",
            str(speed),
            "--allreduce-latency-us",
            "20",
            "--batches",
            "1,4,64",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "## Weights per GPU" in out
    title = "Decode speed estimate: 4x RTX 3090, TP=4, 40 layers (from served/int4 on NVIDIA H200)"
    assert out.count(title) == 2  # overhead at both ends of its range
    assert "x1.00 on the 3090" in out and f"x{SM_THROUGHPUT_RATIO:.2f} on the 3090" in out
    assert "20 us per call" in out
    assert out.count("| 4 |") == 2 and out.count("| 64 |") == 2


def test_the_published_comparison_runs_on_the_recorded_measurement():
    out = subprocess.run(
        [sys.executable, "bench/published_3090.py", "bench/results/real_shape_int4_h200.json"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "halt95" in out and "alesha-pro" in out and "| expert-parallel | p2p |" in out


def test_bench_help_runs_and_the_bench_imports_nothing_from_tests():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "--hbm-gbps" in out and "--json" in out
    for node in ast.walk(ast.parse(BENCH.read_text())):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "tests" for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] != "tests"


def test_bench_checkpoint_has_no_weights_and_int4_experts_only(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_real_shape", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = bench.write_checkpoint("real-rank", tmp_path / "int4", "int4")
    assert not list(path.glob("*.safetensors"))
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["weights"]["num_bits"] == 4 and group["weights"]["group_size"] == 128
    assert all("experts" in t for t in group["targets"])
    assert "lm_head" in qc["ignore"]
    at_rank = bench.step_bytes(path, "int4")
    assert at_rank == _bytes(load_config(FULL), 4, "int4").total
