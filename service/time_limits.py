"""Time limits for slow clients: a body that trickles in, and a request that runs too long.

Neither uvicorn nor vLLM bounds them. A client that sends its body a byte at a time (slowloris)
holds a connection and a task forever; a client that reads a stream one event a second holds an
engine slot and an admission slot for as long as it likes. Both are pure ASGI middlewares:

* ``BodyTimeout``: the whole body must arrive within ``QWEN4EXP_BODY_TIMEOUT_SECONDS`` of the
  request's start, else 408 and the connection is closed. It sits before the body limit, which
  reads the body, so no handler and no admission slot is ever reached by a trickled body.
* ``RequestDeadline``: an admitted generation request runs at most
  ``QWEN4EXP_REQUEST_TIMEOUT_SECONDS``. At the deadline the handler is cancelled, which makes vLLM
  abort the engine request (as a disconnect does), and the client gets a ``request_timeout``
  error: a 408 if nothing was sent yet, else a last SSE error event and ``[DONE]`` (vLLM's own
  shape for an error mid-stream), so the stream ends cleanly instead of being cut.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import http_metrics
from .errors import error_body, error_response_parts, send_error

log = logging.getLogger("service.time_limits")

# How long the closing message of a timed-out request may take to send; a client that does not
# read at all gets its connection closed instead.
FINAL_SEND_TIMEOUT_S = 5.0
# After a 408 for a trickled body, how long the connection keeps reading (and dropping) what the
# client still sends before it is closed. Closing a socket with unread bytes in its receive buffer,
# or with bytes still in flight, makes the kernel answer with a TCP reset, and a client that gets
# the reset before it has read the 408 loses the answer (RFC 9112 section 9.6, "lingering close").
LINGER_S = 2.0
# ...or until the client has sent nothing for this long: longer than a busy client takes to notice
# the answer between two of its writes (a trickler writing every 0.25 s on a loaded host can stall
# past half a second, and its next byte then meets a closed socket and a reset).
LINGER_QUIET_S = 1.0


class BodyTimedOut(Exception):
    """The request body did not arrive in time."""


class BodyTimeout:
    """408 when the request body is not complete within ``seconds`` of the request's start."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.seconds
        body_done = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:  # afterwards the app only waits for a disconnect: no limit
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise BodyTimedOut from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked)
        except BodyTimedOut:
            http_metrics.TIMEOUTS.labels("body").inc()
            if started:
                raise
            start, body = error_response_parts(
                408,
                f"The request body did not arrive within {self.seconds:g} s (QWEN4EXP_BODY_TIMEOUT_SECONDS).",
                "request_timeout",
                {"Connection": "close"},
            )
            # The whole answer goes out first; the response ends (and uvicorn closes the connection)
            # only after the client stopped sending, hung up, or LINGER_S passed.
            await send(start)
            await send({**body, "more_body": True})
            await linger(receive, LINGER_S, LINGER_QUIET_S)
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def linger(receive: Receive, seconds: float, quiet: float) -> None:
    """Read and drop request body messages until the client hangs up, its body ends, it sends
    nothing for ``quiet`` seconds, or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = await asyncio.wait_for(receive(), min(left, quiet))
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class RequestDeadline:
    """End an admitted generation request after ``seconds``: engine request aborted, client told."""

    def __init__(self, app: ASGIApp, paths: frozenset[str], seconds: float) -> None:
        self.app = app
        self.paths = paths
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        started = finished = streaming = False

        async def tracked(message: Message) -> None:
            nonlocal started, finished, streaming
            if message["type"] == "http.response.start":
                started = True
                headers = dict(message.get("headers", []))
                streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            async with asyncio.timeout(self.seconds):
                await self.app(scope, receive, tracked)
            return
        except TimeoutError:
            if finished:
                return
        http_metrics.TIMEOUTS.labels("request").inc()
        text = f"The request ran longer than {self.seconds:g} s (QWEN4EXP_REQUEST_TIMEOUT_SECONDS) and was stopped."
        log.warning("%s %s: %s", scope["method"], scope["path"], text)
        try:
            async with asyncio.timeout(FINAL_SEND_TIMEOUT_S):
                if not started:
                    await send_error(send, 408, text, "request_timeout", {"Connection": "close"})
                elif streaming:
                    event = json.dumps(error_body(408, text, "request_timeout"))
                    chunk = f"data: {event}\n\ndata: [DONE]\n\n".encode()
                    await send({"type": "http.response.body", "body": chunk, "more_body": False})
                # A plain (JSON) response is sent in one message: started means finished.
        except TimeoutError:
            log.warning(
                "%s %s: the client does not read; closing its connection", scope["method"], scope["path"]
            )
