"""Every error class is OpenAI-shaped with the right status, nothing answers 5xx, and nothing is
left running in the engine afterwards."""

from __future__ import annotations

import httpx
import pytest

from .conftest import FILE_KEY, Server, error_of

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def server_errors(server: Server) -> dict[tuple, float]:
    """5xx answers so far, by label set (the start-up phase's 503s are part of the baseline)."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for s in server.metrics()["qwen4exp_http_requests_total"]
        if s.labels["status"].startswith("5")
    }


@pytest.fixture(scope="module", autouse=True)
def errors_before(server: Server) -> dict[tuple, float]:
    return server_errors(server)


def post(server: Server, path: str, **kwargs) -> httpx.Response:
    headers = {**server.auth, **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, headers=headers, timeout=60, **kwargs)


BAD_REQUESTS = {
    "malformed json": (CHAT, b'{"model": "tiny", "messages": [', "invalid_json"),
    "not an object": (CHAT, b"[1, 2]", None),
    "messages wrong type": (CHAT, {"model": "tiny", "messages": "hello"}, "invalid_parameter"),
    "max_tokens wrong type": (
        CHAT,
        {"model": "tiny", "messages": MSGS, "max_tokens": "ten"},
        "invalid_parameter",
    ),
    "negative max_tokens": (CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": -1}, "invalid_parameter"),
    "temperature out of range": (CHAT, {"model": "tiny", "messages": MSGS, "temperature": -2}, None),
    "missing messages": (CHAT, {"model": "tiny"}, None),
    "completion without prompt": ("/v1/completions", {"model": "tiny"}, None),
    "n zero": ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, None),
    "json nested too deeply": (
        CHAT,
        b'{"model": "tiny", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        None,
    ),
    "json nested too deeply, messages api": ("/v1/messages", b"[" * 5000 + b"]" * 5000, None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_invalid_parameters_are_400(server: Server, case: str) -> None:
    path, body, code = BAD_REQUESTS[case]
    r = (
        post(server, path, content=body, headers={"content-type": "application/json"})
        if isinstance(body, bytes)
        else post(server, path, json=body)
    )
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code, err


def test_over_long_prompt_is_400_context_length(server: Server) -> None:
    """The server runs with QWEN4EXP_MAX_MODEL_LEN=2048."""
    r = post(server, "/v1/completions", json={"model": "tiny", "prompt": "hello " * 2100, "max_tokens": 4})
    assert error_of(r, 400)["code"] == "context_length_exceeded"
    r = post(server, CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi " * 2100}]})
    assert error_of(r, 400)["code"] == "context_length_exceeded"


def test_unknown_fields_are_ignored_and_n_above_1_works(server: Server) -> None:
    """vLLM accepts unknown fields (newer OpenAI parameters) with a warning: 200, not 5xx."""
    r = post(
        server, CHAT, json={"model": "tiny", "messages": MSGS, "max_tokens": 2, "no_such_field": {"a": 1}}
    )
    assert r.status_code == 200, r.text
    r = post(server, CHAT, json={"model": "tiny", "messages": MSGS, "max_tokens": 2, "n": 3})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic dGVzdA=="}, {"Authorization": "Bearer"}],
    ids=["missing", "wrong key", "wrong scheme", "empty"],
)
@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/tokenize", CHAT, "/v1/unknown"])
def test_401_without_a_valid_key(server: Server, path: str, headers: dict) -> None:
    method = "GET" if path in ("/v1/models", "/metrics", "/v1/unknown") else "POST"
    r = httpx.request(method, server.url + path, headers=headers, json={"model": "tiny"}, timeout=10)
    err = error_of(r, 401)
    assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


def test_probes_need_no_key(server: Server) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "serving", "device": "cpu"}
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert (
        httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {FILE_KEY}"}).status_code == 200
    )


def test_404_unknown_model_and_route(server: Server) -> None:
    for path, body in (
        (CHAT, {"model": "gpt-9", "messages": MSGS}),
        ("/v1/completions", {"model": "x", "prompt": "y"}),
    ):
        err = error_of(post(server, path, json=body), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
    assert error_of(httpx.get(server.url + "/v1/nothing", headers=server.auth), 404)["code"] == "not_found"
    assert (
        error_of(httpx.delete(server.url + "/v1/models", headers=server.auth), 405)["code"]
        == "method_not_allowed"
    )


def test_413_body_too_large(server: Server) -> None:
    """The server runs with QWEN4EXP_MAX_BODY_BYTES=65536; declared and chunked bodies both count."""
    huge = {"model": "tiny", "prompt": "x" * 100_000}
    err = error_of(post(server, "/v1/completions", json=huge), 413)
    assert err["code"] == "request_too_large"

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}'

    err = error_of(
        post(server, "/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413
    )
    assert err["code"] == "request_too_large"
    # Just under the limit is fine (and then rejected by the context length, a 400, not 413).
    r = post(server, "/v1/completions", json={"model": "tiny", "prompt": "z " * 30_000, "max_tokens": 1})
    assert error_of(r, 400)["code"] == "context_length_exceeded"


def test_oversized_headers_are_refused_and_the_server_still_answers(server: Server) -> None:
    """Headers beyond QWEN4EXP_MAX_HEADER_BYTES (64 KiB) are not buffered: 400, connection closed."""
    with httpx.Client(timeout=30) as client:
        try:
            r = client.get(server.url + "/health", headers={"x-padding": "a" * (256 * 1024)})
            assert r.status_code == 400, r.text
        except httpx.TransportError:
            pass  # closed (or reset) before an answer: also refused
        assert client.get(server.url + "/health").status_code == 200


def test_no_5xx_and_engine_idle_after_the_errors(server: Server, errors_before: dict) -> None:
    assert server.wait_engine_idle() == (0, 0)
    statuses = {s.labels["status"] for s in server.metrics()["qwen4exp_http_requests_total"]}
    assert {"400", "401", "404", "405", "413"} <= statuses
    assert server_errors(server) == errors_before
