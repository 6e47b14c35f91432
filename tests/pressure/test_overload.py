"""Ten times more clients than admission allows: the excess gets 429 with Retry-After, nothing 5xx.

80 completions start together against 4 engine slots + 4 queue places. Every answer is a 200 or
an OpenAI-shaped 429 carrying ``Retry-After``; the admitted requests all finish; afterwards every
gauge is back to 0 and the engine answers. Latencies are printed, not asserted (timing belongs to
``bench/``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.service.conftest import error_of

from .conftest import MAX_QUEUED, MAX_RUNNING, quiet, server_rss

CLIENTS = 10 * (MAX_RUNNING + MAX_QUEUED)


def test_ten_times_the_admission_limit_gets_200_or_429(pressure_server, capsys) -> None:
    url = pressure_server.url + "/v1/completions"
    start = threading.Barrier(CLIENTS)
    rss_before = server_rss(pressure_server)

    def client(i: int) -> tuple[httpx.Response, float]:
        body = {"model": "tiny", "prompt": [10 + i, 11, 12, 13], "max_tokens": 16, "ignore_eos": True}
        start.wait()
        t0 = time.perf_counter()
        r = httpx.post(url, headers=pressure_server.auth, json=body, timeout=120)
        return r, time.perf_counter() - t0

    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(client, range(CLIENTS)))
    statuses = [r.status_code for r, _ in answers]
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    ok = sorted(t for r, t in answers if r.status_code == 200)
    gauges = quiet(pressure_server)
    rss_after = server_rss(pressure_server)
    with capsys.disabled():
        print(
            f"\n[pressure] overload: {CLIENTS} clients at once on {MAX_RUNNING}+{MAX_QUEUED} places: "
            f"{counts}; admitted latency p50 {ok[len(ok) // 2]:.2f} s max {ok[-1]:.2f} s; "
            f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
        )
    assert set(counts) <= {200, 429}, counts
    assert counts.get(429, 0) > 0, "no request was refused: the test did not overload anything"
    assert counts.get(200, 0) >= MAX_RUNNING, counts
    for r, _ in answers:
        if r.status_code == 429:
            assert r.headers.get("retry-after") == "1", dict(r.headers)
            assert error_of(r, 429)["code"] == "rate_limit_exceeded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 16
    assert set(gauges.values()) == {0}, gauges
    assert httpx.get(pressure_server.url + "/health", timeout=10).status_code == 200
