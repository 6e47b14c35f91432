"""Access log, log format and OpenTelemetry traces.

One real service (``observed_server``, module-scoped): JSON log format, access log on (the default)
and ``QWEN4EXP_OTLP_TRACES_ENDPOINT`` pointed at a stub OTLP/HTTP collector on loopback, so the
same start shows the access lines (a normal request, a 401, a stream logged once it ends), that
every line of the service and of vLLM's processes is JSON without the bearer key, and what vLLM's
CPU build sends to the collector. The text format, the argument builder and the start-up checks
are checked without an engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from service import engine, logs
from service import settings as settings_mod
from service.settings import ServiceSettings, SettingsError
from tests.conftest import ensure_checkpoint

from .conftest import FILE_KEY, KEY, Server, service_env, sse_events, start_server
from .test_config import assert_config_error, run_service

WRONG_KEY = "sk-wrong-key-that-must-not-be-logged"


class Collector:
    """A stub OTLP/HTTP collector: keeps the body of every POST to /v1/traces."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/traces"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def spans(self) -> list:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out = []
        for body in list(self.bodies):
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    out += list(scope_spans.spans)
        return out


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.httpd.shutdown()


@pytest.fixture(scope="module")
def observed_server(tmp_path_factory, collector: Collector) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("observed"),
        "observed",
        QWEN4EXP_LOG_FORMAT="json",
        QWEN4EXP_OTLP_TRACES_ENDPOINT=collector.url,
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
        OTEL_BSP_SCHEDULE_DELAY="200",  # export spans within 0.2 s instead of 5 s
        OTEL_SERVICE_NAME="qwen4exp-test",
    )
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


# What vLLM's engine-core and worker processes print before vLLM applies its logging configuration
# there (it arrives with the engine config), and torch's C++ warnings: not Python log records, so
# not JSON. Everything else is.
NOT_LOG_RECORDS = (
    re.compile(r"Triton is installed, but doesn't include CPU backend\. Disabling Triton\.$"),
    re.compile(r"\S+\.py:\d+: \w*Warning: "),  # a Python warning in a spawned process, then its source line
    re.compile(r"  \S"),
    re.compile(r"\[W\d{4} [\d:.]+ \w+\.cpp:\d+\] Warning: "),
)


def json_lines(server: Server) -> list[dict]:
    """Every log record of the service's output (stdout and stderr), each line parsed as one JSON
    object; fails on any other line but the few :data:`NOT_LOG_RECORDS`."""
    out = []
    for line in server.log().splitlines():
        if not line.strip() or any(p.match(line) for p in NOT_LOG_RECORDS):
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON log line: {line!r}")
    return out


