"""Slow clients hold neither the engine nor other clients back, and their time is limited.

* Slowloris: 12 connections (more than the 4 + 4 admission places) send headers, then trickle
  their body a byte at a time. They never reach admission or the engine: a normal client's first
  request succeeds while every trickler is still sending, its others succeed too, and each trickler
  gets a 408 ``request_timeout`` (``QWEN4EXP_BODY_TIMEOUT_SECONDS``) and a clean close (no reset).
* Slow reader: 2 streams read one SSE event a second. A normal client's streams all finish while
  they are still reading; the slow ones are ended at ``QWEN4EXP_REQUEST_TIMEOUT_SECONDS`` with a
  last ``request_timeout`` error event and ``[DONE]``, their engine requests aborted.

The normal client's time to first token is printed next to the slow clients' (timing is not
asserted: speed belongs to ``bench/``).
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx

from .conftest import BODY_TIMEOUT_S, MAX_MODEL_LEN, REQUEST_TIMEOUT_S, counter, quiet

TRICKLERS = 12
SLOW_READERS = 2
NORMAL_REQUESTS = 6
SAFETY_CAP_S = 60  # ends a test that would otherwise hang; the server's limits are far below it


def normal_streams(url: str, headers: dict, count: int) -> list[float]:
    """Streamed completions one after another; their times to the first token (all must be 200)."""
    ttfts = []
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 8, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        for _ in range(count):
            t0 = time.perf_counter()
            with client.stream("POST", url, headers=headers, json=body) as r:
                assert r.status_code == 200, r.read()
                events = [line for line in r.iter_lines() if line.startswith("data:")]
                ttfts.append(time.perf_counter() - t0 if events else float("nan"))
                assert events[-1] == "data: [DONE]"
    return ttfts


def trickle(host: str, port: int, auth: str, outcome: dict, i: int) -> None:
    """Send a POST's headers, then its body a byte every 0.25 s until the server answers."""
    body = json.dumps({"model": "tiny", "prompt": "x" * 100, "max_tokens": 4}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port), timeout=SAFETY_CAP_S) as sock:
        sock.sendall(head)
        deadline = time.monotonic() + SAFETY_CAP_S
        sent = 0
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0.25)
            if readable:
                break
            if sent < len(body) - 1:  # never the last byte: the body stays incomplete
                try:
                    sock.sendall(body[sent : sent + 1])
                except OSError:
                    break
                sent += 1
        outcome[f"sent-{i}"] = sent
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:  # the server closed with our bytes unread: not a clean close
            outcome[f"reset-{i}"] = True
        outcome[i] = b"".join(chunks)  # ends only when the server closed the connection


def test_slowloris_bodies_hold_nothing_and_get_408(pressure_server, capsys) -> None:
    parts = urlsplit(pressure_server.url)
    auth = pressure_server.auth["Authorization"]
    timeouts_before = counter(pressure_server, "qwen4exp_request_timeouts_total", limit="body")
    outcome: dict = {}
    threads = [
        threading.Thread(target=trickle, args=(parts.hostname, parts.port, auth, outcome, i), daemon=True)
        for i in range(TRICKLERS)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)  # every trickler has sent its headers
    url = pressure_server.url + "/v1/completions"
    # The first normal stream must succeed while all 12 tricklers (more than the 8 admission places)
    # are connected: they hold no place. The others only have to succeed (on a loaded host they can
    # outlast the body limit).
    ttfts = normal_streams(url, pressure_server.auth, 1)
    still_sending = sum(1 for i in range(TRICKLERS) if i not in outcome)
    ttfts += normal_streams(url, pressure_server.auth, NORMAL_REQUESTS - 1)
    for t in threads:
        t.join(SAFETY_CAP_S + 5)
    with capsys.disabled():
        print(
            f"\n[pressure] slowloris: {TRICKLERS} trickled bodies; {NORMAL_REQUESTS} normal streams "
            f"done, the first while {still_sending} still trickled, TTFT max {max(ttfts):.2f} s; tricklers sent "
            f"{sorted(outcome[f'sent-{i}'] for i in range(TRICKLERS))} bytes before their answer"
        )
    assert still_sending == TRICKLERS, "a trickler was answered before the first normal request finished"
    unanswered = [i for i in range(TRICKLERS) if i not in outcome]
    assert not unanswered, f"tricklers {unanswered} got no closed connection within {SAFETY_CAP_S + 5} s"
    resets = [i for i in range(TRICKLERS) if outcome.get(f"reset-{i}")]
    assert not resets, f"tricklers {resets} got a TCP reset instead of a clean close after their 408"
    for i in range(TRICKLERS):
        raw = outcome[i]
        status_line, _, rest = raw.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 408"), raw[:300]
        assert b"connection: close" in rest.lower(), raw[:300]
        error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout" and f"{BODY_TIMEOUT_S}" in error["message"], error
    timeouts = counter(pressure_server, "qwen4exp_request_timeouts_total", limit="body") - timeouts_before
    assert timeouts == TRICKLERS
    assert set(quiet(pressure_server).values()) == {0}


