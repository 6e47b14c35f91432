"""The pressure tests' server and helpers: the real service on loopback with small limits.

One server for the whole package (``scope="package"``): admission 4 running + 4 queued, a
1,024-token context, a KV cache of a few blocks (``QWEN4EXP_KV_CACHE_MEMORY_BYTES``) so that the
cache runs out under a handful of long prompts, a 2 s body time limit and a 6 s request deadline.
The engine-level preemption tests start their own engines in-process; they run first (see
``pytest_collection_modifyitems``), so that at most one engine runs at a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.service import conftest as service_conftest
from tests.service.conftest import Server, service_env, start_server

MAX_RUNNING = 4
MAX_QUEUED = 4
MAX_MODEL_LEN = 1024
BODY_TIMEOUT_S = 2
REQUEST_TIMEOUT_S = 6
# About two 1,024-token requests' worth of tiny's KV pages (GDN/PLE states + QSA attention).
KV_CACHE_BYTES = 5 * 1024 * 1024


def _env_without_cpu_kv_space(**overrides: str) -> dict[str, str]:
    """The service tests' environment minus ``VLLM_CPU_KVCACHE_SPACE``, which on CPU would replace
    ``QWEN4EXP_KV_CACHE_MEMORY_BYTES`` (the service refuses the pair; vLLM fails on an empty value)."""
    env = service_env(**overrides)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def start_pressure_server(tmp: Path, name: str = "pressure", **extra: str | None) -> Server:
    """The service with the pressure limits (``extra`` overrides or adds variables; None leaves one
    unset, so the service's default applies)."""
    env = dict(
        QWEN4EXP_MAX_CONCURRENT_REQUESTS=str(MAX_RUNNING),
        QWEN4EXP_MAX_QUEUED_REQUESTS=str(MAX_QUEUED),
        QWEN4EXP_MAX_MODEL_LEN=str(MAX_MODEL_LEN),
        QWEN4EXP_KV_CACHE_MEMORY_BYTES=str(KV_CACHE_BYTES),
        QWEN4EXP_BODY_TIMEOUT_SECONDS=str(BODY_TIMEOUT_S),
        QWEN4EXP_REQUEST_TIMEOUT_SECONDS=str(REQUEST_TIMEOUT_S),
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(service_conftest, "service_env", _env_without_cpu_kv_space)
        chosen = {k: v for k, v in {**env, **extra}.items() if v is not None}
        return start_server(tmp, name, **chosen)


@pytest.fixture(scope="package")
def pressure_server(tmp_path_factory) -> Server:
    srv = start_pressure_server(tmp_path_factory.mktemp("pressure"))
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of these processes together (``VmRSS``), skipping ones that are gone."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def server_rss(server: Server) -> int:
    """The service process and its engine processes."""
    return rss_bytes([server.proc.pid, *server.children()])


def quiet(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """Wait until vLLM runs and queues nothing, then return the gauges that must be back to 0."""
    server.wait_engine_idle(timeout)
    m = server.metrics()
    names = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "qwen4exp_admission_running",
        "qwen4exp_admission_queued",
    )
    return {n: sum(s.value for s in m.get(n, [])) for n in names}


def counter(server: Server, name: str, **labels: str) -> float:
    """Sum of a counter's samples (``..._total``) whose labels include ``labels``."""
    return sum(
        s.value
        for s in server.metrics().get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


def _rank(item) -> int:
    return 1 if "pressure_server" in getattr(item, "fixturenames", ()) else 0


def pytest_collection_modifyitems(session, config, items) -> None:
    """Engine-level tests (their own in-process engines) before the tests of the package's server."""
    slots = [i for i, item in enumerate(items) if "tests/pressure/" in item.nodeid.replace("\\", "/")]
    ordered = sorted((items[i] for i in slots), key=_rank)
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item
