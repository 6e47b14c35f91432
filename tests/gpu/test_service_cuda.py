"""The product on CUDA as a user runs it: ``python -m service`` answering the official openai client.

Three service starts on the tiny checkpoint (``QWEN4EXP_DEVICE=cuda``):

1. defaults (CUDA graphs, ``VLLM_PLE_CPU_OFFLOAD=1``: PLE rows in pinned host memory, gathered
   through unified addressing): a streamed chat completion with ``include_usage``, greedy
   completions of the parity prompts, and ``qwen4exp_ple_pinned_bytes`` > 0 on ``/metrics``;
2. ``VLLM_PLE_CPU_OFFLOAD=0`` (tables in GPU memory), eager, collecting FP8 calibration absmax
   (``VLLM_QSA_KV_COLLECT``): the same greedy tokens as (1), no pinned bytes;
3. the FP8 QSA KV cache with the sidecar merged from (2)'s dumps and the clip counter on: the scale
   gauges equal the sidecar and ``qwen4exp_qsa_kv_clipped_total`` is exported for K and V.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, ensure_checkpoint
from tests.net import free_port, wait_ready
from tests.qsa_kv.helpers import run_merge

pytestmark = pytest.mark.vllm_cuda

STARTUP_TIMEOUT_S = float(os.environ.get("GPU_TEST_STARTUP_TIMEOUT_S", "300"))  # a cold host compiles
# The tiny checkpoint is ours-only (a QSA top-k of 4 blocks); the default on CUDA would be upstream.
OURS = {"QWEN4EXP_CUDA_MODEL": "ours"}
DEVICE = os.environ.get("QWEN4EXP_GPU_DRY_RUN_DEVICE", "cuda")  # "cpu": check this file on vLLM's CPU build
PROMPTS = {
    "short": "The quick brown fox",
    "story": "Once upon a time",
    "long": " ".join(["The quick brown fox jumps over the lazy dog."] * 30),
}


class Service:
    """``python -m service`` as shipped on ``checkpoint`` (a preset name or a checkpoint
    directory), ready to answer.

    The test process's own ``QWEN4EXP_*``/``VLLM_QSA_*``/``VLLM_PLE_*`` settings are dropped, and so
    are ``drop``'s names (``VLLM_USE_V2_MODEL_RUNNER`` to let the service choose the runner);
    ``env`` sets the service's. ``force_sm86`` (the default) sets ``QWEN4EXP_FORCE_SM86=1``: every
    choice an RTX 3090 takes, the Triton GDN prefill among them, made by the service's own
    deployment. ``GPU_TEST_KV_CACHE_BYTES`` becomes ``QWEN4EXP_KV_CACHE_MEMORY_BYTES`` (unless ``env``
    sets it): vLLM then skips its memory profiling, whose free-memory snapshots go wrong when other
    test engines start or stop on the same GPU ("Error in memory profiling")."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        checkpoint: str | Path = "tiny",
        drop: tuple[str, ...] = (),
        force_sm86: bool = True,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        **env: str,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        self.started = time.monotonic()
        path = checkpoint if isinstance(checkpoint, Path) else ensure_checkpoint(checkpoint)
        self.model = path.name
        full = {
            k: v
            for k, v in os.environ.items()
            if not k.upper().startswith(("QWEN4EXP_", "VLLM_QSA_", "VLLM_PLE_"))
            and k != "PROMETHEUS_MULTIPROC_DIR"
            and k not in drop
        }
        full.update(
            QWEN4EXP_MODEL=str(path),
            QWEN4EXP_SERVED_MODEL_NAME=path.name,
            QWEN4EXP_DEVICE=DEVICE,
            QWEN4EXP_HOST="127.0.0.1",
            QWEN4EXP_PORT=str(self.port),
            QWEN4EXP_METRICS_OPEN="true",
            QWEN4EXP_MAX_MODEL_LEN="2048",
            QWEN4EXP_GPU_MEMORY_UTILIZATION="0.3",
            QWEN4EXP_AUTH="off",  # loopback only
        )
        if force_sm86:
            full["QWEN4EXP_FORCE_SM86"] = "1"
        if kv_bytes := os.environ.get("GPU_TEST_KV_CACHE_BYTES"):
            full["QWEN4EXP_KV_CACHE_MEMORY_BYTES"] = kv_bytes
        full.update(env)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service"],
                cwd=ROOT,
                env=full,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_ready(
            self.url + "/ready",
            self.proc,
            time.monotonic() + startup_timeout_s,
            on_timeout=self.stop,
            exited=lambda rc: f"service exited {rc}:\n{self.log()[-6000:]}",
            not_ready=lambda: f"service not ready in {startup_timeout_s} s:\n{self.log()[-6000:]}",
        )
        self.ready_after_s = time.monotonic() - self.started

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def samples(self, prefix: str) -> list:
        r = httpx.get(self.url + "/metrics", timeout=10)
        r.raise_for_status()
        return [
            s for f in text_string_to_metric_families(r.text) for s in f.samples if s.name.startswith(prefix)
        ]

    def greedy(self, prompt: str, max_tokens: int = 24) -> str:
        r = httpx.post(
            self.url + "/v1/completions",
            json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def greedy_ids(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy token ids for a token-id prompt, ``max_tokens`` of them (vLLM's ``ignore_eos`` and
        ``return_token_ids`` extensions of the completions API), as the parity references count."""
        r = httpx.post(
            self.url + "/v1/completions",
            json={
                "model": self.model,
                "prompt": prompt_ids,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=300,
        )
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def stream_chat(svc: Service) -> list:
    """A streamed chat completion with ``include_usage`` through the official openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=svc.url + "/v1", api_key="unused-without-keys")
    return list(
        client.chat.completions.create(
            model=svc.model,
            messages=[{"role": "user", "content": "Once upon a time"}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )


def serve_three_ways(
    tmp: Path, checkpoint: str, answer: Callable[[Service], dict], drop: tuple[str, ...] = (), **env: str
) -> dict:
    """The three starts of both service tests, one after another, each asked ``answer(svc)``:

    ``default`` (the defaults: CUDA graphs, PLE tables pinned; also a streamed chat and
    ``qwen4exp_service_info``), ``device`` (``VLLM_PLE_CPU_OFFLOAD=0``, eager, collecting FP8
    calibration absmax) and ``fp8`` (the FP8 QSA cache with the sidecar merged from ``device``'s
    dumps, clip counter on). ``drop`` and ``env``: every start's (see :class:`Service`). Returns each
    start's answers under its name, its ``qwen4exp_ple_*`` (``<name>_ple``) or ``qwen4exp_qsa_kv_*``
    (``fp8_metrics``) samples and exit code (``<name>_rc``), the stream, the service info and the sidecar.
    """
    out: dict = {}
    svc = Service(tmp, "default", checkpoint, drop, **env)
    try:
        out["stream"] = stream_chat(svc)
        out["service_info"] = svc.samples("qwen4exp_service_info")
        out["default"] = answer(svc)
        out["default_ple"] = svc.samples("qwen4exp_ple_")
    finally:
        out["default_rc"] = svc.stop()

    dumps = tmp / "kvdumps"
    device_env = dict(
        VLLM_PLE_CPU_OFFLOAD="0",
        QWEN4EXP_ENFORCE_EAGER="true",
        VLLM_QSA_KV_COLLECT=str(dumps),
        VLLM_QSA_KV_COLLECT_INTERVAL="1",
    )
    svc = Service(tmp, "device", checkpoint, drop, **env, **device_env)
    try:
        out["device"] = answer(svc)
        out["device_ple"] = svc.samples("qwen4exp_ple_")
    finally:
        out["device_rc"] = svc.stop()

    sidecar = tmp / "qsa-kv-scales.json"
    merge = run_merge(dumps, sidecar)
    assert merge.returncode == 0, merge.stdout + merge.stderr
    out["sidecar"] = json.loads(sidecar.read_text())

    fp8_env = dict(
        QWEN4EXP_KV_CACHE_DTYPE="fp8", VLLM_QSA_KV_SCALES=str(sidecar), VLLM_QSA_KV_CLIP_COUNT="0.5"
    )
    svc = Service(tmp, "fp8", checkpoint, drop, **env, **fp8_env)
    try:
        out["fp8"] = answer(svc)
        time.sleep(1.5)  # one clip-counter read after the requests
        out["fp8_metrics"] = svc.samples("qwen4exp_qsa_kv_")
    finally:
        out["fp8_rc"] = svc.stop()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three services on tiny (ours), one after another; what each answered."""
    tmp = tmp_path_factory.mktemp("service_cuda")
    out = serve_three_ways(tmp, "tiny", lambda svc: {n: svc.greedy(p) for n, p in PROMPTS.items()}, **OURS)
    out["tmp"] = tmp
    return out


def test_openai_client_streams_with_usage(runs):
    chunks = runs["stream"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text, "no streamed content"
    assert len(usage) == 1 and usage[0].completion_tokens == 16 and usage[0].prompt_tokens > 0
    info = runs["service_info"]
    assert info and info[0].labels["device"] == DEVICE, info


def test_pinned_ple_tables_on_metrics(runs):
    pinned = [s for s in runs["default_ple"] if s.name == "qwen4exp_ple_pinned_bytes"]
    assert pinned and all(s.value > 0 for s in pinned), pinned
    modes = {s.labels["mode"] for s in runs["default_ple"] if s.name == "qwen4exp_ple_storage_info"}
    assert modes == {"pinned"}, modes
    assert runs["default_rc"] == 0


def test_device_ple_tables_generate_the_same_tokens(runs):
    assert runs["device"] == runs["default"]
    pinned = [s for s in runs["device_ple"] if s.name == "qwen4exp_ple_pinned_bytes"]
    assert pinned and all(s.value == 0 for s in pinned), pinned
    modes = {s.labels["mode"] for s in runs["device_ple"] if s.name == "qwen4exp_ple_storage_info"}
    assert modes == {"device"}, modes
    assert runs["device_rc"] == 0


def test_fp8_kv_cache_with_calibrated_sidecar_and_clip_counters(runs):
    sidecar = runs["sidecar"]
    m = runs["fp8_metrics"]
    for layer, scales in sidecar.items():
        for tensor in ("k", "v"):
            gauge = [
                s.value
                for s in m
                if s.name == "qwen4exp_qsa_kv_scale"
                and s.labels["layer"] == layer
                and s.labels["tensor"] == tensor
            ]
            assert gauge and abs(gauge[0] - scales[f"{tensor}_scale"]) <= 1e-6 * scales[f"{tensor}_scale"], (
                layer,
                tensor,
                gauge,
            )
            clipped = [
                s
                for s in m
                if s.name == "qwen4exp_qsa_kv_clipped_total"
                and s.labels["layer"] == layer
                and s.labels["tensor"] == tensor
            ]
            assert clipped, f"no clip counter for {layer} {tensor}: {m}"
    same = sum(runs["fp8"][n] == runs["default"][n] for n in PROMPTS)
    print(f"FP8 KV: {same}/{len(PROMPTS)} greedy completions equal to the BF16 cache's")
    assert all(runs["fp8"].values())
    assert runs["fp8_rc"] == 0
