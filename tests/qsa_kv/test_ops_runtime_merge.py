"""Device ops, the per-layer state, the background runtime and the merge CLI (no engine)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from prometheus_client import REGISTRY

from model.ops.fp8_e4m3 import E4M3_MAX, decode_e4m3, encode_e4m3
from model.qsa_kv import ops
from model.qsa_kv import state as state_mod
from model.qsa_kv.merge import MergeError, merge_directory
from model.qsa_kv.runtime import DUMP_FORMAT, QSAKVRuntime
from model.qsa_kv.settings import FP8_E4M3, QSAKVSettings
from model.qsa_kv.sidecar import load_sidecar
from model.qsa_kv.state import QSAKVState
from tests.conftest import ROOT
from tests.qsa_kv.helpers import run_merge

GEN = torch.Generator().manual_seed(0)


def kv_with_outliers(t: int, scale: float) -> torch.Tensor:
    x = torch.randn(t, 2, 16, generator=GEN) * (50 * scale)
    hot = torch.rand(x.shape, generator=GEN) < 0.05
    x[hot] = 448 * scale * (1.2 + torch.rand(int(hot.sum()), generator=GEN))
    return x.to(torch.bfloat16)


def test_clip_count_is_exactly_what_the_encoder_clamps():
    scale = torch.tensor([0.02])
    k, v = kv_with_outliers(9, 0.02), kv_with_outliers(9, 0.02)
    k[7:] = 1e4  # padding rows: huge, must not count
    slots = torch.tensor([5, 9, 2, 11, 3, 4, 6, -1, -1])
    counter = torch.zeros(2, dtype=torch.int64)
    ptr = counter.data_ptr()
    ops.count_clips_(counter, k, v, scale, scale, slots >= 0)
    codes = encode_e4m3(k[:7], scale)
    clamped = (codes & 0x7F) == 0x7E  # +-448, the largest finite code
    beyond = (k[:7].float() / scale).abs() > E4M3_MAX
    assert torch.equal(clamped & beyond, beyond)  # every counted element was clamped to +-448
    assert int(counter[0]) == int(beyond.sum()) > 0
    assert int(counter[1]) == int(((v[:7].float() / scale).abs() > E4M3_MAX).sum()) > 0
    before = counter.clone()
    ops.count_clips_(counter, k, v, scale, scale, slots >= 0)
    assert counter.data_ptr() == ptr and torch.equal(counter, 2 * before)  # in place, accumulating


def test_absmax_ignores_padding_and_accumulates():
    absmax, tokens = torch.zeros(2), torch.zeros(1, dtype=torch.int64)
    k = torch.tensor([[[1.0, -3.0]], [[2.0, 0.5]], [[900.0, 900.0]]])
    v = torch.tensor([[[0.1, 0.2]], [[-0.7, 0.0]], [[900.0, 900.0]]])
    keep = torch.tensor([True, True, False])
    ops.update_absmax_(absmax, tokens, k, v, keep)
    assert absmax.tolist() == pytest.approx([3.0, 0.7]) and tokens.item() == 2
    ops.update_absmax_(absmax, tokens, k[:1] * 2, v[:1], keep[:1])
    assert absmax.tolist() == pytest.approx([6.0, 0.7]) and tokens.item() == 3


def test_scatter_rows_skips_padding_and_handles_strided_caches():
    backing = torch.arange(5 * 4 * 10, dtype=torch.float32).view(5, 4, 10)
    cache = backing[..., 1:7]  # a non-contiguous [blocks, block_size, C] view, as vLLM may hand out
    before = cache.clone()
    rows = -torch.arange(4 * 6, dtype=torch.float32).view(4, 6) - 1
    slots = torch.tensor([6, -1, 17, -1])  # block 1 offset 2, block 4 offset 1
    ops.scatter_rows_(cache, slots, rows)
    assert torch.equal(cache[1, 2], rows[0]) and torch.equal(cache[4, 1], rows[2])
    untouched = torch.ones(5, 4, dtype=torch.bool)
    untouched[1, 2] = untouched[4, 1] = False
    assert torch.equal(cache[untouched], before[untouched])  # slot 0 (null block) included
    assert torch.equal(backing[..., 0], torch.arange(0, 200, 10, dtype=torch.float32).view(5, 4))


def test_fp8_rows_keep_index_key_bits():
    k8 = encode_e4m3(torch.randn(3, 2, 4, generator=GEN))
    v8 = encode_e4m3(torch.randn(3, 2, 4, generator=GEN))
    index_k = torch.randn(3, 6, generator=GEN).to(torch.bfloat16)
    rows = ops.fp8_rows(k8, v8, index_k, torch.bfloat16)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 2 * 8 + 12)
    assert torch.equal(rows[:, 16:].contiguous().view(torch.bfloat16), index_k)
    assert torch.equal(decode_e4m3(rows[:, :8].reshape(3, 2, 4)), decode_e4m3(k8))


@pytest.fixture
def fresh_runtime(monkeypatch):
    """A private runtime instead of the process-wide one; its threads are stopped afterwards."""
    runtime = QSAKVRuntime()
    monkeypatch.setattr(state_mod, "get_runtime", lambda: runtime)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("vllm.qwen4exp.qsa_kv")
    handler = Keep(level=logging.DEBUG)
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.DEBUG)
    runtime.records = records  # type: ignore[attr-defined]
    yield runtime
    runtime.stop()
    log.removeHandler(handler)
    log.setLevel(old_level)


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_state_applies_sidecar_counts_exports_and_dumps(tmp_path, fresh_runtime):
    layer = "model.layers.11.self_attn"  # unique labels in this process's registry
    sidecar = tmp_path / "scales.json"
    sidecar.write_text(json.dumps({layer: {"k_scale": 0.02, "v_scale": 0.005}}))
    settings = QSAKVSettings(
        scales_path=sidecar, clip_interval_s=3600.0, collect_dir=tmp_path / "dumps", collect_interval_s=3600.0
    )
    st = QSAKVState(
        layer_name=layer, kv_format=FP8_E4M3, settings=settings, expected_layers=[layer], eager=True
    )
    assert st.k_scale.tolist() == [1.0]  # values arrive with apply(), after weight loading
    st.apply()
    assert st.k_scale.tolist() == pytest.approx([0.02]) and st.v_scale.tolist() == pytest.approx([0.005])
    assert sample("qwen4exp_qsa_kv_scale", layer=layer, rank="0", tensor="k") == pytest.approx(0.02)
    assert sample("qwen4exp_qsa_kv_scale", layer=layer, rank="0", tensor="v") == pytest.approx(0.005)
    assert sample("qwen4exp_qsa_kv_clipped_total", layer=layer, rank="0", tensor="k") == 0.0  # series exists
    assert any(
        "k_scale=0.02" in r.getMessage() and str(sidecar) in r.getMessage() for r in fresh_runtime.records
    )

    k, v = kv_with_outliers(6, 0.02), kv_with_outliers(6, 0.005)
    slots = torch.tensor([1, 2, 3, 4, -1, -1])
    st.observe(k, v, slots)
    want = [int(((x[:4].float() / s).abs() > 448).sum()) for x, s in ((k, 0.02), (v, 0.005))]
    assert fresh_runtime.poll_clips() == {layer: want}
    assert sample("qwen4exp_qsa_kv_clipped_total", layer=layer, rank="0", tensor="k") == want[0]
    assert sample("qwen4exp_qsa_kv_clipped_total", layer=layer, rank="0", tensor="v") == want[1]
    warnings = [r.getMessage() for r in fresh_runtime.records if r.levelno == logging.WARNING]
    assert any("clipping" in w and f"K +{want[0]}" in w for w in warnings), warnings
    assert any("clip counter alive" in r.getMessage() for r in fresh_runtime.records)  # heartbeat
    st.observe(k, v, slots)
    fresh_runtime.poll_clips()
    assert sample("qwen4exp_qsa_kv_clipped_total", layer=layer, rank="0", tensor="k") == 2 * want[0]

    path = fresh_runtime.dump_calibration()
    doc = json.loads(path.read_text())
    assert path.name == "qsa_kv_absmax_dp0_pp0_tp0.json" and doc["format"] == DUMP_FORMAT
    entry = doc["layers"][layer]
    assert entry["tokens"] == 8  # 2 steps x 4 real rows
    assert entry["k_absmax"] == pytest.approx(k[:4].float().abs().max().item())
    assert doc["expected_layers"] == [layer] and doc["final"] is False


def test_uncalibrated_fp8_warns_loudly(fresh_runtime):
    layer = "model.layers.12.self_attn"
    st = QSAKVState(
        layer_name=layer, kv_format=FP8_E4M3, settings=QSAKVSettings(), expected_layers=[layer], eager=True
    )
    st.apply()
    warnings = [r.getMessage() for r in fresh_runtime.records if r.levelno == logging.WARNING]
    assert any("UNCALIBRATED FP8 KV CACHE" in w and "k_scale=1 v_scale=1" in w for w in warnings), warnings
    assert sample("qwen4exp_qsa_kv_scale", layer=layer, rank="0", tensor="v") == 1.0


# ---- merge ------------------------------------------------------------------------------------

L3, L7 = "model.layers.3.self_attn", "model.layers.7.self_attn"


def dump(directory, tp_rank, layers, tp_size=2, model="m", pp_rank=0, pp_size=1):
    doc = {
        "format": DUMP_FORMAT,
        "dp_rank": 0,
        "pp_rank": pp_rank,
        "pp_size": pp_size,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "model": model,
        "kv_cache_dtype": "auto",
        "expected_layers": [L3, L7],
        "layers": layers,
        "final": True,
    }
    directory.mkdir(exist_ok=True)
    (directory / f"qsa_kv_absmax_dp0_pp{pp_rank}_tp{tp_rank}.json").write_text(json.dumps(doc))


def entry(k, v, tokens=10):
    return {"k_absmax": k, "v_absmax": v, "tokens": tokens}


def test_merge_takes_max_over_ranks_and_writes_a_valid_sidecar(tmp_path):
    d = tmp_path / "dumps"
    dump(d, 0, {L3: entry(4.0, 1.0), L7: entry(10.0, 2.0)})
    dump(d, 1, {L3: entry(6.0, 0.5), L7: entry(8.0, 3.0)})
    out = tmp_path / "scales.json"
    result = run_merge(d, out)
    assert result.returncode == 0, result.stderr
    assert "merged 2 dump(s)" in result.stdout
    scales = load_sidecar(out, [L3, L7])
    assert scales[L3].k_scale == pytest.approx(6.0 / 448 * 1.1)
    assert scales[L3].v_scale == pytest.approx(1.0 / 448 * 1.1)
    assert scales[L7].k_scale == pytest.approx(10.0 / 448 * 1.1)
    assert scales[L7].v_scale == pytest.approx(3.0 / 448 * 1.1)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: dump(d, 0, {L3: entry(1, 1), L7: entry(1, 1)}), "missing for ['pp0/tp1']"),
        (
            lambda d: (dump(d, 0, {L3: entry(1, 1), L7: entry(1, 1)}), dump(d, 1, {L3: entry(1, 1)})),
            None,  # L7 is covered by rank 0: fine
        ),
        (
            lambda d: (dump(d, 0, {L3: entry(1, 1)}), dump(d, 1, {L3: entry(1, 1)})),
            f"layer '{L7}': no rank dumped it",
        ),
        (
            lambda d: (dump(d, 0, {L3: entry(1, 1), L7: entry(0, 0, 0)}), dump(d, 1, {L3: entry(1, 1)})),
            f"layer '{L7}': no calibration data",
        ),
        (
            lambda d: (dump(d, 0, {L3: entry(None, 1), L7: entry(1, 1)}), dump(d, 1, {L3: entry(1, 1)})),
            "non-finite",
        ),
        (
            lambda d: (
                dump(d, 0, {L3: entry(1, 1), L7: entry(1, 1)}),
                dump(d, 1, {L3: entry(1, 1)}, model="x"),
            ),
            "differs",
        ),
        (lambda d: d.mkdir(), "no calibration dumps"),
    ],
    ids=["missing-rank", "layer-on-one-rank", "layer-nowhere", "no-tokens", "nan", "mixed-models", "empty"],
)
def test_merge_refuses_incomplete_inputs(tmp_path, make, message):
    d = tmp_path / "dumps"
    make(d)
    if message is None:
        merge_directory(d, tmp_path / "s.json")
        return
    with pytest.raises(MergeError) as err:
        merge_directory(d, tmp_path / "s.json")
    assert message in str(err.value)
    assert not (tmp_path / "s.json").exists()


def test_merge_cli_reports_errors(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "model.qsa_kv.merge", "--out", str(tmp_path / "s.json"), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "no calibration dumps" in result.stderr


def test_a_second_engine_in_the_process_replaces_the_first_engines_layers(fresh_runtime):
    """Two ``LLM`` engines built one after the other in one process (in-process engine core, as the
    benchmarks run) register the same layer names; without replacing them the second engine's start
    fails with "registered twice". A duplicate within one engine stays an error."""
    layer = "model.layers.13.self_attn"
    make = lambda engine: QSAKVState(  # noqa: E731
        layer_name=layer,
        kv_format="bf16",
        settings=QSAKVSettings(),
        expected_layers=[layer],
        eager=True,
        engine=engine,
    )
    first, second = make("e1"), make("e2")
    first.apply()
    second.apply()
    assert fresh_runtime.layers[layer] is second
    with pytest.raises(ValueError, match="registered twice"):
        make("e2").apply()
