"""Log lines: the text or JSON format (``QWEN4EXP_LOG_FORMAT``) and the access log (``QWEN4EXP_ACCESS_LOG``).

One root handler (stderr) formats every logger of this process: ours, uvicorn's (no config of its
own) and anything that propagates. vLLM logs through its own ``vllm`` handler (stdout) in every
process it starts; in JSON mode the service hands vLLM a ``dictConfig`` file
(``VLLM_LOGGING_CONFIG_PATH``, written before vLLM is imported) that gives that handler, and the root
logger of vLLM's engine and worker processes, the same JSON formatter. Standard library only: no
import of vLLM here (the entry point configures logging before vLLM is imported).

The access log is an ASGI middleware, outermost, that writes one line per HTTP request when the
response has ended (the whole stream for SSE): method, path without the query string (only the
names of its parameters), status, duration, body bytes sent, client address and the client's
``X-Request-Id`` (the id vLLM gives the engine request, so it matches vLLM's own lines and the trace).
No header other than ``X-Request-Id`` is read: an API key never reaches the line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGER = "service.access"
# Routine answers of the routes probes and scrapers poll every few seconds (kubelet, the router's
# /get_load, Prometheus) are logged at debug; their errors (a 401 on /metrics, a 503) at info.
PROBE_PATHS = frozenset({"/health", "/ready", "/get_load", "/metrics"})
MAX_PATH_CHARS = 256
MAX_QUERY_NAMES = 16
MAX_REQUEST_ID_CHARS = 128
# The LogRecord attributes every record has; anything else came through ``extra`` and is a field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (UTC, ISO 8601), level, logger, message, the
    process (and vLLM's process name where vLLM set one), fields given through ``extra``, and the
    traceback of an exception as one string."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        process_name = getattr(record, "vllm_process_name", None)
        if process_name:
            out["process_name"] = process_name
        for key, value in vars(record).items():
            if (
                key not in _RECORD_ATTRS
                and key not in out
                and not key.startswith("_")
                and key != "vllm_process_name"
            ):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def formatter(log_format: str) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def configure(level: str, log_format: str) -> None:
    """This process's logging: one stderr handler on the root logger, in the chosen format. Access
    lines are info records of their own logger, written whatever ``QWEN4EXP_LOG_LEVEL`` is (their
    switch is ``QWEN4EXP_ACCESS_LOG``, which adds the middleware or not)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    access = logging.getLogger(ACCESS_LOGGER)
    access.setLevel(logging.DEBUG if level == "debug" else logging.INFO)
    if log_format == "json":
        logging.captureWarnings(True)  # Python warnings as records of "py.warnings", not bare stderr text


def vllm_logging_config(level: str) -> dict[str, Any]:
    """vLLM's default ``dictConfig`` (``vllm.logger.DEFAULT_LOGGING_CONFIG``: a stdout handler on the
    ``vllm`` logger, not propagating) with our JSON formatter, plus a JSON root handler for the
    engine and worker processes, whose root logger nothing else configures."""
    vllm_level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    stream = os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stdout")
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "level": vllm_level,
                "stream": stream,
            },
            "root": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"},
        },
        "loggers": {"vllm": {"handlers": ["vllm"], "level": vllm_level, "propagate": False}},
        "root": {"handlers": ["root"], "level": level.upper()},
    }


def write_vllm_logging_config(level: str) -> str:
    """Write :func:`vllm_logging_config` to a private file and return its path (the caller removes it)."""
    fd, path = tempfile.mkstemp(prefix="qwen4exp-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(vllm_logging_config(level), f)
    return path


def _printable(raw: bytes, limit: int) -> str:
    """ASCII 0x21-0x7e kept, every other byte %-escaped (no space, quote or newline can forge a line)."""
    text = "".join(chr(b) if 0x21 <= b <= 0x7E and b not in (0x22, 0x5C) else f"%{b:02X}" for b in raw)
    return text if len(text) <= limit else text[:limit] + "..."


def query_names(query_string: bytes) -> str:
    """The names of the query's ``name=value`` parameters; never a value (a key sent as ``?key=...``)."""
    names = []
    for part in query_string.split(b"&"):
        name, eq, _ = part.partition(b"=")
        if eq and name:
            names.append(_printable(name, 64))
    if len(names) > MAX_QUERY_NAMES:
        names = names[:MAX_QUERY_NAMES] + ["..."]
    return ",".join(names)


def request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            return _printable(value, MAX_REQUEST_ID_CHARS) or None
    return None


class AccessLog:
    """One ``service.access`` line per HTTP request, written once the response has ended."""

    def __init__(self, app: ASGIApp, logger: logging.Logger | None = None) -> None:
        self.app = app
        self.log = logger or logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None
        sent = 0
        complete = False

        async def wrapped(message: Message) -> None:
            nonlocal status, sent, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
                complete = complete or not message.get("more_body", False)
            await send(message)

        raised = False
        try:
            await self.app(scope, receive, wrapped)
        except BaseException:
            raised = True
            raise
        finally:
            # No answer: 500 if the app raised, else the client left first (499, as nginx and the metrics say).
            self._write(
                scope, status or (500 if raised else 499), started, sent, status is not None and not complete
            )

    def _write(self, scope: Scope, status: int, started: float, sent: int, incomplete: bool) -> None:
        path = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
        fields: dict[str, Any] = {
            "method": _printable(scope["method"].encode("latin-1", "replace"), 16),
            "path": _printable(path, MAX_PATH_CHARS),
            "status": status,
            "duration_ms": round((time.perf_counter() - started) * 1000, 1),
            "bytes": sent,
            "client": scope["client"][0] if scope.get("client") else None,
            "request_id": request_id(scope),
        }
        if query := query_names(scope.get("query_string", b"")):
            fields["query"] = query
        if incomplete:
            fields["incomplete"] = True  # the stream ended before its last chunk (client gone, shutdown)
        level = logging.DEBUG if fields["path"] in PROBE_PATHS and status < 400 else logging.INFO
        if not self.log.isEnabledFor(level):
            return
        text = " ".join(
            f"{k}={'-' if v is None else v}" for k, v in fields.items() if k not in ("method", "path")
        )
        self.log.log(level, "%s %s %s", fields["method"], fields["path"], text, extra=fields)
