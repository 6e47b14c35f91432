"""Two replicas of the real service and vllm-router in front of them, all on loopback.

The replicas are ``python -m service`` with the ``tiny`` checkpoint, started side by side (each
engine takes ~35 s on 2 cores; in parallel the pair takes about as long as one). A replica keeps
its port for its whole life, so the router's static ``--worker-urls`` still name it after it was
killed and started again. The router holds no API key: it forwards the client's
``Authorization`` header and the replicas check it (docs/scale-out.md, "Auth").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests import net
from tests.conftest import ROOT, ensure_checkpoint
from tests.service.conftest import KEY, Server, service_env

ROUTER_BIN = Path(sys.executable).parent / "vllm-router"
ROUTER_VERSION = "0.1.17"  # pinned in pyproject's test extra and in the chart's router.version
# Two engines start side by side on the CI machine's 2 cores, each taking about twice as long as
# one alone (tests/service allows one engine 240 s).
STARTUP_TIMEOUT_S = 420.0
CHAT = "/v1/chat/completions"


def samples(text: str) -> dict[str, list]:
    """name -> samples of a Prometheus text exposition."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


@dataclass
class Replica:
    """One ``python -m service`` on a fixed loopback port; can be killed and started again."""

    name: str
    port: int
    workdir: Path
    server: Server | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        """Start the process (returns at once; ``wait_ready`` waits for the engine)."""
        self.starts += 1
        tmp = self.workdir / f"{self.name}{self.starts}"
        tmp.mkdir(parents=True, exist_ok=True)
        env = service_env(
            QWEN4EXP_MODEL=str(ensure_checkpoint("tiny")),
            QWEN4EXP_HOST="127.0.0.1",
            QWEN4EXP_PORT=str(self.port),
            QWEN4EXP_API_KEYS=KEY,
            QWEN4EXP_MAX_MODEL_LEN="2048",
            # A SIGKILLed replica cannot remove its metrics directory and fatal-reason file: keep
            # them under the test's own directory.
            TMPDIR=str(tmp),
        )
        log_path = tmp / "service.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.server = Server(proc, self.url, log_path)

    def wait_ready(self, deadline: float) -> None:
        assert self.server is not None
        server = self.server
        with httpx.Client(timeout=5) as client:
            net.wait_ready(
                self.url + "/ready",
                server.proc,
                deadline,
                client=client,
                error=RuntimeError,
                exited=lambda rc: f"{self.name} exited while starting:\n{server.log()[-4000:]}",
                not_ready=lambda: f"{self.name} not ready in time:\n{server.log()[-4000:]}",
            )

    def metrics(self) -> dict[str, list]:
        assert self.server is not None
        return self.server.metrics()

    def counters(self) -> dict[str, float]:
        """Chat requests answered 200, and vLLM's prefix-cache token counters, of this replica."""
        m = self.metrics()
        chat = sum(
            s.value
            for s in m.get("qwen4exp_http_requests_total", [])
            if s.labels["route"] == CHAT and s.labels["status"] == "200"
        )
        return {
            "chat": chat,
            "queries": sum(s.value for s in m.get("vllm:prefix_cache_queries_total", [])),
            "hits": sum(s.value for s in m.get("vllm:prefix_cache_hits_total", [])),
        }

    def block_size(self) -> int:
        """The prefix cache's block size in tokens, from vLLM's ``cache_config_info``."""
        (info,) = self.metrics()["vllm:cache_config_info"]
        return int(info.labels["block_size"])

    def chats_in_progress(self) -> float:
        m = self.metrics()
        return sum(
            s.value for s in m.get("qwen4exp_http_requests_in_progress", []) if s.labels["route"] == CHAT
        )

    def kill(self) -> None:
        """SIGKILL the service and every process under it (EngineCore, workers): a crashed node."""
        assert self.server is not None
        for pid in [*self.server.children(), self.server.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.server.proc.wait(30)

    def stop(self) -> None:
        if self.server is not None and self.server.proc.poll() is None:
            self.server.stop()


def start_replicas(workdir: Path, count: int = 2) -> list[Replica]:
    replicas = [Replica(f"replica{i}", net.free_port(), workdir) for i in range(count)]
    for replica in replicas:
        replica.launch()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        for replica in replicas:
            replica.wait_ready(deadline)
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


@dataclass
class Router:
    """A running vllm-router (the PyPI wheel's launcher) and its Prometheus endpoint."""

    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path
    policy: str
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, list]:
        r = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10)
        r.raise_for_status()
        return samples(r.text)

    def workers(self) -> dict[str, dict]:
        """url -> the router's view of that worker (``is_healthy``, ``load``, ...)."""
        r = httpx.get(self.url + "/workers", timeout=10)
        r.raise_for_status()
        return {w["url"]: w for w in r.json()["workers"]}

    def wait_health(self, url: str, healthy: bool, timeout: float) -> float:
        """Seconds until the router reports ``url`` with this health; fails after ``timeout``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.workers()[url]["is_healthy"] is healthy:
                return time.monotonic() - start
            time.sleep(0.2)
        raise AssertionError(
            f"router did not mark {url} healthy={healthy} in {timeout} s:\n{self.log()[-3000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# Failover settings: the same ones the chart and compose use, with shorter health-check periods
# so the test sees the transitions in seconds. Health is our /ready (503 while loading and
# draining); a connection failure opens the worker's circuit at once, so a retry goes elsewhere.
FAILOVER_ARGS = [
    "--health-check-endpoint", "/ready",
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
    "--cb-failure-threshold", "1",
    "--cb-timeout-duration-secs", "5",
    "--retry-max-retries", "5",
]  # fmt: skip


def start_router(workdir: Path, workers: list[str], policy: str, *extra: str) -> Router:
    port, metrics_port = net.free_port(), net.free_port()
    log_path = workdir / f"router-{policy}-{port}.log"
    args = [
        str(ROUTER_BIN),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *workers,
        "--policy", policy,
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--worker-startup-timeout-secs", "60",
        "--request-timeout-secs", "120",
        *FAILOVER_ARGS,
        *extra,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    router = Router(proc, port, metrics_port, log_path, policy, args)
    with httpx.Client(timeout=5) as client:
        net.wait_ready(
            router.url + "/readiness",
            proc,
            time.monotonic() + 90,
            client=client,
            interval=0.2,
            error=RuntimeError,
            on_timeout=router.stop,
            exited=lambda rc: f"vllm-router exited with {rc}:\n{router.log()[-4000:]}",
            not_ready=lambda: f"vllm-router not ready in 90 s:\n{router.log()[-4000:]}",
        )
    return router
