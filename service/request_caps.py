"""Per-request caps: one request must not be able to hold the engine.

vLLM's request models accept far more than one request should get on a shared server: ``n`` up to
``VLLM_MAX_N_SEQUENCES`` (16384), a thousand prompts in one ``/v1/completions`` list, logit biases
and tool schemas of any size. Each of those turns into engine work (sequences, per-step bias
tensors, grammar compilation) before any output, so one such request stalls everybody else.
``RequestCaps`` checks the parsed body against this server's limits (``QWEN4EXP_MAX_N`` and the
others in ``Limits``) and answers an OpenAI-shaped 400 that names the field, the value, the limit
and the variable that raises it.

It also weighs each request by the sequences it creates (``max(n, best_of)`` times its prompts)
and hands the weight to ``guards.Admission`` in the ASGI scope, so admission counts engine
sequences rather than HTTP requests. It therefore runs after the body limit (which has capped
and buffered the body) and before admission.

``max_tokens`` (and its aliases) is compared with the context only when ``QWEN4EXP_MAX_MODEL_LEN``
is set, since only then is the context known here without asking the engine: a request for more
new tokens than the whole context can never get them. When it is unset the field is left to vLLM,
which does not refuse it but shortens ``max_tokens`` to the room the prompt leaves, so the work
stays bounded by the context either way.

Bodies that are not a JSON object pass through untouched, as do fields of the wrong type: vLLM's
own validation words those errors. Values pydantic would coerce (``"16"``, ``16.0``) are read the
same way here, so a string cannot slip past a cap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_body
from .guards import Admission, read_body, replaying
from .media_urls import refused_media_url
from .settings import ServiceSettings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
ROUTES = frozenset({CHAT, COMPLETIONS, RESPONSES, MESSAGES})

# Fields whose JSON makes up a request's schemas (tool parameters, structured output), by route.
SCHEMA_FIELDS: dict[str, tuple[str, ...]] = {
    CHAT: ("tools", "response_format", "structured_outputs", "guided_json"),
    COMPLETIONS: ("response_format", "structured_outputs", "guided_json"),
    RESPONSES: ("tools", "text"),  # text.format carries the JSON schema
    MESSAGES: ("tools", "output_config"),
}
# New-token fields, by route.
MAX_TOKEN_FIELDS: dict[str, tuple[str, ...]] = {
    CHAT: ("max_completion_tokens", "max_tokens"),
    COMPLETIONS: ("max_tokens",),
    RESPONSES: ("max_output_tokens",),
    MESSAGES: ("max_tokens",),
}
LOGPROBS_FIELD = {CHAT: "top_logprobs", COMPLETIONS: "logprobs", RESPONSES: "top_logprobs"}
STOP_FIELD = {CHAT: "stop", COMPLETIONS: "stop", MESSAGES: "stop_sequences"}
LOGIT_BIAS_ROUTES = frozenset({CHAT, COMPLETIONS, RESPONSES})
SEQUENCE_ROUTES = frozenset({CHAT, COMPLETIONS})  # routes with n / best_of


@dataclass(frozen=True)
class Limits:
    """The caps, with the settings' defaults."""

    max_n: int = 16
    max_prompts: int = 64
    max_stop: int = 16
    max_logit_bias: int = 300
    max_tools: int = 128
    max_schema_bytes: int = 65536
    max_logprobs: int = 20
    max_new_tokens: int | None = None  # the context length, when known without the engine
    media_domains: tuple[str, ...] = ()  # hosts media URLs may be fetched from; none by default

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> Limits:
        return cls(
            max_n=settings.max_n,
            max_prompts=settings.max_prompts_per_request,
            max_stop=settings.max_stop_sequences,
            max_logit_bias=settings.max_logit_bias_entries,
            max_tools=settings.max_tools,
            max_schema_bytes=settings.max_tool_schema_bytes,
            max_logprobs=settings.max_logprobs,
            max_new_tokens=settings.max_model_len,
            media_domains=settings.media_domains,
        )


def as_int(value: object) -> int | None:
    """``value`` as the integer pydantic's lax mode would make of it, else None. Errs on the side
    of reading a number (``"1e4"``): a value read here only ever leads to a refusal when it is over
    a cap, and vLLM refuses what it cannot read anyway."""
    if isinstance(value, int):  # bool included: True is 1
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        try:
            number = float(value)
        except ValueError:
            return None
        return int(number) if number.is_integer() else None
    return None


def prompt_count(prompt: object) -> int:
    """How many prompts a ``/v1/completions`` ``prompt`` holds: a string or one list of token ids
    is one; a list of strings or of token-id lists is one per entry."""
    if isinstance(prompt, list) and not all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 0 if prompt is None else 1


def sequences_per_prompt(body: dict[str, Any]) -> int:
    """``max(n, best_of)``: the sequences the engine runs for each prompt (1 when unreadable)."""
    counts = [as_int(body.get(field)) for field in ("n", "best_of")]
    return max([1, *(c for c in counts if c is not None)])


def sequence_weight(path: str, body: dict[str, Any]) -> int:
    """The engine sequences this request creates, for admission."""
    if path not in SEQUENCE_ROUTES:
        return 1
    prompts = 1
    if path == COMPLETIONS:
        prompts = prompt_count(body.get("prompt")) + _list_len(body.get("prompt_embeds"))
    return sequences_per_prompt(body) * max(prompts, 1)


def _list_len(value: object) -> int:
    return len(value) if isinstance(value, list) else 0


