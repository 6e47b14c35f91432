"""Prompts at the context limit: served when they fit (vLLM shortens ``max_tokens`` to the room
left), refused with a 400 naming the limit when not even one output token fits (a prompt of
exactly ``max_model_len`` tokens included: ``service.context_limit``), and never a failure of the
engine, even many at once on a KV cache that holds only about two of them (chunked prefill,
requests waiting for blocks).

The burst runs on a server of its own with the pressure limits but the default request deadline:
how long eight full-context prefills take on a KV cache for two depends on the host's kernels
(several times longer on AVX2 CPUs than on AVX512-BF16 ones), and the package server's 6 s
deadline exists for the slow-client tests, not for this one.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.service.conftest import error_of

from .conftest import MAX_MODEL_LEN, MAX_QUEUED, MAX_RUNNING, counter, quiet, start_pressure_server

AT_ONCE = MAX_RUNNING + MAX_QUEUED


def complete(server, prompt, max_tokens: int | None = 4) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "temperature": 0}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return httpx.post(server.url + "/v1/completions", headers=server.auth, json=body, timeout=300)


def test_prompts_over_or_at_the_limit_get_a_400_naming_it(pressure_server, capsys) -> None:
    refused = {
        "one over": complete(pressure_server, [7] * (MAX_MODEL_LEN + 1)),
        "exactly at, max_tokens 4": complete(pressure_server, [7] * MAX_MODEL_LEN),
        "exactly at, no max_tokens": complete(pressure_server, [7] * MAX_MODEL_LEN, None),
    }
    # Prompt plus max_tokens over the limit: vLLM shortens max_tokens to the room left and serves.
    clamped = complete(pressure_server, [7] * (MAX_MODEL_LEN - 2), 4)
    assert clamped.status_code == 200, clamped.text
    assert clamped.json()["usage"]["completion_tokens"] == 2
    assert clamped.json()["choices"][0]["finish_reason"] == "length"
    chat = httpx.post(
        pressure_server.url + "/v1/chat/completions",
        headers=pressure_server.auth,
        json={"model": "tiny", "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4},
        timeout=300,
    )
    messages = {}
    for name, r in [*refused.items(), ("chat over", chat)]:
        err = error_of(r, 400)
        messages[name] = err["message"]
        assert str(MAX_MODEL_LEN) in err["message"], (name, err)
    for name in ("one over", "exactly at, max_tokens 4", "exactly at, no max_tokens", "chat over"):
        assert error_of(refused.get(name, chat), 400)["code"] == "context_length_exceeded", messages[name]
    explicit_zero = complete(pressure_server, [7] * 8, 0)  # a real max_tokens error keeps vLLM's words
    assert explicit_zero.status_code == 400 and "max_tokens" in explicit_zero.json()["error"]["message"]
    with capsys.disabled():
        print("\n[pressure] long prompts refused:")
        for name, text in messages.items():
            print(f"  {name}: {text[:150]}")
    assert httpx.get(pressure_server.url + "/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def patient_server(tmp_path_factory):
    """The pressure limits with the service's default request deadline (see the module docstring)."""
    srv = start_pressure_server(
        tmp_path_factory.mktemp("patient"), "patient", QWEN4EXP_REQUEST_TIMEOUT_SECONDS=None
    )
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


def test_many_prompts_at_the_limit_at_once_are_all_served(patient_server, capsys) -> None:
    pressure_server = patient_server
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 500) for _ in range(MAX_MODEL_LEN - 4)] for _ in range(AT_ONCE)]
    preempted_before = counter(pressure_server, "vllm:num_preemptions_total")
    with ThreadPoolExecutor(AT_ONCE) as pool:
        answers = list(pool.map(lambda p: complete(pressure_server, p, 4), prompts))
    statuses = [r.status_code for r in answers]
    preempted = counter(pressure_server, "vllm:num_preemptions_total") - preempted_before
    gauges = quiet(pressure_server)
    with capsys.disabled():
        print(
            f"\n[pressure] {AT_ONCE} prompts of {MAX_MODEL_LEN - 4} tokens at once on a KV cache for "
            f"about two: statuses {statuses}, {preempted:.0f} preemptions"
        )
    assert statuses == [200] * AT_ONCE, [r.text[:200] for r in answers if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in answers)
    assert set(gauges.values()) == {0}, gauges
    assert httpx.get(pressure_server.url + "/health", timeout=10).status_code == 200
