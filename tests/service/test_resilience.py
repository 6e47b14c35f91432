"""One request must not take the engine down; a busy engine stays ready; a broken one exits.

Runs its own server with fault injection (``model.runtime.engine_guard``): a step whose input holds token
``FAULT`` raises inside the model, as a layer bug would; token ``FATAL`` raises a simulated CUDA
error. The server also has a short readiness age, a 1 s probe timeout and 8 engine slots, so a
readiness that needed a fresh probe generation would go red behind 32 long streams.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from .conftest import KEY, Server, error_of, start_server

FAULT, FATAL = 509, 510
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory) -> Server:
    srv = start_server(
        tmp_path_factory.mktemp("fault"),
        "fault",
        QWEN4EXP_FAULT_INJECT_TOKEN=str(FAULT),
        QWEN4EXP_FAULT_INJECT_FATAL_TOKEN=str(FATAL),
        QWEN4EXP_READY_MAX_AGE_SECONDS="1",
        QWEN4EXP_READY_TIMEOUT_SECONDS="1",
        QWEN4EXP_MAX_NUM_SEQS="8",
        QWEN4EXP_MAX_MODEL_LEN="2048",
    )
    yield srv
    srv.stop()


def complete(server: Server, prompt, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(server.url + COMPLETIONS, headers=server.auth, json=body, timeout=120)


def test_one_token_prompt_then_a_normal_request(fault_server: Server) -> None:
    """The readiness probe's shape, from a client: a 1-token prompt (ids and text), then more."""
    for prompt in ([5], "a"):
        r = complete(fault_server, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    r = complete(fault_server, "Once upon a time", max_tokens=8)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert fault_server.proc.poll() is None


def test_a_failing_request_gets_an_error_and_the_engine_goes_on(fault_server: Server) -> None:
    ids = httpx.post(
        fault_server.url + "/tokenize",
        headers=fault_server.auth,
        json={"model": "tiny", "prompt": "Hello there"},
    ).json()["tokens"]
    assert FAULT not in ids and FATAL not in ids
    for _ in range(4):  # bad requests one after another do not add up to a dead engine
        err = error_of(complete(fault_server, [5, FAULT, 7]), 500)
        assert err["message"]
        r = complete(fault_server, ids, max_tokens=6)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
    assert httpx.get(fault_server.url + "/health", timeout=10).status_code == 200
    assert "a model step failed" in fault_server.log()
    assert fault_server.proc.poll() is None


def test_a_failing_streamed_request_ends_its_stream_only(fault_server: Server) -> None:
    client = openai.OpenAI(base_url=fault_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model="tiny", prompt=[5, FAULT], max_tokens=8, stream=True):
            pass
    out = client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5
    assert fault_server.proc.poll() is None


def test_ready_stays_green_behind_32_long_streams(fault_server: Server) -> None:
    """32 streams on 8 engine slots, readiness age 1 s, probe timeout 1 s: only engine progress
    can keep ``/ready`` green (a probe generation would queue behind the streams and time out)."""
    client = openai.OpenAI(base_url=fault_server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    first_chunk = threading.Barrier(33, timeout=240)
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            chunks = client.completions.create(
                model="tiny",
                prompt=[5, 6, 7, 8],
                max_tokens=200,  # the last wave of 8 still streams for seconds after the barrier
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i, _ in enumerate(chunks):
                if i == 0:
                    first_chunk.wait()
        except BaseException as exc:  # reported below
            errors.append(exc)
            first_chunk.abort()

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(32)]
    for t in threads:
        t.start()
    ready: list[int] = []
    with httpx.Client(timeout=30) as http:
        first_chunk.wait()  # every stream has begun: 8 run, 24 wait for a slot
        while any(t.is_alive() for t in threads) and len(ready) < 200:
            ready.append(http.get(fault_server.url + "/ready").status_code)
            time.sleep(0.1)
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(ready) >= 10, "the streams ended before /ready could be watched"
    assert set(ready) == {200}, f"/ready went red under load: {ready}"


def test_an_unrecoverable_failure_exits_nonzero_and_says_why(fault_server: Server) -> None:
    """Last in this module: the server dies here."""
    r = complete(fault_server, [5, FATAL])
    assert r.status_code >= 500
    deadline = time.monotonic() + 60
    while fault_server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fault_server.proc.poll() == 1, fault_server.log()[-3000:]
    log = fault_server.log()
    assert "the engine died (engine core stopped after an unrecoverable failure" in log, log[-3000:]
    assert "CUDA error: injected fatal fault" in log