def _json_size(value: object) -> int:
    try:
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
    except (ValueError, TypeError, RecursionError):
        return 0  # vLLM refuses what cannot be serialized back


def _exceeds(field: str, value: int, limit: int, variable: str) -> tuple[str, str]:
    return field, f"{field}={value} exceeds this server's limit of {limit} ({variable})."


def _too_many(field: str, count: int, noun: str, limit: int, variable: str) -> tuple[str, str]:
    return field, f"{field} has {count} {noun}, more than this server's limit of {limit} ({variable})."


def cap_problem(path: str, body: dict[str, Any], limits: Limits) -> tuple[str, str] | None:
    """The first cap ``body`` breaks on ``path``, as ``(field, message)``; None if it keeps them all."""
    if path in SEQUENCE_ROUTES:
        for field in ("n", "best_of"):
            value = as_int(body.get(field))
            if value is not None and value > limits.max_n:
                return _exceeds(field, value, limits.max_n, "QWEN4EXP_MAX_N")
    if path == COMPLETIONS:
        for field, count in (
            ("prompt", prompt_count(body.get("prompt"))),
            ("prompt_embeds", _list_len(body.get("prompt_embeds"))),
        ):
            if count > limits.max_prompts:
                return _too_many(
                    field, count, "prompts", limits.max_prompts, "QWEN4EXP_MAX_PROMPTS_PER_REQUEST"
                )
    field = STOP_FIELD.get(path)
    if field is not None:
        stop = body.get(field)
        count = 1 if isinstance(stop, str) else _list_len(stop)
        if count > limits.max_stop:
            return _too_many(field, count, "stop sequences", limits.max_stop, "QWEN4EXP_MAX_STOP_SEQUENCES")
    bias = body.get("logit_bias") if path in LOGIT_BIAS_ROUTES else None
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        return _too_many(
            "logit_bias", len(bias), "entries", limits.max_logit_bias, "QWEN4EXP_MAX_LOGIT_BIAS_ENTRIES"
        )
    field = LOGPROBS_FIELD.get(path)
    if field is not None:
        value = as_int(body.get(field))
        if value is not None and value > limits.max_logprobs:
            return _exceeds(field, value, limits.max_logprobs, "QWEN4EXP_MAX_LOGPROBS")
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        return _too_many("tools", len(tools), "tools", limits.max_tools, "QWEN4EXP_MAX_TOOLS")
    sizes = {f: _json_size(body[f]) for f in SCHEMA_FIELDS.get(path, ()) if body.get(f) is not None}
    if sum(sizes.values()) > limits.max_schema_bytes:
        message = (
            f"{' + '.join(sizes)} hold {sum(sizes.values())} bytes of JSON, more than this server's "
            f"limit of {limits.max_schema_bytes} bytes (QWEN4EXP_MAX_TOOL_SCHEMA_BYTES)."
        )
        return max(sizes, key=sizes.__getitem__), message
    if (refused := refused_media_url(path, body, limits.media_domains)) is not None:
        return refused
    if limits.max_new_tokens is not None:
        for field in MAX_TOKEN_FIELDS.get(path, ()):
            value = as_int(body.get(field))
            if value is not None and value > limits.max_new_tokens:
                message = (
                    f"{field}={value} exceeds this server's context length of {limits.max_new_tokens} "
                    "tokens (QWEN4EXP_MAX_MODEL_LEN), which the prompt shares."
                )
                return field, message
    return None


class RequestCaps:
    """400 for generation requests over a cap; the others go on with their sequence weight in
    ``scope[Admission.WEIGHT_KEY]`` and their body replayed."""

    def __init__(
        self,
        app: ASGIApp,
        settings: ServiceSettings,
        paths: frozenset[str] = ROUTES,
    ) -> None:
        self.app = app
        self.paths = paths
        self.limits = Limits.from_settings(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)  # BodyLimit, before this, has capped and buffered it
        if raw is None:
            return
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None  # not JSON: vLLM's route answers 400 itself
        if isinstance(body, dict):
            problem = cap_problem(scope["path"], body, self.limits)
            if problem is not None:
                await send_400(send, *problem)
                return
            scope[Admission.WEIGHT_KEY] = sequence_weight(scope["path"], body)
        await self.app(scope, replaying(raw, receive), send)


async def send_400(send: Send, field: str, message: str) -> None:
    """An OpenAI-shaped 400 whose ``param`` names the field."""
    payload = json.dumps(error_body(400, message, "invalid_request", field)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def vllm_environment(settings: ServiceSettings) -> dict[str, str]:
    """vLLM's own variables that follow our settings, for :mod:`service.child_environment`.

    vLLM sizes its request models' ``stop`` lists from ``VLLM_MAX_STOP_STRINGS`` (default 4) when
    they are imported, and checks ``n`` against ``VLLM_MAX_N_SEQUENCES``; left at their defaults the
    first would refuse what ``QWEN4EXP_MAX_STOP_SEQUENCES`` allows, in vLLM's words. The Responses
    API keeps answers for ``GET /v1/responses/{id}`` only under ``VLLM_ENABLE_RESPONSES_API_STORE``
    (``QWEN4EXP_RESPONSES_STORE``). Exported before vLLM is imported."""
    return {
        "VLLM_MAX_STOP_STRINGS": str(settings.max_stop_sequences),
        "VLLM_MAX_N_SEQUENCES": str(settings.max_n),
        "VLLM_ENABLE_RESPONSES_API_STORE": "1" if settings.responses_store else "0",
    }
