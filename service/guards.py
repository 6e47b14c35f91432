"""Request guards vLLM's serving layer lacks: bearer keys, a body-size cap, and admission control.

All are pure ASGI middlewares (no ``BaseHTTPMiddleware``): they must not buffer or wrap streamed
responses, and a client's disconnect must still reach vLLM's handlers, which abort the engine
request when they see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import http_metrics
from .errors import send_error
from .lifecycle import Lifecycle
from .queue_watch import acquire_unless_disconnected

log = logging.getLogger("service.guards")


class BodyTooLarge(Exception):
    """The request body exceeded the limit while it was being read."""


async def read_body(receive: Receive, max_bytes: int | None = None) -> bytes | None:
    """The whole request body; None if the client disconnected first. :class:`BodyTooLarge` as
    soon as more than ``max_bytes`` arrived (a chunked body has no Content-Length to check)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if max_bytes is not None and size > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` once, then the server's own ``receive`` again (so
    the app still learns about a disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _digests(keys: list[str]) -> list[bytes]:
    return [hashlib.sha256(k.encode()).digest() for k in keys]


class ApiKeys:
    """The accepted keys: ``QWEN4EXP_API_KEYS``'s (fixed) and the keys file's, re-read when it changes.

    Rotation without a restart (a restart reloads the model, 20-30 minutes): before each check the
    file's identity (inode, size, mtime, ctime; ``os.stat`` follows a Kubernetes Secret's
    ``..data`` symlink swap) is compared with the one last read, and a changed file is read again.
    A new version without any key, or one that cannot be read, is refused with an error in the log
    and the previous keys stay in force: auth never turns itself off (fail closed).
    """

    def __init__(self, fixed: list[str], path: Path | None, read: Callable[[Path], list[str]]) -> None:
        self.fixed = fixed
        self.path = path
        self.read = read
        self._stamp: tuple[int, ...] | None = None
        self._loaded = False
        self.digests = _digests(fixed)
        self.reload()

    def _identity(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path) if self.path is not None else None
        except OSError:
            return None
        return None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def reload(self) -> bool:
        """Re-read the file if it changed since the last read; True when new keys took effect."""
        if self.path is None:
            return False
        stamp = self._identity()
        if stamp is None or stamp == self._stamp:
            return False
        try:
            keys = self.fixed + self.read(self.path)
        except OSError as exc:
            log.error("API keys file %s unreadable (%s): keeping the previous keys", self.path, exc)
            return False
        self._stamp = stamp
        if not keys:
            log.error("API keys file %s now holds no key: keeping the previous keys (fail closed)", self.path)
            return False
        first = self._loaded is False
        changed = _digests(keys) != self.digests
        self.digests, self._loaded = _digests(keys), True
        if changed and not first:
            log.info("API keys reloaded from %s: %d key(s)", self.path, len(keys))
        return changed

    def __len__(self) -> int:
        return len(self.digests)


class BearerAuth:
    """Require ``Authorization: Bearer <key>`` except on ``open_paths`` (probes, optionally metrics).

    ``keys``: an :class:`ApiKeys` (reloaded before each check) or a fixed list.
    """

    def __init__(self, app: ASGIApp, keys: ApiKeys | list[str], open_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = keys if isinstance(keys, ApiKeys) else ApiKeys(list(keys), None, lambda _: [])
        self.open_paths = open_paths

    def _valid(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        self.keys.reload()
        digest = hashlib.sha256(token.strip().encode()).digest()
        # Compare against every key so the time taken does not reveal which one matched.
        return sum(hmac.compare_digest(digest, d) for d in self.keys.digests) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        if not self._valid(header):
            message = (
                "Missing bearer API key: send 'Authorization: Bearer <key>'."
                if header is None
                else "Invalid API key."
            )
            await send_error(send, 401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for bodies over ``max_bytes``, from Content-Length when present, else while reading.

    The body is read here in full (the routes parse it whole anyway) and replayed to the app, so a
    too-large chunked body is refused before any handler sees it. After the replay, ``receive``
    is the server's again, so the app still learns about a disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(send)
            return
        try:
            body = await read_body(receive, self.max_bytes)
        except BodyTooLarge:
            await self._too_large(send)
            return
        if body is not None:
            await self.app(scope, replaying(body, receive), send)

    async def _too_large(self, send: Send) -> None:
        await send_error(
            send,
            413,
            f"Request body is larger than the {self.max_bytes}-byte limit (QWEN4EXP_MAX_BODY_BYTES).",
            "request_too_large",
            {"Connection": "close"},
        )


class Admission:
    """At most ``max_running`` sequences in the engine, ``max_queued`` more waiting; beyond that 429
    with Retry-After, so overload is refused at once rather than queued without bound.

    A request weighs the sequences it makes the engine run (``n``/``best_of`` times its prompts),
    which ``request_caps.RequestCaps`` puts in ``scope[WEIGHT_KEY]`` (absent: 1): counted per HTTP
    request, one ``n=16`` request would be admitted as cheaply as a single completion. A weight is
    clamped to ``max_running``, so that a request heavier than the whole engine still runs, alone.
    Slots are granted in arrival order: light requests do not overtake a heavy one waiting at the
    head, which would otherwise starve.
    """

    WEIGHT_KEY = "qwen4exp.weight"

    def __init__(
        self,
        app: ASGIApp,
        paths: frozenset[str],
        max_running: int,
        max_queued: int,
        retry_after: int,
        lifecycle: Lifecycle,
    ) -> None:
        self.app = app
        self.paths = paths
        self.limit = max_running + max_queued
        self.max_running = max_running
        self.retry_after = str(retry_after)
        self.lifecycle = lifecycle
        self.admitted = 0  # sequences running + queued
        self.free = max_running  # engine slots (sequences) not held
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def weight(self, scope: Scope) -> int:
        value = scope.get(self.WEIGHT_KEY, 1)
        return min(max(value, 1), self.max_running) if isinstance(value, int) else 1

    def _waiting(self) -> bool:
        return any(not future.cancelled() for _, future in self._waiters)

    async def _acquire(self, weight: int) -> bool:
        if self.free >= weight and not self._waiting():
            self.free -= weight
            return True
        entry = (weight, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self._release(weight)  # granted just as it was cancelled: give the slots back
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()  # a heavy head leaving may let lighter ones behind it in
            raise
        return True

    def _release(self, weight: int) -> None:
        self.free += weight
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            weight, future = self._waiters[0]
            if not future.done():
                if self.free < weight:
                    return
                self.free -= weight
                future.set_result(None)
            self._waiters.popleft()

    def slots(self, weight: int) -> SimpleNamespace:
        """``weight`` slots as one semaphore (``locked``/``acquire``/``release``), the interface
        ``acquire_unless_disconnected`` waits on."""
        return SimpleNamespace(
            locked=lambda: self.free < weight or self._waiting(),
            acquire=lambda: self._acquire(weight),
            release=lambda: self._release(weight),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        weight = self.weight(scope)
        if self.admitted + weight > self.limit:
            message = (
                f"Too many requests: {self.limit} are already running or queued; retry later."
                if weight == 1
                else f"Too many requests: this request's {weight} sequences do not fit in the "
                f"{self.limit - self.admitted} of {self.limit} admission slots free; retry later."
            )
            await send_error(send, 429, message, "rate_limit_exceeded", {"Retry-After": self.retry_after})
            return
        slots = self.slots(weight)
        self.admitted += weight
        status = 0

        async def wrapped(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        queued = True
        http_metrics.ADMISSION_QUEUED.inc()
        try:
            acquired, receive = await acquire_unless_disconnected(slots, receive)
            if not acquired:  # the client left while queued: its place is free, nothing to answer
                return
            try:
                queued = False
                http_metrics.ADMISSION_QUEUED.dec()
                http_metrics.ADMISSION_RUNNING.inc()
                try:
                    await self.app(scope, receive, wrapped)
                finally:
                    http_metrics.ADMISSION_RUNNING.dec()
            finally:
                slots.release()
        finally:
            if queued:  # cancelled while waiting for a slot
                http_metrics.ADMISSION_QUEUED.dec()
            self.admitted -= weight
        if status == 200:
            self.lifecycle.generation_succeeded()
