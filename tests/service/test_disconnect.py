"""A client that disconnects mid-stream aborts its engine request."""

from __future__ import annotations

import time

import httpx

from .conftest import Server

LONG = 2000  # tokens; ~45 s of generation here if it were not aborted


def test_disconnect_mid_stream_aborts_the_engine_request(server: Server) -> None:
    assert server.wait_engine_idle() == (0, 0)
    generated_before = server.gauge("vllm:generation_tokens_total")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Talk."}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/chat/completions", headers=server.auth, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            data = [
                line for _, line in zip(range(20), (x for x in lines if x.startswith("data:")), strict=False)
            ]
            assert len(data) == 20
            assert server.gauge("vllm:num_requests_running") == 1  # still generating
            disconnected_at = time.monotonic()
    # The response is closed: the connection is gone mid-stream.
    assert server.wait_engine_idle(timeout=10) == (0, 0)
    took = time.monotonic() - disconnected_at
    assert took < 10, f"engine request ran {took:.1f} s after the disconnect"
    assert server.gauge("qwen4exp_admission_running") == 0
    generated = server.gauge("vllm:generation_tokens_total") - generated_before
    assert 20 <= generated < LONG / 4, generated  # stopped early, not run to max_tokens


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts_too(server: Server) -> None:
    assert server.wait_engine_idle() == (0, 0)
    generated_before = server.gauge("vllm:generation_tokens_total")
    body = {"model": "tiny", "prompt": "Go on.", "max_tokens": LONG, "ignore_eos": True}
    try:
        httpx.post(server.url + "/v1/completions", headers=server.auth, json=body, timeout=2.0)
        raise AssertionError("the request should not finish within 2 s")
    except httpx.ReadTimeout:
        pass  # the client gave up and closed the connection
    assert server.wait_engine_idle(timeout=10) == (0, 0)
    generated = server.gauge("vllm:generation_tokens_total") - generated_before
    assert generated < LONG / 4, generated
