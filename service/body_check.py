"""Refuse request bodies that crash vLLM's request models instead of failing their validation.

Some of vLLM's pydantic ``model_validator(mode="before")`` hooks assume field types before
pydantic has checked them; e.g. ``{"structured_outputs": false}`` on ``/v1/completions`` raises
``AttributeError: 'bool' object has no attribute 'get'`` inside ``CompletionRequest``'s validator
(vLLM 0.32), which FastAPI turns into a 500 and counts as a server error. This middleware
validates generation bodies with the same models first: a body whose validation raises anything
but pydantic's ``ValidationError`` is the client's error and gets a 400 here. Valid bodies and
ordinary validation errors go on to vLLM's routes unchanged (vLLM words those 400s itself).
"""

from __future__ import annotations

import json

from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import send_error
from .guards import read_body, replaying


def request_models() -> dict[str, type]:
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/completions": CompletionRequest,
        "/v1/responses": ResponsesRequest,
        "/v1/messages": AnthropicMessagesRequest,
        "/v1/messages/count_tokens": AnthropicCountTokensRequest,
    }


def validation_crash(model: type, body: bytes) -> str | None:
    """Why validating ``body`` with ``model`` crashed, or None if it validated or failed cleanly."""
    try:
        data = json.loads(body)
    except RecursionError:  # e.g. thousands of nested brackets: the parser's stack, not the client's JSON
        return "JSON nested too deeply"
    except ValueError:
        return None  # not JSON: vLLM's route answers 400 itself
    if not isinstance(data, dict):
        return None
    try:
        model.model_validate(data)
    except ValidationError:
        return None
    except Exception as exc:  # a validator tripped over a wrongly typed field
        return f"{type(exc).__name__}: {exc}"
    return None


class BodyValidation:
    """400 for bodies whose validation would crash (see the module docstring); replays the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.models = request_models()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = self.models.get(scope.get("path", "")) if scope["type"] == "http" else None
        if model is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)  # BodyLimit, before this, has capped and buffered it
        if body is None:
            return
        crash = validation_crash(model, body)
        if crash is not None:
            await send_error(send, 400, f"Invalid request body: {crash}", "invalid_request")
            return
        await self.app(scope, replaying(body, receive), send)
