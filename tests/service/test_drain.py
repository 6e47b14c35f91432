"""One dedicated server with an admission limit of 1 (running) + 0 (queued): start-up answers,
429 past the limit, then SIGTERM during a stream, which must finish before the process exits 0.
The module's last test ends the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, ensure_checkpoint
from tests.net import free_port, wait_ready

from .conftest import Server, error_of, service_env, sse_events, start_server

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory) -> Server:
    srv = start_server(
        tmp_path_factory.mktemp("limited"),
        "limited",
        QWEN4EXP_MAX_CONCURRENT_REQUESTS="1",
        QWEN4EXP_MAX_QUEUED_REQUESTS="0",
        QWEN4EXP_RETRY_AFTER_SECONDS="3",
        QWEN4EXP_DRAIN_SECONDS="60",
        QWEN4EXP_METRICS_OPEN="true",
    )
    yield srv
    srv.stop()


def stream_request(max_tokens: int) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count slowly."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_starting_server_answers_503_and_is_alive(limited_server: Server) -> None:
    """While the engine loads: model routes 503 ``service_starting`` with Retry-After, ``/ready``
    503, ``/health`` 200 (alive, so a liveness probe does not kill a loading model)."""
    seen = limited_server.startup
    starting = [body for status, body in seen.get("/v1/models", []) if status == 503]
    assert starting, seen
    assert all(b["error"]["code"] == "service_starting" and b["retry-after"] == "3" for b in starting)
    assert all(b["error"]["type"] and isinstance(b["error"]["message"], str) for b in starting)
    assert any(status == 503 for status, _ in seen["/ready"]), seen["/ready"]
    assert any(status == 200 and body["status"] == "starting" for status, body in seen["/health"])


def test_admission_limit_gives_429(limited_server: Server) -> None:
    url, auth = limited_server.url, limited_server.auth
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + CHAT, headers=auth, json=stream_request(400)) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # generating now
            for path, body in (
                (CHAT, stream_request(4)),
                ("/v1/completions", {"model": "tiny", "prompt": "x"}),
            ):
                r = httpx.post(url + path, headers=auth, json=body, timeout=10)
                err = error_of(r, 429)
                assert err["code"] == "rate_limit_exceeded"
                assert r.headers["retry-after"] == "3"
            # Only generation is admission-limited; metrics are open on this server.
            assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
            assert httpx.get(url + "/metrics").status_code == 200
            assert limited_server.gauge("qwen4exp_admission_running") == 1
        # Leaving the block disconnected the client: the engine request is aborted, the slot freed.
        assert limited_server.wait_engine_idle() == (0, 0)
    deadline = time.monotonic() + 10
    while limited_server.gauge("qwen4exp_admission_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    r = httpx.post(
        url + "/v1/completions",
        headers=auth,
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    statuses = {s.labels["status"] for s in limited_server.metrics()["qwen4exp_http_requests_total"]}
    assert "429" in statuses


def _prometheus_dir_of_children(server: Server) -> Path:
    """The multiprocess dir the engine processes inherited (the parent's /proc environ is stale)."""
    for pid in server.children():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in env:
            if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                return Path(entry.split(b"=", 1)[1].decode())
    raise AssertionError("no child process has PROMETHEUS_MULTIPROC_DIR")


def test_sigterm_lets_the_stream_finish_then_exits_0(limited_server: Server) -> None:
    url, auth = limited_server.url, limited_server.auth
    prom_dir = _prometheus_dir_of_children(limited_server)
    assert prom_dir.is_dir() and prom_dir.name.startswith("qwen4exp-prom-")
    during: dict[str, httpx.Response] = {}

    def probe_while_draining() -> None:
        time.sleep(0.5)
        during["chat"] = httpx.post(url + CHAT, headers=auth, json=stream_request(2), timeout=10)
        during["ready"] = httpx.get(url + "/ready", timeout=10)
        during["health"] = httpx.get(url + "/health", timeout=10)

    max_tokens = 120  # ~3 s here: long enough to still be running after SIGTERM
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + CHAT, headers=auth, json=stream_request(max_tokens)) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = [next(line for line in lines if line.startswith("data:"))]
            os.kill(limited_server.proc.pid, signal.SIGTERM)
            prober = threading.Thread(target=probe_while_draining)
            prober.start()
            events = sse_events(first + list(lines))
            prober.join()

    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == max_tokens
    finish = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
    assert finish == ["length"]

    err = error_of(during["chat"], 503)
    assert err["code"] == "service_draining" and during["chat"].headers["retry-after"] == "3"
    error_of(during["ready"], 503)
    assert during["health"].status_code == 200 and during["health"].json()["status"] == "draining"

    assert limited_server.proc.wait(60) == 0, limited_server.log()[-3000:]
    assert "drained" in limited_server.log()
    assert not prom_dir.exists(), "the Prometheus multiprocess dir must be removed at exit"


def test_sigterm_while_loading_exits_0_promptly(tmp_path: Path) -> None:
    """No server fixture: SIGTERM during the model load ends the engine processes and exits 0."""
    port = free_port()
    env = service_env(
        QWEN4EXP_MODEL=str(ensure_checkpoint("tiny")), QWEN4EXP_HOST="127.0.0.1", QWEN4EXP_PORT=str(port)
    )
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path / "prom")
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        r = wait_ready(
            f"http://127.0.0.1:{port}/v1/models",
            proc,
            time.monotonic() + 120,
            until=lambda answer: answer.status_code == 503,
            timeout=2,
            interval=0.3,
            exited=lambda rc: (tmp_path / "log").read_text(),
            not_ready=lambda: "never saw the start-up 503",
        )
        assert r.json()["error"]["code"] == "service_starting"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list((tmp_path / "prom").iterdir()) == []
