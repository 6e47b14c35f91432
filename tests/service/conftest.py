"""Fixtures that run the real service (``python -m service``) as a subprocess on loopback.

Starting an engine takes ~35 s on the 2-core CI machine, so the suite uses two servers, one at a
time: the module-scoped ``limited_server`` (admission limit 1, short drain) for the 429 and SIGTERM
tests and ``fault_server`` (fault injection, strict readiness) for the resilience tests, each
ended with its module, then the session-wide ``server`` for everything else.
``pytest_collection_modifyitems`` orders the tests so they never overlap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, ensure_checkpoint, write_api_keys
from tests.net import free_port, wait_ready

KEY = "test-key-env"
FILE_KEY = "test-key-file"
STARTUP_TIMEOUT_S = 240.0


def service_env(**overrides: str) -> dict[str, str]:
    """The test process's environment without stray service settings, plus ``overrides``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(("QWEN4EXP_", "VLLM_QSA_", "VLLM_PLE_"))
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
    env.update(overrides)
    if not any(env.get(k, "").strip() for k in ("QWEN4EXP_API_KEYS", "QWEN4EXP_API_KEYS_FILE")):
        env.setdefault("QWEN4EXP_AUTH", "off")  # loopback tests without keys say so, as a user must
    return env


@dataclass
class Server:
    """A running ``python -m service`` and what the fixture saw while it started."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    startup: dict[str, list[tuple[int, dict]]] = field(default_factory=dict)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, list]:
        """name -> samples of the current /metrics."""
        r = httpx.get(self.url + "/metrics", headers=self.auth, timeout=10)
        r.raise_for_status()
        out: dict[str, list] = {}
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append(sample)
        return out

    def gauge(self, name: str) -> float:
        """Sum of a gauge over its label sets (one engine here)."""
        return sum(s.value for s in self.metrics().get(name, []))

    def wait_engine_idle(self, timeout: float = 15.0) -> tuple[float, float]:
        """Wait until vLLM reports no running and no waiting request; return the last values."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            running = sum(s.value for s in m.get("vllm:num_requests_running", []))
            waiting = sum(s.value for s in m.get("vllm:num_requests_waiting", []))
            if (running, waiting) == (0, 0) or time.monotonic() > deadline:
                return running, waiting
            time.sleep(0.2)

    def children(self) -> list[int]:
        """PIDs of all descendants (EngineCore, workers)."""
        found, frontier = [], [self.proc.pid]
        while frontier:
            pid = frontier.pop()
            kids = []
            for task in Path(f"/proc/{pid}/task").glob("*"):  # a child belongs to the thread that made it
                try:
                    kids += (task / "children").read_text().split()
                except OSError:
                    continue
            found += [int(k) for k in kids]
            frontier += [int(k) for k in kids]
        return found

    def stop(self, timeout: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in self.children():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _record(seen: dict, path: str, r: httpx.Response) -> None:
    try:
        body = r.json()
    except ValueError:
        body = {"raw": r.text}
    seen.setdefault(path, []).append((r.status_code, body | {"retry-after": r.headers.get("retry-after")}))


def _observe(client: httpx.Client, url: str, path: str, seen: dict) -> None:
    try:
        r = client.get(url + path)
    except httpx.HTTPError:
        return
    _record(seen, path, r)


def start_server(tmp: Path, name: str, **env: str) -> Server:
    """Start the service (``tiny`` unless ``QWEN4EXP_MODEL`` is given) and wait until ``/ready`` is
    200, recording the start-up answers."""
    port = free_port()
    keys_file = write_api_keys(tmp, f"# mounted secret\n{FILE_KEY}\n", name=f"{name}-keys")
    log_path = tmp / f"{name}.log"
    full_env = service_env(
        **{
            "QWEN4EXP_MODEL": env.get("QWEN4EXP_MODEL") or str(ensure_checkpoint("tiny")),
            "QWEN4EXP_HOST": "127.0.0.1",
            "QWEN4EXP_PORT": str(port),
            "QWEN4EXP_API_KEYS": KEY,
            "QWEN4EXP_API_KEYS_FILE": str(keys_file),
            **env,
        }
    )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service"], cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    with httpx.Client(timeout=5, headers=server.auth) as client:

        def record(ready: httpx.Response) -> None:
            _record(server.startup, "/ready", ready)
            if ready.status_code != 200:  # while loading: what do other routes answer?
                _observe(client, server.url, "/health", server.startup)
                _observe(client, server.url, "/v1/models", server.startup)

        wait_ready(
            server.url + "/ready",
            proc,
            time.monotonic() + STARTUP_TIMEOUT_S,
            client=client,
            on_answer=record,
            error=RuntimeError,
            on_timeout=server.stop,
            exited=lambda rc: f"service exited with {rc} while starting:\n{server.log()[-5000:]}",
            not_ready=lambda: f"service not ready after {STARTUP_TIMEOUT_S} s:\n{server.log()[-5000:]}",
        )
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """The shared server: default limits, small body cap, metrics behind auth."""
    srv = start_server(
        tmp_path_factory.mktemp("service"),
        "main",
        QWEN4EXP_MAX_BODY_BYTES=str(64 * 1024),
        QWEN4EXP_MAX_MODEL_LEN="2048",
    )
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


def error_of(response: httpx.Response, status: int) -> dict:
    """Assert an OpenAI-shaped error with this status; return its ``error`` object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert isinstance(err["code"], str) and err["code"] and not err["code"].isdigit(), err
    assert err["param"] is None or isinstance(err["param"], str)
    return err


def sse_events(lines) -> list:
    """Parsed ``data:`` payloads of an SSE stream (``[DONE]`` kept as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _server_rank(item) -> int:
    names = getattr(item, "fixturenames", ())
    if {"limited_server", "fault_server", "agent_server", "caps_server", "observed_server"} & set(names):
        return 1
    if "server" in names:
        return 2
    return 0


def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests without a server first, then the limited server's, then the shared server's, so that
    at most one engine runs at a time (the limited server is module-scoped and ends first)."""
    slots = [i for i, item in enumerate(items) if "tests/service/" in item.nodeid.replace("\\", "/")]
    ordered = sorted((items[i] for i in slots), key=_server_rank)  # stable: keeps file order within a rank
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item
