"""``service.time_limits.BodyTimeout``: a trickled body gets its whole 408 before the connection
closes, and the close waits until the client has stopped sending (no TCP reset over unread bytes)."""

from __future__ import annotations

import asyncio
import json

from service import time_limits
from service.time_limits import BodyTimeout, linger


async def _reads_body(scope, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass


def _scope() -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def test_trickled_body_gets_the_whole_408_then_the_end_after_the_client_goes_quiet():
    sent, log = [], []

    async def receive():
        if not log:
            log.append("chunk")
            return {"type": "http.request", "body": b"{", "more_body": True}
        log.append("waiting")
        await asyncio.sleep(60)  # the trickler stopped sending

    async def send(message):
        sent.append(message)

    asyncio.run(BodyTimeout(_reads_body, seconds=0.05)(_scope(), receive, send))
    start, body, end = sent
    assert start["status"] == 408 and (b"connection", b"close") in start["headers"]
    assert body["more_body"] is True and json.loads(body["body"])["error"]["code"] == "request_timeout"
    assert end == {"type": "http.response.body", "body": b"", "more_body": False}
    assert log.count("waiting") >= 2  # the deadline's wait, then the linger's


def test_linger_drops_what_a_client_keeps_sending_and_stops_at_its_limit():
    received = 0

    async def receive():
        nonlocal received
        received += 1
        await asyncio.sleep(0.01)
        return {"type": "http.request", "body": b"x", "more_body": True}

    asyncio.run(linger(receive, 0.2, time_limits.LINGER_QUIET_S))
    assert received > 1


def test_linger_ends_at_a_hang_up():
    calls = 0

    async def receive():
        nonlocal calls
        calls += 1
        return {"type": "http.disconnect"}

    asyncio.run(linger(receive, 5.0, 5.0))
    assert calls == 1