def access_line(server: Server, request_id: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = [
            r
            for r in json_lines(server)
            if r["logger"] == "service.access" and r.get("request_id") == request_id
        ]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, (request_id, found)
            return found[0]
        time.sleep(0.1)


def test_access_lines_for_a_request_a_401_and_a_stream(observed_server: Server) -> None:
    url = observed_server.url
    ok_id, denied_id, stream_id = (f"test-{uuid.uuid4().hex[:12]}" for _ in range(3))
    r = httpx.post(
        url + "/v1/completions",
        headers={**observed_server.auth, "X-Request-Id": ok_id},
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    line = access_line(observed_server, ok_id)
    assert line["level"] == "INFO"
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/completions", 200)
    assert line["bytes"] == len(r.content) and line["client"] == "127.0.0.1"
    assert isinstance(line["duration_ms"], float) and line["duration_ms"] > 0

    r = httpx.get(
        url + "/v1/models?api_key=" + WRONG_KEY,
        headers={"Authorization": f"Bearer {WRONG_KEY}", "X-Request-Id": denied_id},
        timeout=10,
    )
    assert r.status_code == 401
    line = access_line(observed_server, denied_id)
    assert (line["level"], line["path"], line["status"], line["query"]) == (
        "INFO",
        "/v1/models",
        401,
        "api_key",
    )

    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 300,
        "ignore_eos": True,  # a stream of a few seconds: still open when the first chunk is read
        "stream": True,
    }
    headers = {**observed_server.auth, "X-Request-Id": stream_id}
    with httpx.stream("POST", url + "/v1/chat/completions", headers=headers, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        opened = time.monotonic()
        time.sleep(0.3)  # the line of a stream still open must not be there
        assert not [x for x in json_lines(observed_server) if x.get("request_id") == stream_id]
        rest = list(lines)
        streamed_ms = (time.monotonic() - opened) * 1000
    events = sse_events([first, *rest])
    assert events[-1] == "[DONE]"
    line = access_line(observed_server, stream_id)
    assert (line["path"], line["status"], line["level"]) == ("/v1/chat/completions", 200, "INFO")
    assert line["bytes"] > 0 and "incomplete" not in line
    assert line["duration_ms"] >= streamed_ms  # timed to the stream's end


def test_every_line_is_json_without_a_key(observed_server: Server) -> None:
    records = json_lines(observed_server)  # fails on the first line that is not one JSON object
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    loggers = {r["logger"] for r in records}
    assert {"service", "service.access", "uvicorn.error"} <= loggers, loggers
    assert any(name.startswith("vllm") for name in loggers), loggers
    # vLLM's engine-core process logs in the same format (the dictConfig it was handed).
    assert any(r.get("process_name", "").startswith("EngineCore") for r in records), loggers
    text = observed_server.log()
    for secret in (KEY, FILE_KEY, WRONG_KEY):
        assert secret not in text


def test_probe_polls_are_quiet_and_their_errors_are_not(observed_server: Server) -> None:
    ids = [f"probe-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    assert httpx.get(observed_server.url + "/health", headers={"X-Request-Id": ids[0]}).status_code == 200
    assert httpx.get(observed_server.url + "/metrics", headers={"X-Request-Id": ids[1]}).status_code == 401
    line = access_line(observed_server, ids[1])
    assert (line["path"], line["status"], line["level"]) == ("/metrics", 401, "INFO")
    assert not [r for r in json_lines(observed_server) if r.get("request_id") == ids[0]]


def test_vllm_sends_request_spans_to_the_collector(observed_server: Server, collector: Collector) -> None:
    import opentelemetry.proto  # noqa: F401 - vLLM's tracing needs it; missing is a failure, not a skip

    trace_id = uuid.uuid4().hex
    request_id = f"traced-{uuid.uuid4().hex[:12]}"
    r = httpx.post(
        observed_server.url + "/v1/completions",
        headers={
            **observed_server.auth,
            "X-Request-Id": request_id,
            "traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01",
        },
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 15
    while True:
        spans = collector.spans()
        mine = [s for s in spans if s.name == "llm_request" and s.trace_id.hex() == trace_id]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert mine, sorted({s.name for s in spans})
    attributes = {a.key: a.value for a in mine[0].attributes}
    assert request_id in attributes["gen_ai.request.id"].string_value
    assert attributes["gen_ai.usage.completion_tokens"].int_value == 4
    # The engine's start-up spans, from the engine-core and worker processes.
    assert {"Loading (CPU)"} <= {s.name for s in spans}, sorted({s.name for s in spans})


# --- without an engine -------------------------------------------------------------------------


def settings(monkeypatch, **env: str) -> ServiceSettings:
    for name in ("ENGINE_ARGS", "OTLP_TRACES_ENDPOINT", "LOG_FORMAT", "ACCESS_LOG"):
        monkeypatch.delenv(f"QWEN4EXP_{name}", raising=False)
    monkeypatch.setenv("QWEN4EXP_MODEL", str(ensure_checkpoint("tiny")))
    for name, value in env.items():
        monkeypatch.setenv(f"QWEN4EXP_{name}", value)
    return ServiceSettings()  # type: ignore[call-arg]


def test_the_otlp_endpoint_reaches_vllms_engine_args(monkeypatch) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    assert "--otlp-traces-endpoint" not in engine.cli_args(settings(monkeypatch), "cpu")
    s = settings(monkeypatch, OTLP_TRACES_ENDPOINT="https://otel.example:4317")
    argv = engine.cli_args(s, "cpu")
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "https://otel.example:4317"
    args = engine.parse_args(argv)
    assert AsyncEngineArgs.from_cli_args(args).otlp_traces_endpoint == "https://otel.example:4317"
    # --collect-detailed-traces stays an engine flag; the endpoint is the service's.
    s = settings(monkeypatch, ENGINE_ARGS="--otlp-traces-endpoint http://x:4317")
    with pytest.raises(SettingsError, match="use QWEN4EXP_OTLP_TRACES_ENDPOINT"):
        engine.cli_args(s, "cpu")
    s = settings(
        monkeypatch, OTLP_TRACES_ENDPOINT="http://x:4317", ENGINE_ARGS="--collect-detailed-traces all"
    )
    assert engine.parse_args(engine.cli_args(s, "cpu")).collect_detailed_traces == ["all"]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("otel-collector:4317", "is not http or https"),
        ("grpc://otel:4317", "is not http or https"),
        ("http://", "no host"),
        ("http://otel:99999", "the port"),
        ("http://user:secret@otel:4317", "credentials"),
        ("http://otel:4318/v1/traces?token=abc", "query string"),
        ("http://otel :4317", "whitespace"),
    ],
)
def test_a_malformed_otlp_endpoint_is_refused(value: str, said: str) -> None:
    with pytest.raises(SettingsError, match=said) as exc:
        settings_mod.field_value("otlp_traces_endpoint", {"QWEN4EXP_OTLP_TRACES_ENDPOINT": value})
    assert "fix:" in str(exc.value) and "OTEL_EXPORTER_OTLP_HEADERS" in str(exc.value)
    good = "http://otel-collector.observability:4318/v1/traces"
    assert settings_mod.field_value("otlp_traces_endpoint", {"QWEN4EXP_OTLP_TRACES_ENDPOINT": good}) == good


def test_start_up_stops_on_a_bad_endpoint_or_protocol(tmp_path: Path) -> None:
    model = str(ensure_checkpoint("tiny"))
    proc = run_service(
        service_env(
            QWEN4EXP_MODEL=model,
            QWEN4EXP_OTLP_TRACES_ENDPOINT="otel-collector:4317",
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/json",
            QWEN4EXP_LOG_FORMAT="yaml",
        )
    )
    err = assert_config_error(proc, "QWEN4EXP_OTLP_TRACES_ENDPOINT", "QWEN4EXP_LOG_FORMAT")
    assert not [x for x in err.splitlines() if x.startswith("OTEL_")]  # no valid endpoint: not checked
    proc = run_service(
        service_env(
            QWEN4EXP_MODEL=model,
            QWEN4EXP_OTLP_TRACES_ENDPOINT="http://127.0.0.1:4318/v1/traces",
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/json",
        )
    )
    assert_config_error(proc, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


def test_missing_opentelemetry_packages_fail_closed(monkeypatch) -> None:
    from vllm.tracing import otel

    s = settings(monkeypatch, OTLP_TRACES_ENDPOINT="http://otel:4317")
    assert engine.tracing_problem(s) is None
    monkeypatch.setattr(otel, "_IS_OTEL_AVAILABLE", False)
    monkeypatch.setattr(
        otel,
        "otel_import_error_traceback",
        "Traceback...\nModuleNotFoundError: No module named 'opentelemetry'",
    )
    problem = engine.tracing_problem(s)
    assert problem is not None and problem.startswith("QWEN4EXP_OTLP_TRACES_ENDPOINT='http://otel:4317'")
    assert "No module named 'opentelemetry'" in problem and "fix: install opentelemetry-sdk" in problem
    assert engine.tracing_problem(settings(monkeypatch)) is None  # no endpoint: not needed


def _asgi_app() -> Starlette:
    async def ok(request):
        return JSONResponse({"ok": True})

    async def stream(request):
        async def chunks():
            for _ in range(3):
                await asyncio.sleep(0.05)
                yield b"data: {}\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/ok", ok), Route("/v1/stream", stream), Route("/health", ok)])


