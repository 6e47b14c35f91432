"""OpenAI-shaped errors on every route: ``{"error": {"message", "type", "param", "code"}}``.

vLLM's handlers already answer with that envelope but put the HTTP status (an int) in ``code``,
and Starlette's own 404/405 answer ``{"detail": ...}``. OpenAI clients expect ``code`` to be a
string (``"model_not_found"``, ``"context_length_exceeded"``, ...), so ``ErrorShapeMiddleware``
rewrites every JSON error response into one shape instead of each route doing it.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# status -> (type, default code)
KINDS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    422: ("invalid_request_error", "invalid_request"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    501: ("invalid_request_error", "not_implemented"),
    503: ("service_unavailable_error", "service_unavailable"),
}


def kind(status: int) -> tuple[str, str]:
    if status in KINDS:
        return KINDS[status]
    return (
        ("server_error", "internal_error") if status >= 500 else ("invalid_request_error", "invalid_request")
    )


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    err_type, default_code = kind(status)
    return {"error": {"message": message, "type": err_type, "param": param, "code": code or default_code}}


def error_response_parts(
    status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> tuple[Message, Message]:
    """The two ASGI messages of an error response, for pure-ASGI middlewares."""
    body = json.dumps(error_body(status, message, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return (
        {"type": "http.response.start", "status": status, "headers": raw},
        {"type": "http.response.body", "body": body, "more_body": False},
    )


async def send_error(
    send: Send, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> None:
    for message_part in error_response_parts(status, message, code, headers):
        await send(message_part)


def refine_code(status: int, message: str, param: str | None) -> str | None:
    """A more specific string code for the vLLM errors clients commonly branch on."""
    text = message.lower()
    if status == 404 and "model" in text:
        return "model_not_found"
    if status == 400 and ("context length" in text or "maximum context" in text or "too long" in text):
        return "context_length_exceeded"
    if status == 400 and ("json_invalid" in text or "json decode" in text):
        return "invalid_json"
    if status == 400 and param:
        return "invalid_parameter"
    return None


def normalize(status: int, payload: Any) -> dict:
    """Any error payload (vLLM's, Starlette's, ours) -> the OpenAI shape with a string code."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or err.get("detail") or "")
        param = err.get("param")
        code = err.get("code")
    else:
        detail = payload.get("detail") if isinstance(payload, dict) else payload
        message = detail if isinstance(detail, str) else json.dumps(detail) if detail else ""
        if isinstance(err, str):
            message = err
        param = code = None
    param = None if param is None else str(param)
    if not isinstance(code, str) or not code or code.isdigit():
        code = refine_code(status, message, param)
    if not message:
        message = kind(status)[1].replace("_", " ")
    return error_body(status, message, code, param)


class ErrorShapeMiddleware:
    """Rewrite JSON bodies of 4xx/5xx responses into the OpenAI error shape (string ``code``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def wrapped(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                await send(message)
                return
            if message["type"] != "http.response.body":
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await self._send_rewritten(send, start, b"".join(chunks))

        await self.app(scope, receive, wrapped)

    @staticmethod
    async def _send_rewritten(send: Send, start: Message, body: bytes) -> None:
        status = start["status"]
        try:
            payload: Any = json.loads(body) if body else {}
        except ValueError:
            payload = {"detail": body.decode(errors="replace")[:1000]}
        new = json.dumps(normalize(status, payload)).encode()
        headers = [
            (k, v)
            for k, v in start.get("headers", [])
            if k.lower() not in (b"content-length", b"content-type")
        ]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(new)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": new, "more_body": False})
