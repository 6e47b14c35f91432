"""Media URLs in a request: which hosts the engine would fetch from, and whether this server allows them.

On a checkpoint with a vision (or audio) tower, vLLM downloads every ``image_url``, ``video_url``,
``audio_url`` or Responses ``input_image`` URL a client sends, from the serving process: a
server-side request to any address the server can reach (metadata endpoints, internal services).
vLLM restricts this only when ``--allowed-media-domains`` is given and fetches from anywhere
otherwise. Here no remote media URL passes unless its host is listed in
``QWEN4EXP_ALLOWED_MEDIA_DOMAINS`` (the same list then goes to vLLM, which checks it again after
its own parsing); inline ``data:`` URLs are not fetched and always pass.

The walk is by key, not by content type, so a part type this module does not know still cannot
carry a URL past it: any string under a ``url``-like key inside the messages (``image_url`` as a
string or ``{"url": ...}``, Anthropic's ``{"source": {"type": "url", "url": ...}}``) counts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

# Where each route carries content parts.
CONTENT_FIELDS = {
    "/v1/chat/completions": "messages",
    "/v1/responses": "input",
    "/v1/messages": "messages",
}
URL_KEYS = frozenset({"url", "image_url", "video_url", "audio_url", "file_url"})
HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


def parse_domains(raw: str) -> tuple[str, ...]:
    """``QWEN4EXP_ALLOWED_MEDIA_DOMAINS``: comma-separated host names, lower-cased; ValueError names
    the first entry that is not one (a scheme, a path or a port is a common slip)."""
    domains = tuple(d.strip().lower().rstrip(".") for d in raw.split(",") if d.strip())
    for domain in domains:
        if not HOSTNAME.match(domain):
            raise ValueError(
                f"{domain!r} is not a host name (no scheme, port or path: e.g. images.example.com)"
            )
    return domains


def _urls(node: Any, key: str | None = None) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _urls(v, k)
    elif isinstance(node, list):
        for item in node:
            yield from _urls(item, key)
    elif isinstance(node, str) and key in URL_KEYS:
        yield node


def refused_media_url(path: str, body: dict[str, Any], allowed: tuple[str, ...]) -> tuple[str, str] | None:
    """``(field, message)`` for the first media URL of ``body`` the engine would fetch from a host
    outside ``allowed``; None when there is none."""
    field = CONTENT_FIELDS.get(path)
    if field is None or field not in body:
        return None
    for url in _urls(body[field]):
        parts = urlsplit(url.strip())
        host = (parts.hostname or "").rstrip(".")  # urlsplit lower-cases it
        if parts.scheme.lower() == "data" or (host and host in allowed):
            continue
        shown = url if len(url) <= 120 else url[:117] + "..."
        if not allowed:
            why = "this server fetches no media URLs (QWEN4EXP_ALLOWED_MEDIA_DOMAINS is unset)"
        else:
            why = f"its host {host or '(none)'!r} is not in QWEN4EXP_ALLOWED_MEDIA_DOMAINS"
        return field, f"media URL {shown!r} refused: {why}; send the media inline as a data: URL instead."
    return None
