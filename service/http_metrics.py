"""The front end's own Prometheus series (``qwen4exp_http_*``, ``qwen4exp_admission_*``,
``qwen4exp_service_*``) and the registry that ``/metrics`` serves.

Import only after ``PROMETHEUS_MULTIPROC_DIR`` is set (see ``prometheus_dir``): these objects then
write to the shared directory like vLLM's and the workers' metrics, and one
``MultiProcessCollector`` exposes all of them together.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model.runtime.metrics import PREFIX

REQUESTS = Counter(
    PREFIX + "http_requests_total",
    "HTTP requests answered, by method, route template and status code (499: the client left "
    "before an answer).",
    ("method", "route", "status"),
)
LATENCY = Histogram(
    PREFIX + "http_request_duration_seconds",
    "Time from request start to the last byte of the response (whole stream for SSE), by route.",
    ("method", "route"),
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
IN_PROGRESS = Gauge(
    PREFIX + "http_requests_in_progress",
    "HTTP requests being answered, by route.",
    ("route",),
    multiprocess_mode="livesum",
)
ADMISSION_RUNNING = Gauge(
    PREFIX + "admission_running",
    "Generation requests admitted to the engine (at most QWEN4EXP_MAX_CONCURRENT_REQUESTS).",
    multiprocess_mode="livesum",
)
ADMISSION_QUEUED = Gauge(
    PREFIX + "admission_queued",
    "Generation requests waiting for an engine slot (at most QWEN4EXP_MAX_QUEUED_REQUESTS).",
    multiprocess_mode="livesum",
)
TIMEOUTS = Counter(
    PREFIX + "request_timeouts_total",
    "Requests ended by a time limit: limit=body (QWEN4EXP_BODY_TIMEOUT_SECONDS, a trickled body) or "
    "limit=request (QWEN4EXP_REQUEST_TIMEOUT_SECONDS, e.g. a stream read too slowly).",
    ("limit",),
)
SERVICE_READY = Gauge(
    PREFIX + "service_ready",
    "1 while /ready answers 200 (engine loaded and a recent 1-token generation succeeded).",
    multiprocess_mode="livemax",
)
SERVICE_INFO = Gauge(
    PREFIX + "service_info",
    "Constant 1, labelled with what this process serves, on which device, and which Qwen4-Exp "
    "implementation (model_impl: ours, or upstream = vLLM's own with our 3090 parts).",
    ("served_model_name", "device", "tensor_parallel_size", "vllm_version", "model_impl"),
    multiprocess_mode="livemax",
)


def registry() -> CollectorRegistry:
    """A registry reading every process's samples from the multiprocess directory."""
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    return reg


class HttpMetricsMiddleware:
    """Count and time every HTTP request; the route label is the matched template or ``other``."""

    def __init__(self, app: ASGIApp, routes: frozenset[str]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        method = scope["method"]
        status = 500  # if the app raises before answering
        started = time.perf_counter()
        answered = False

        async def wrapped(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
            await send(message)

        IN_PROGRESS.labels(route).inc()
        try:
            await self.app(scope, receive, wrapped)
            if not answered:  # the client left before an answer (nginx's 499), not a server error
                status = 499
        finally:
            IN_PROGRESS.labels(route).dec()
            LATENCY.labels(method, route).observe(time.perf_counter() - started)
            REQUESTS.labels(method, route, str(status)).inc()
