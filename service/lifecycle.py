"""Start-up, serving and drain phases, and the gate that answers 503 outside ``serving``.

The HTTP server listens before the engine is up (loading takes a while), so orchestrators and
clients get a clear 503 instead of connection errors; after SIGTERM it keeps listening while
in-flight requests finish, answering new ones with 503 so load balancers move on.
"""

from __future__ import annotations

import asyncio
import time
from enum import StrEnum

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import send_error

# Routes that answer in every phase (probes and scraping).
# /get_load: the router's load poll must not count itself as in flight.
UNGATED = frozenset({"/health", "/ready", "/metrics", "/get_load"})


class Phase(StrEnum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class Lifecycle:
    """Process-wide state shared by the routes, the middlewares and the run loop."""

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.last_generation_ok: float | None = None  # time.monotonic() of the last success
        self.last_engine_progress: float | None = None  # last engine step that processed tokens

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no gated request is in flight; False if the timeout passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def generation_succeeded(self) -> None:
        self.last_generation_ok = time.monotonic()

    def generation_age(self) -> float | None:
        return None if self.last_generation_ok is None else time.monotonic() - self.last_generation_ok

    def engine_progressed(self) -> None:
        self.last_engine_progress = time.monotonic()

    def freshness_age(self) -> float | None:
        """Seconds since the engine last showed it works: a finished generation or a step that
        processed tokens (a busy engine whose requests are all long still progresses)."""
        stamps = [t for t in (self.last_generation_ok, self.last_engine_progress) if t is not None]
        return time.monotonic() - max(stamps) if stamps else None


class LifecycleGate:
    """503 (OpenAI-shaped, with Retry-After) for gated routes unless serving; counts in-flight."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, retry_after: int) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.retry_after = str(retry_after)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNGATED:
            await self.app(scope, receive, send)
            return
        phase = self.lifecycle.phase
        if phase is not Phase.SERVING:
            message = {
                Phase.STARTING: "The model is still loading; retry shortly.",
                Phase.DRAINING: "The server is shutting down; retry on another instance.",
            }.get(phase, "The server is not serving.")
            code = {Phase.STARTING: "service_starting", Phase.DRAINING: "service_draining"}.get(phase)
            await send_error(send, 503, message, code, {"Retry-After": self.retry_after})
            return
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()
