"""The ASGI application: vLLM's OpenAI routes and handlers, plus our probes, metrics and guards.

vLLM's routers and exception handlers are reused as they are (chat completions with SSE and
usage, completions, the Responses API, Anthropic's Messages API, models, tokenize/detokenize); their handler objects are attached to
``app.state`` by vLLM's ``init_app_state`` once the engine is up. We add only what vLLM lacks:
``/health``, ``/ready``, a multiprocess ``/metrics``, and the middlewares in ``guards``,
``lifecycle``, ``errors`` and ``http_metrics``.
"""

from __future__ import annotations

import asyncio
import logging
from argparse import Namespace
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp
from vllm.entrypoints.anthropic.api_router import router as messages_router
from vllm.entrypoints.openai.chat_completion.api_router import router as chat_router
from vllm.entrypoints.openai.completion.api_router import router as completion_router
from vllm.entrypoints.openai.models.api_router import router as models_router
from vllm.entrypoints.openai.responses.api_router import router as responses_router
from vllm.entrypoints.scale_out.render.api_router import router as render_router
from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
from vllm.entrypoints.serve.tokenize.api_router import router as tokenize_router

from . import http_metrics
from .body_check import BodyValidation
from .context_limit import ContextLimitMessage
from .engine import generate_one_token
from .errors import ErrorShapeMiddleware, error_body
from .guards import Admission, ApiKeys, BearerAuth, BodyLimit
from .lifecycle import Lifecycle, LifecycleGate, Phase
from .logs import AccessLog
from .request_caps import RequestCaps
from .settings import ServiceSettings, read_keys_file
from .time_limits import BodyTimeout, RequestDeadline

log = logging.getLogger("service.app")

# The vLLM routes we expose; its routers also carry batch/experimental routes we leave out.
VLLM_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        # Prompt -> token ids as the engine would see them: vllm-router's cache-aware policy asks
        # for these (falling back to /tokenize) to route by prefix.
        "/v1/chat/completions/render",
        "/v1/completions/render",
        # OpenAI's Responses API (stored responses are kept by vLLM in this process's memory).
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        # Anthropic's Messages API, for clients written against it.
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)
GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
OWN_ROUTES = frozenset({"/health", "/ready", "/metrics", "/get_load"})


class ReadyProbe:
    """Answers "did the engine show recently that it works?", probing only when it did not.

    Fresh means: a generation finished (``Admission`` records real requests) or an engine step
    processed tokens (``engine.ProgressStatLogger``) within ``max_age``. A busy server whose
    requests are all long streams is therefore ready without a probe, which would otherwise
    queue behind them. Only an idle server runs the 1-token probe generation; concurrent
    ``/ready`` calls share one.
    """

    def __init__(self, lifecycle: Lifecycle, max_age: float, timeout: float) -> None:
        self.lifecycle = lifecycle
        self.max_age = max_age
        self.timeout = timeout
        self.engine: Any = None
        self._lock = asyncio.Lock()
        self.last_error: str | None = None

    def fresh(self) -> bool:
        age = self.lifecycle.freshness_age()
        return age is not None and age <= self.max_age

    async def check(self) -> bool:
        if self.fresh():
            return True
        async with self._lock:
            if self.fresh():
                return True
            try:
                await generate_one_token(self.engine, self.timeout)
            except Exception as exc:  # any failure means "not ready"; the reason goes to the body
                self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.warning("readiness probe failed: %s", self.last_error)
                return False
            self.last_error = None
            self.lifecycle.generation_succeeded()
            return True


def engine_max_len(app: FastAPI) -> int | None:
    """The engine's context length (``init_app_state`` stores vLLM's config once the engine is up)."""
    config = getattr(app.state, "vllm_config", None)
    return None if config is None else config.model_config.max_model_len


def _unavailable(message: str, code: str, retry_after: int) -> JSONResponse:
    return JSONResponse(error_body(503, message, code), 503, headers={"Retry-After": str(retry_after)})


