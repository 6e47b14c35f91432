"""Adversarial bodies against the OpenAI routes: never a 5xx, always an OpenAI-shaped answer,
and the engine still serves afterwards (bodies from ``fuzz_bodies``, derandomized for CI)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from .conftest import Server, error_of
from .fuzz_bodies import EDGE_CASES, chat_bodies, completion_bodies

EXAMPLES = 60  # per route; with the edge cases ~150 requests
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
seen: dict[str, list[int]] = {}


def post(server: Server, path: str, body: dict) -> int:
    """Send one body; assert it is answered without a 5xx and in the OpenAI shape; the status."""
    with httpx.Client(timeout=120) as client:
        # ASCII-escaped JSON, so lone surrogates travel as the "\\ud83d" escapes a client may send.
        content = json.dumps(body)
        headers = {**server.auth, "Content-Type": "application/json"}
        with client.stream("POST", server.url + path, headers=headers, content=content) as r:
            r.read()
    assert r.status_code < 500, f"{r.status_code} for {json.dumps(body)[:400]}: {r.text[:400]}"
    if r.status_code >= 400:
        error_of(r, r.status_code)
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json()["choices"], r.text[:300]
    seen.setdefault(path, []).append(r.status_code)
    return r.status_code


@pytest.mark.parametrize("path,body", EDGE_CASES, ids=[f"{i}" for i in range(len(EDGE_CASES))])
def test_edge_case_bodies(server: Server, path: str, body: dict) -> None:
    post(server, path, body)


@FUZZ
@given(body=completion_bodies())
def test_fuzzed_completions(server: Server, body: dict) -> None:
    post(server, "/v1/completions", body)


@FUZZ
@given(body=chat_bodies())
def test_fuzzed_chat_completions(server: Server, body: dict) -> None:
    post(server, "/v1/chat/completions", body)


def test_engine_alive_after_the_fuzzing(server: Server) -> None:
    total = sum(len(v) for v in seen.values())
    assert total >= len(EDGE_CASES), seen
    started = time.monotonic()
    r = httpx.post(
        server.url + "/v1/completions",
        headers=server.auth,
        json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    assert server.proc.poll() is None
    print(
        f"fuzz: {total} requests, statuses {{{', '.join(f'{k}: {sorted(set(v))}' for k, v in seen.items())}}}; "
        f"a normal request afterwards answered in {time.monotonic() - started:.2f} s"
    )


def test_a_body_that_crashes_vllms_validator_is_a_400(server: Server) -> None:
    """Found by the fuzzing: vLLM's CompletionRequest validator raises AttributeError on this."""
    r = httpx.post(
        server.url + "/v1/completions",
        headers=server.auth,
        json={"model": "tiny", "prompt": "hi", "structured_outputs": False},
        timeout=30,
    )
    err = error_of(r, 400)
    assert err["code"] == "invalid_request" and "AttributeError" in err["message"], err
