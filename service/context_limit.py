"""A prompt that fills the whole context gets an error that names the context limit.

vLLM 0.32 admits a prompt of exactly ``max_model_len`` tokens (its length check is "longer than
the limit"), then clamps the request's ``max_tokens`` to the room left, 0, and its sampling
parameters refuse that with "max_tokens must be at least 1, got 0": a 400 that blames a parameter
the client may not even have sent. This middleware rewrites that one answer into vLLM's own
context-length wording (``context_length_exceeded``), with the limit and the longest prompt that
fits, unless the client really asked for ``max_tokens``/``max_completion_tokens`` 0.

It runs after the body limit, which hands the app the whole body in one message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body

CLAMPED = re.compile(r"max_tokens must be at least 1, got 0\b")


def asked_for_zero(body: bytes) -> bool:
    try:
        request = json.loads(body)
    except ValueError:
        return False
    if not isinstance(request, dict):
        return False
    return any(request.get(key) == 0 for key in ("max_tokens", "max_completion_tokens"))


class ContextLimitMessage:
    """Rewrite vLLM's clamped-``max_tokens`` 400 on ``paths`` into a context-length error."""

    def __init__(self, app: ASGIApp, paths: frozenset[str], max_model_len: Callable[[], int | None]) -> None:
        self.app = app
        self.paths = paths
        self.max_model_len = max_model_len  # the engine's, known once it is up

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        body = bytearray()
        body_done = False

        async def recording() -> Message:
            nonlocal body_done
            message = await receive()
            if not body_done and message["type"] == "http.request":
                body.extend(message.get("body", b""))
                body_done = not message.get("more_body", False)
            return message

        start: Message | None = None
        chunks: list[bytes] = []

        async def wrapped(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] == 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await self._send(send, start, b"".join(chunks), bytes(body))

        await self.app(scope, recording, wrapped)

    async def _send(self, send: Send, start: Message, answer: bytes, request: bytes) -> None:
        limit = self.max_model_len()
        if limit and CLAMPED.search(answer.decode(errors="replace")) and not asked_for_zero(request):
            text = (
                f"This model's maximum context length is {limit} tokens. However, your prompt fills "
                f"all {limit} of them, leaving no room for an output token. Please reduce the prompt "
                f"to at most {limit - 1} tokens."
            )
            answer = json.dumps(error_body(400, text, "context_length_exceeded", "input_tokens")).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": 400, "headers": headers})
        await send({"type": "http.response.body", "body": answer, "more_body": False})
