"""``/metrics``: vLLM's ``vllm:`` series, our HTTP series, and the model's series produced in the
worker processes (``qwen4exp_ple_table_bytes``), after some traffic."""

from __future__ import annotations

import httpx

from .conftest import Server


def test_metrics_after_traffic(server: Server) -> None:
    for _ in range(2):
        r = httpx.post(
            server.url + "/v1/completions",
            headers=server.auth,
            json={"model": "tiny", "prompt": "metrics", "max_tokens": 3},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    m = server.metrics()

    # vLLM's own engine metrics keep their names.
    assert m["vllm:num_requests_running"][0].labels["model_name"] == "tiny"
    assert sum(s.value for s in m["vllm:generation_tokens_total"]) >= 6
    assert "vllm:time_to_first_token_seconds_count" in m

    # HTTP metrics, labelled by route template, method and status.
    ok = [
        s
        for s in m["qwen4exp_http_requests_total"]
        if s.labels == {"method": "POST", "route": "/v1/completions", "status": "200"}
    ]
    assert ok and ok[0].value >= 2
    latency = [
        s for s in m["qwen4exp_http_request_duration_seconds_count"] if s.labels["route"] == "/v1/completions"
    ]
    assert latency and latency[0].value >= 2
    assert "qwen4exp_http_requests_in_progress" in m
    from service.app import OWN_ROUTES, VLLM_ROUTES

    # Only the routes the service serves label the series (a stray path would grow it without bound).
    assert {s.labels["route"] for s in m["qwen4exp_http_requests_total"]} <= VLLM_ROUTES | OWN_ROUTES | {
        "other"
    }
    info = m["qwen4exp_service_info"][0]
    assert info.labels["device"] == "cpu" and info.labels["served_model_name"] == "tiny"
    assert info.labels["model_impl"] == "ours"  # the only implementation on vLLM's CPU build
    assert m["qwen4exp_service_ready"][0].value == 1

    # The model's metrics, set inside the worker process, reach the API server's /metrics.
    ple = m["qwen4exp_ple_table_bytes"]
    assert ple, "no qwen4exp_ple_table_bytes series"
    assert {"layer", "rank", "storage"} <= set(ple[0].labels)
    assert {s.labels["rank"] for s in ple} == {"0"}
    assert all(s.value > 0 for s in ple)
    assert len({s.labels["layer"] for s in ple}) == 2  # the tiny model has PLE on two layers


def test_workers_inherit_a_fresh_multiprocess_dir(server: Server) -> None:
    dirs = set()
    for pid in server.children():
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        dirs |= {e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"PROMETHEUS_MULTIPROC_DIR=")}
    assert len(dirs) == 1, dirs
    assert "qwen4exp-prom-" in dirs.pop()
