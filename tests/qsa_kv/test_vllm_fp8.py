"""The FP8 QSA KV cache through vLLM's engine on the CPU: calibrate, merge, serve, count clips.

Three engines, one at a time, on the tiny checkpoint's outlier variant (``helpers.py``: same
function, cached V values up to ~1,300, beyond E4M3's +-448):

1. BF16 cache with ``VLLM_QSA_KV_COLLECT``: reference log-probabilities and calibration dumps,
   merged with the real CLI (margin 1.1).
2. FP8 cache with the merged sidecar and ``VLLM_QSA_KV_CLIP_COUNT``.
3. FP8 cache without a sidecar (scales 1.0) and clip counting.

Runs 2 and 3 write their Prometheus samples to a fresh multiprocess directory each, which the tests
read directly (the service test reads them through ``/metrics``). One more engine start must fail
in the worker with the sidecar's validation message.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.qsa_kv.sidecar import load_sidecar
from tests.conftest import ROOT, ensure_checkpoint

from .helpers import (
    QSA_ENV,
    make_outlier_checkpoint,
    mean_abs_error,
    multiproc_samples,
    output_to,
    patched_env,
    prompt_logprobs_run,
)

LAYER = "model.layers.3.self_attn"
CLIP_INTERVAL = "0.2"
MARGIN = 1.1


@pytest.fixture(scope="module")
def outlier(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.parity.prompts import parity_prompts

    path = make_outlier_checkpoint(
        ensure_checkpoint("tiny"), tmp_path_factory.mktemp("ckpt") / "tiny-outlier"
    )
    prompts = list(parity_prompts(AutoTokenizer.from_pretrained(path)).values())
    return path, prompts


@pytest.fixture(scope="module")
def calibration(outlier, tmp_path_factory):
    path, prompts = outlier
    tmp = tmp_path_factory.mktemp("calibration")
    dumps = tmp / "dumps"
    bf16 = prompt_logprobs_run(
        path,
        prompts,
        "auto",
        {"VLLM_QSA_KV_COLLECT": str(dumps), "VLLM_QSA_KV_COLLECT_INTERVAL": "1"},
        tmp / "bf16.log",
        linger_s=1.5,  # one periodic dump after the last step, should the exit dump be cut short
    )
    dump_file = dumps / "qsa_kv_absmax_dp0_pp0_tp0.json"
    deadline = time.monotonic() + 20  # the final dump is written while the worker exits
    while time.monotonic() < deadline and not (
        dump_file.exists() and json.loads(dump_file.read_text())["final"]
    ):
        time.sleep(0.2)
    sidecar = tmp / "scales.json"
    merge = subprocess.run(
        [
            sys.executable,
            "-m",
            "model.qsa_kv.merge",
            "--out",
            str(sidecar),
            str(dumps),
            "--margin",
            str(MARGIN),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return {
        "bf16": bf16,
        "dumps": dumps,
        "dump_file": dump_file,
        "sidecar": sidecar,
        "merge": merge,
        "tmp": tmp,
    }


def fp8_run(outlier, tmp: Path, name: str, env: dict[str, str]) -> dict:
    path, prompts = outlier
    prom = tmp / f"prom-{name}"
    prom.mkdir()
    log = tmp / f"{name}.log"
    env = {"VLLM_QSA_KV_CLIP_COUNT": CLIP_INTERVAL, "PROMETHEUS_MULTIPROC_DIR": str(prom), **env}
    logprobs = prompt_logprobs_run(path, prompts, "fp8", env, log, linger_s=1.5)
    return {"logprobs": logprobs, "metrics": multiproc_samples(prom), "log": log.read_text(errors="replace")}


@pytest.fixture(scope="module")
def calibrated(outlier, calibration):
    assert calibration["merge"].returncode == 0, calibration["merge"].stderr
    return fp8_run(
        outlier, calibration["tmp"], "calibrated", {"VLLM_QSA_KV_SCALES": str(calibration["sidecar"])}
    )


@pytest.fixture(scope="module")
def unit_scales(outlier, calibration):
    return fp8_run(outlier, calibration["tmp"], "unit", {})


def metric(run: dict, name: str, tensor: str) -> float | None:
    return run["metrics"].get((name, (("layer", LAYER), ("rank", "0"), ("tensor", tensor))))


def test_calibration_dump_and_merged_sidecar(outlier, calibration):
    _, prompts = outlier
    doc = json.loads(calibration["dump_file"].read_text())
    assert doc["final"] is True, "the at-exit dump did not run"
    assert doc["expected_layers"] == [LAYER] and doc["tp_size"] == 1
    entry = doc["layers"][LAYER]
    # Every prompt token's K/V row was written once (max_tokens=1: the sampled token is never cached).
    assert entry["tokens"] == sum(len(p) for p in prompts)
    assert entry["v_absmax"] > 448 > entry["k_absmax"] > 0  # the outlier variant's V leaves E4M3's range
    assert calibration["merge"].returncode == 0, calibration["merge"].stderr
    scales = load_sidecar(calibration["sidecar"], [LAYER])
    assert scales[LAYER].k_scale == pytest.approx(entry["k_absmax"] / 448 * MARGIN)
    assert scales[LAYER].v_scale == pytest.approx(entry["v_absmax"] / 448 * MARGIN)


def test_calibrated_fp8_is_closer_to_bf16_than_unit_scales(calibration, calibrated, unit_scales):
    err_cal = mean_abs_error(calibrated["logprobs"], calibration["bf16"])
    err_one = mean_abs_error(unit_scales["logprobs"], calibration["bf16"])
    n = sum(len(x) for x in calibration["bf16"])
    print(
        f"\nmean |logprob(FP8) - logprob(BF16)| over {n} prompt tokens: calibrated {err_cal:.5f}, "
        f"scales 1.0 {err_one:.5f}"
    )
    assert err_cal < 0.01, "calibrated FP8 drifted from BF16"
    assert err_cal < err_one / 2, (err_cal, err_one)


def test_effective_scales_logged_and_exported(calibration, calibrated, unit_scales):
    scales = load_sidecar(calibration["sidecar"], [LAYER])[LAYER]
    assert metric(calibrated, "qwen4exp_qsa_kv_scale", "k") == pytest.approx(scales.k_scale)
    assert metric(calibrated, "qwen4exp_qsa_kv_scale", "v") == pytest.approx(scales.v_scale)
    assert f"QSA KV cache {LAYER} (rank 0): fp8_e4m3, k_scale={scales.k_scale:g}" in calibrated["log"]
    assert f"sidecar {calibration['sidecar']}" in calibrated["log"]
    assert metric(unit_scales, "qwen4exp_qsa_kv_scale", "k") == 1.0
    assert "UNCALIBRATED FP8 KV CACHE" in unit_scales["log"]
    assert "UNCALIBRATED" not in calibrated["log"]


def test_clip_counters(calibrated, unit_scales):
    # Calibrated with headroom on these very prompts: nothing clips, but the series exist.
    assert metric(calibrated, "qwen4exp_qsa_kv_clipped_total", "k") == 0.0
    assert metric(calibrated, "qwen4exp_qsa_kv_clipped_total", "v") == 0.0
    assert "QSA KV clip counter alive" in calibrated["log"]
    assert "QSA KV cache clipping" not in calibrated["log"]
    # Scale 1.0: V (up to ~1,300) clips, K (< 6) does not.
    assert metric(unit_scales, "qwen4exp_qsa_kv_clipped_total", "k") == 0.0
    assert metric(unit_scales, "qwen4exp_qsa_kv_clipped_total", "v") > 0
    assert "QSA KV cache clipping on rank 0" in unit_scales["log"]


def test_bad_sidecar_stops_engine_start(tmp_path):
    """The worker refuses the sidecar while building the model; the message reaches the operator's log.

    One engine start only (each costs ~30 s): the validator's individual cases are unit-tested in
    ``test_sidecar_settings.py``; this checks that they stop vLLM's start-up and are logged.
    """
    from vllm import LLM

    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                LAYER: {"k_scale": -0.5, "v_scale": True, "bias": 1},
                "model.layers.2.self_attn": {"k_scale": 1, "v_scale": 1},
            }
        )
    )
    log = tmp_path / "engine.log"
    env: dict[str, str | None] = dict.fromkeys(QSA_ENV)
    env["VLLM_QSA_KV_SCALES"] = str(bad)
    with patched_env(**env), output_to(log), pytest.raises(Exception) as err:
        LLM(
            model=str(ensure_checkpoint("tiny")),
            dtype="bfloat16",
            kv_cache_dtype="fp8",
            enforce_eager=True,
            enable_prefix_caching=False,
            max_model_len=512,
        )
    out = log.read_text(errors="replace")
    assert "initialization failed" in str(err.value), err.value
    assert f"QSAKVConfigError: invalid QSA KV scale sidecar VLLM_QSA_KV_SCALES={bad}" in out, out[-3000:]
    for part in (
        f"layer '{LAYER}' field 'k_scale': must be > 0, got -0.5",
        f"layer '{LAYER}' field 'v_scale': must be a number, got boolean true",
        f"layer '{LAYER}' field 'bias': unexpected key",
        "layer 'model.layers.2.self_attn': not a QSA layer of this model",
    ):
        assert part in out, out[-3000:]
