"""Many clients that hang up mid-request leave nothing behind.

64 streamed completions, 8 at a time against 4 engine slots + 4 queue places, each cut at a random
point: before the response starts (some while queued for a slot), or after 0-40 SSE events. A
disconnect must abort the engine request and free its admission slot and its engine states.
Afterwards vLLM runs and queues nothing, the admission gauges are 0, the KV cache holds no
request's blocks, and the processes' resident memory grew by less than a bound over a round that
repeats a warm-up round's traffic exactly. The engine worker's memory grows with every new batch
shape it sees (measured: six rounds of fresh random traffic grew it 252, 157, 115, 44, 62, 49 MiB;
six rounds of one repeated traffic 231, 55, 35, 22, 9, 6 MiB); a leak per request would add the
same amount every round instead.

A request queued for a slot has no handler that could notice its client leave; the admission
middleware listens for the disconnect itself (``service.queue_watch``): the second test fills the
engine slots with streams, lets 4 queued clients hang up, and sees the queue empty while the
streams still run.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import MAX_QUEUED, MAX_RUNNING, quiet, server_rss

PARALLEL = 8
STREAMS = 64
RSS_GROWTH_BOUND = 128 * 1024 * 1024


def cut_stream(url: str, headers: dict, seed: int) -> str:
    """One stream, cut where ``seed`` says; returns how it ended."""
    rng = random.Random(seed)
    body = {
        "model": "tiny",
        "prompt": [rng.randrange(10, 500) for _ in range(rng.randrange(4, 200))],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    if rng.random() < 0.25:  # hang up before the answer starts (queued, or in prefill)
        try:
            httpx.post(
                url, headers=headers, json=body, timeout=httpx.Timeout(30, read=rng.uniform(0.01, 0.3))
            )
        except httpx.ReadTimeout:
            return "before-response"
        return "finished"
    events = rng.randrange(0, 41)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url, headers=headers, json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    seen += 1
                    if seen >= events:
                        return "mid-stream"
    return "finished"


def storm(url: str, headers: dict, count: int, seed: int) -> dict[str, int]:
    with ThreadPoolExecutor(PARALLEL) as pool:
        ends = list(pool.map(lambda i: cut_stream(url, headers, seed + i), range(count)))
    return {end: ends.count(end) for end in sorted(set(ends))}


def test_disconnect_storm_frees_slots_states_and_memory(pressure_server, capsys) -> None:
    url = pressure_server.url + "/v1/completions"
    storm(url, pressure_server.auth, STREAMS, seed=0)
    assert set(quiet(pressure_server).values()) == {0}
    rss_before = server_rss(pressure_server)
    generated_before = pressure_server.gauge("vllm:generation_tokens_total")
    ends = storm(url, pressure_server.auth, STREAMS, seed=0)
    gauges = quiet(pressure_server)
    usage = pressure_server.gauge("vllm:kv_cache_usage_perc")
    rss_after = server_rss(pressure_server)
    generated = pressure_server.gauge("vllm:generation_tokens_total") - generated_before
    with capsys.disabled():
        print(
            f"\n[pressure] disconnect storm: {STREAMS} streams (after {STREAMS} alike), ends {ends}, "
            f"{generated:.0f} tokens generated of {STREAMS * 300} asked, gauges after {gauges}, "
            f"KV cache usage {usage:.3f}, RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
        )
    # A client that reconnects at once can still find its old request counted (the server has not
    # processed the hang-up yet): 429 is allowed, any other status is not.
    assert set(ends) <= {"before-response", "mid-stream", "finished", "status 429"}, ends
    assert ends.get("mid-stream", 0) + ends.get("before-response", 0) >= STREAMS // 2, ends
    assert set(gauges.values()) == {0}, gauges
    assert usage == 0, f"KV cache still {usage:.1%} in use with no request running"
    assert rss_after - rss_before < RSS_GROWTH_BOUND, (rss_before, rss_after)
    assert httpx.get(pressure_server.url + "/health", timeout=10).status_code == 200


def test_clients_leaving_the_queue_free_their_places_at_once(pressure_server, capsys) -> None:
    url = pressure_server.url + "/v1/completions"
    assert set(quiet(pressure_server).values()) == {0}
    running = threading.Barrier(MAX_RUNNING + 1, timeout=120)
    release = threading.Event()

    def long_stream(i: int) -> None:
        body = {
            "model": "tiny",
            "prompt": [30 + i, 31],
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", url, headers=pressure_server.auth, json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                running.wait()
                release.wait(120)

    streams = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(MAX_RUNNING)]
    for t in streams:
        t.start()
    try:
        running.wait()  # every engine slot holds a stream
        with ThreadPoolExecutor(MAX_QUEUED) as pool:  # these wait for a slot, then hang up

            def queued_then_gone(i: int) -> str:
                try:
                    httpx.post(
                        url,
                        headers=pressure_server.auth,
                        json={"model": "tiny", "prompt": [40 + i], "max_tokens": 8},
                        timeout=httpx.Timeout(30, read=1.0),
                    )
                except httpx.ReadTimeout:
                    return "left"
                return "answered"

            left = list(pool.map(queued_then_gone, range(MAX_QUEUED)))
        deadline = time.monotonic() + 30
        while pressure_server.gauge("qwen4exp_admission_queued") and time.monotonic() < deadline:
            time.sleep(0.1)
        queued = pressure_server.gauge("qwen4exp_admission_queued")
        still_running = pressure_server.gauge("qwen4exp_admission_running")
    finally:
        release.set()
        for t in streams:
            t.join(60)
    gauges = quiet(pressure_server)
    with capsys.disabled():
        print(
            f"\n[pressure] queue hang-ups: {left.count('left')} of {MAX_QUEUED} queued clients left; "
            f"queue then {queued:.0f}, running {still_running:.0f} (the {MAX_RUNNING} streams)"
        )
    assert left == ["left"] * MAX_QUEUED, left
    assert queued == 0, "a client that left still holds its queue place"
    assert still_running == MAX_RUNNING, "the streams ended before the queue could be watched"
    assert set(gauges.values()) == {0}, gauges
