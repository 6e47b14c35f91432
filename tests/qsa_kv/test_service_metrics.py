"""Clip counters and scale gauges of the FP8 QSA cache reach the real service's ``/metrics``.

``python -m service`` on the tiny checkpoint with ``QWEN4EXP_KV_CACHE_DTYPE=fp8`` and a sidecar whose
scales are deliberately ~100x too small, so K and V values beyond ``448 * scale`` are common. The
worker-side reader exports ``qwen4exp_qsa_kv_clipped_total`` through the service's Prometheus
multiprocess directory; every request must make it rise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, ensure_checkpoint
from tests.net import free_port, wait_ready

LAYER = "model.layers.3.self_attn"
K_SCALE, V_SCALE = 1e-4, 5e-5
STARTUP_TIMEOUT_S = 300.0


def qsa_metrics(url: str) -> dict[tuple[str, str], float]:
    """(metric name, tensor label) -> value, for our layer's QSA KV series."""
    r = httpx.get(url + "/metrics", timeout=10)
    r.raise_for_status()
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name.startswith("qwen4exp_qsa_kv_") and s.labels.get("layer") == LAYER:
                out[(s.name, s.labels["tensor"])] = s.value
    return out


def children(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        found += kids
        frontier += kids
    return found


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the service we started, then SIGKILL it and its own descendants if it hangs."""
    if proc.poll() is not None:
        return
    descendants = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        for pid in descendants:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()


def test_small_scales_make_clip_counters_rise_on_metrics(tmp_path):
    sidecar = tmp_path / "small-scales.json"
    sidecar.write_text(json.dumps({LAYER: {"k_scale": K_SCALE, "v_scale": V_SCALE}}))
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(("QWEN4EXP_", "VLLM_QSA_", "VLLM_PLE_"))
        and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env.update(
        QWEN4EXP_MODEL=str(ensure_checkpoint("tiny")),
        QWEN4EXP_HOST="127.0.0.1",
        QWEN4EXP_PORT=str(port),
        QWEN4EXP_KV_CACHE_DTYPE="fp8",
        QWEN4EXP_METRICS_OPEN="true",
        QWEN4EXP_AUTH="off",  # loopback only
        QWEN4EXP_MAX_MODEL_LEN="512",
        VLLM_QSA_KV_SCALES=str(sidecar),
        VLLM_QSA_KV_CLIP_COUNT="0.3",
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log_path = tmp_path / "service.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_ready(
            url + "/ready",
            proc,
            time.monotonic() + STARTUP_TIMEOUT_S,
            exited=lambda rc: log_path.read_text(errors="replace")[-5000:],
            not_ready=lambda: "service not ready:\n" + log_path.read_text(errors="replace")[-5000:],
        )

        def wait_for(pred, what: str, timeout: float = 20.0) -> dict:
            end = time.monotonic() + timeout
            while True:
                m = qsa_metrics(url)
                if pred(m):
                    return m
                assert time.monotonic() < end, f"{what}: {m}"
                time.sleep(0.3)

        clipped = "qwen4exp_qsa_kv_clipped_total"
        # The readiness probe already ran one generation through the QSA layer.
        before = wait_for(
            lambda m: m.get((clipped, "k"), 0) > 0 and m.get((clipped, "v"), 0) > 0, "no clips yet"
        )
        assert before[("qwen4exp_qsa_kv_scale", "k")] == K_SCALE
        assert before[("qwen4exp_qsa_kv_scale", "v")] == V_SCALE
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        after = wait_for(
            lambda m: (
                m[(clipped, "k")] > before[(clipped, "k")] and m[(clipped, "v")] > before[(clipped, "v")]
            ),
            "counters did not rise after a request",
        )
        print(
            f"\nclipped K/V before the request {before[(clipped, 'k')]:.0f}/{before[(clipped, 'v')]:.0f}, "
            f"after {after[(clipped, 'k')]:.0f}/{after[(clipped, 'v')]:.0f}"
        )
        log = log_path.read_text(errors="replace")
        assert "QSA KV cache clipping on rank 0" in log
        assert f"k_scale={K_SCALE:g} v_scale={V_SCALE:g} (sidecar {sidecar})" in log
    finally:
        stop(proc)