def test_text_access_lines(caplog) -> None:
    app = logs.AccessLog(_asgi_app())
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 5555))

    async def calls() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "abc\n123"}
            await client.get("/v1/ok?api_key=" + KEY + "&n=2&" + KEY, headers=headers)
            await client.get("/v1/stream")
            await client.get("/health")
            await client.get("/v1/nope%0A%20fake")

    caplog.set_level(logging.INFO, logger=logs.ACCESS_LOGGER)
    asyncio.run(calls())
    formatter = logs.formatter("text")
    text = [formatter.format(r) for r in caplog.records if r.name == logs.ACCESS_LOGGER]
    assert len(text) == 3, text  # /health's 200 is at debug
    assert text[0].endswith(
        f"INFO service.access: GET /v1/ok status=200 duration_ms={caplog.records[0].duration_ms} bytes=11 "
        "client=10.1.2.3 request_id=abc%0A123 query=api_key,n"
    )
    assert " GET /v1/stream status=200 " in text[1] and " bytes=30 " in text[1]
    assert caplog.records[1].duration_ms >= 150  # logged when the stream ended, not when it started
    assert " GET /v1/nope%0A%20fake status=404 " in text[2]  # no forged line
    assert all(KEY not in line and "\n" not in line for line in text)
    record = json.loads(logs.formatter("json").format(caplog.records[0]))
    assert (record["status"], record["path"], record["query"]) == (200, "/v1/ok", "api_key,n")


def test_a_stream_the_client_leaves_is_logged_incomplete(caplog) -> None:
    async def endless(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise asyncio.CancelledError  # what the server does to a handler whose client is gone

    caplog.set_level(logging.INFO, logger=logs.ACCESS_LOGGER)
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/s",
        "raw_path": b"/v1/s",
        "headers": [],
        "client": None,
    }

    async def noop(message) -> None:
        pass

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(logs.AccessLog(endless)(scope, None, noop))
    (record,) = caplog.records
    assert (record.status, record.bytes, record.incomplete) == (200, 9, True)