def slow_read(url: str, headers: dict, outcome: dict, i: int) -> None:
    """A stream as long as the context allows, read one event a second for longer than the
    deadline, then drained to its end."""
    body = {
        "model": "tiny",
        "prompt": [20 + i, 21, 22],
        "max_tokens": MAX_MODEL_LEN - 3,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    with httpx.Client(timeout=SAFETY_CAP_S) as client:
        with client.stream("POST", url, headers=headers, json=body) as r:
            outcome[f"status-{i}"] = r.status_code
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            for line in lines:
                events.append(line)
                if len(events) <= REQUEST_TIMEOUT_S + 2:
                    time.sleep(1.0)
    outcome[i] = events


def test_slow_readers_are_cut_at_the_deadline_and_hold_no_one_back(pressure_server, capsys) -> None:
    url = pressure_server.url + "/v1/completions"
    timeouts_before = counter(pressure_server, "qwen4exp_request_timeouts_total", limit="request")
    generated_before = pressure_server.gauge("vllm:generation_tokens_total")
    outcome: dict = {}
    threads = [
        threading.Thread(target=slow_read, args=(url, pressure_server.auth, outcome, i), daemon=True)
        for i in range(SLOW_READERS)
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the slow streams have begun
    ttfts = normal_streams(url, pressure_server.auth, NORMAL_REQUESTS)
    still_reading = sum(1 for i in range(SLOW_READERS) if i not in outcome)
    for t in threads:
        t.join(SAFETY_CAP_S + 5)
    gauges = quiet(pressure_server)
    generated = pressure_server.gauge("vllm:generation_tokens_total") - generated_before
    timeouts = counter(pressure_server, "qwen4exp_request_timeouts_total", limit="request") - timeouts_before
    with capsys.disabled():
        print(
            f"\n[pressure] slow readers: {SLOW_READERS} streams read at 1 event/s, "
            f"{[len(outcome.get(i, [])) for i in range(SLOW_READERS)]} events each before their end; "
            f"{NORMAL_REQUESTS} normal streams done while {still_reading} were reading, TTFT max "
            f"{max(ttfts):.2f} s; {timeouts:.0f} request timeouts; {generated:.0f} tokens generated"
        )
    assert still_reading == SLOW_READERS, "a slow reader ended before the normal streams"
    for i in range(SLOW_READERS):
        assert outcome[f"status-{i}"] == 200
        events = outcome[i]
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "request_timeout", error
        assert len(events) - 2 < MAX_MODEL_LEN - 3, "the stream ran to its end: no deadline reached"
    assert timeouts == SLOW_READERS
    assert generated < SLOW_READERS * (MAX_MODEL_LEN - 3), "the engine kept generating for the cut streams"
    assert set(gauges.values()) == {0}, gauges