def build_app(
    settings: ServiceSettings, args: Namespace, lifecycle: Lifecycle, device: str
) -> tuple[FastAPI, ASGIApp]:
    """Return the FastAPI app (its ``state`` receives the engine) and the ASGI app to serve."""
    app = FastAPI(title="qwen4exp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.args = args  # vLLM's handlers read e.g. args.log_error_stack
    app.state.engine_client = None
    app.state.lifecycle = lifecycle
    app.state.device = device
    probe = ReadyProbe(lifecycle, settings.ready_max_age_seconds, settings.ready_timeout_seconds)
    app.state.ready_probe = probe
    registry = http_metrics.registry()

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the process answers and the engine (once started) is not dead."""
        engine = app.state.engine_client
        if engine is not None and engine.errored:
            return _unavailable("The engine is dead; the process will exit.", "engine_dead", 5)
        return JSONResponse({"status": lifecycle.phase.value, "device": device})

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the model is loaded and a 1-token generation succeeded recently."""
        if lifecycle.phase is not Phase.SERVING:
            http_metrics.SERVICE_READY.set(0)
            code = "service_draining" if lifecycle.phase is Phase.DRAINING else "service_starting"
            return _unavailable(f"Not ready: {lifecycle.phase.value}.", code, settings.retry_after_seconds)
        probe.engine = app.state.engine_client
        if not await probe.check():
            http_metrics.SERVICE_READY.set(0)
            # The probe's exception is logged, not answered: /ready is open to anyone who reaches the
            # port, and an engine's exception text can carry paths, shapes and internal state.
            return _unavailable(
                "Not ready: the probe generation failed (the reason is in the service's log).",
                "probe_failed",
                settings.retry_after_seconds,
            )
        http_metrics.SERVICE_READY.set(1)
        return JSONResponse(
            {
                "status": "ready",
                "model": settings.model_name,
                "last_generation_age_seconds": round(lifecycle.generation_age() or 0.0, 3),
                "last_progress_age_seconds": round(lifecycle.freshness_age() or 0.0, 3),
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_load")
    async def get_load() -> Response:
        """Requests in flight here, in the shape vllm-router's power_of_two policy polls
        (``{"load": n}``, fetched without a key, like the health checks)."""
        return JSONResponse({"load": lifecycle.inflight})

    routers = (models_router, chat_router, completion_router, tokenize_router, render_router,
               responses_router, messages_router)  # fmt: skip
    for router in routers:
        for route in router.routes:
            if getattr(route, "path", None) in VLLM_ROUTES:
                app.router.routes.append(route)
    init_exception_handler(app)

    # add_middleware: the last added runs first. Order of a request: auth, phase gate, body
    # time limit, body limit, body validation, context-limit message, request caps (which weigh the
    # request for admission), admission, request deadline, route.
    app.add_middleware(RequestDeadline, paths=GENERATION_ROUTES, seconds=settings.request_timeout_seconds)
    app.add_middleware(
        Admission,
        paths=GENERATION_ROUTES,
        max_running=settings.max_concurrent_requests,
        max_queued=settings.max_queued_requests,
        retry_after=settings.retry_after_seconds,
        lifecycle=lifecycle,
    )
    app.add_middleware(RequestCaps, settings=settings, paths=GENERATION_ROUTES)
    app.add_middleware(
        ContextLimitMessage, paths=GENERATION_ROUTES, max_model_len=lambda: engine_max_len(app)
    )
    app.add_middleware(BodyValidation)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BodyTimeout, seconds=settings.body_timeout_seconds)
    app.add_middleware(LifecycleGate, lifecycle=lifecycle, retry_after=settings.retry_after_seconds)
    if settings.auth_configured:  # settings.load() refused a configured source without any key
        keys = ApiKeys(settings.variable_keys(), settings.api_keys_file, read_keys_file)
        open_paths = frozenset(
            {"/health", "/ready", "/get_load"} | ({"/metrics"} if settings.metrics_open else set())
        )
        app.add_middleware(BearerAuth, keys=keys, open_paths=open_paths)
    else:
        log.warning("no API key configured (QWEN4EXP_API_KEYS / QWEN4EXP_API_KEYS_FILE): auth is OFF")

    # Outside FastAPI's own error middleware, so its 500s are reshaped and counted too.
    asgi: ASGIApp = http_metrics.HttpMetricsMiddleware(
        ErrorShapeMiddleware(app), routes=VLLM_ROUTES | OWN_ROUTES
    )
    if settings.access_log:  # outermost: the status, bytes and time the client got
        asgi = AccessLog(asgi)
    return app, asgi
