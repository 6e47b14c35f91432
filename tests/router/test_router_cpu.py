"""Two ``tiny`` replicas of the real service behind vllm-router (the pinned PyPI wheel), on the CPU.

What is shown, with the real processes on loopback:
- cache-aware routing keeps every conversation on one replica (each request attributed by the
  replicas' own request counters); no request's prefix-cache hits, from the replicas' vLLM
  counters, exceed what its placement allows a cache of the engine's block size (the whole blocks of
  the conversation's longest earlier prompt on that replica); over the same conversations
  cache-aware placement allows more than round robin's and the replicas served more, in the same
  test;
- auth is end to end: the router forwards the client's key and the replicas check it;
- the router's load poll (power_of_two) reads our ``/get_load``;
- a replica killed mid-traffic: its in-flight streams end with an error instead of hanging, no
  request that starts afterwards fails, and the router marks it unhealthy, then healthy again
  once it is back.

The failover test kills and restarts a replica, so it comes last in this module.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.conftest import ROOT
from tests.service.conftest import error_of

from .cluster import (
    KEY,
    ROUTER_BIN,
    ROUTER_VERSION,
    STARTUP_TIMEOUT_S,
    Replica,
    Router,
    start_replicas,
    start_router,
)
from .conversations import TURNS, client, run_conversations, words


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("router")


@pytest.fixture(scope="module")
def replicas(workdir):
    pair = start_replicas(workdir)
    yield pair
    for replica in pair:
        replica.stop()


@pytest.fixture(scope="module")
def router(workdir, replicas):
    r = start_router(workdir, [x.url for x in replicas], "cache_aware")
    yield r
    r.stop()


def test_router_is_the_pinned_wheel() -> None:
    from importlib.metadata import version

    assert ROUTER_BIN.exists(), "vllm-router is not installed: bash scripts/setup.sh installs the test extra"
    assert version("vllm-router") == ROUTER_VERSION


def test_cache_aware_keeps_conversations_and_reuses_their_blocks(workdir, replicas, router) -> None:
    round_robin = start_router(workdir, [x.url for x in replicas], "round_robin")
    try:
        cache_aware = run_conversations(router.url, replicas, "C")
        rr = run_conversations(round_robin.url, replicas, "R")
    finally:
        round_robin.stop()
    block = replicas[0].block_size()
    expected = {"cache_aware": cache_aware.expected_hits(block), "round_robin": rr.expected_hits(block)}
    summary = (
        f"block {block} tokens; cache_aware: placement {cache_aware.placement}, hit rate "
        f"{cache_aware.hit_rate:.3f} ({cache_aware.hits:.0f}/{cache_aware.queries:.0f} tokens, expected "
        f"{sum(expected['cache_aware'])}); round_robin: placement {rr.placement}, hit rate "
        f"{rr.hit_rate:.3f} ({rr.hits:.0f}/{rr.queries:.0f} tokens, expected {sum(expected['round_robin'])})"
        f"\nper request (hits, expected): cache_aware "
        f"{[(int(r.hits), e) for r, e in zip(cache_aware.requests, expected['cache_aware'], strict=True)]}"
        f"; round_robin {[(int(r.hits), e) for r, e in zip(rr.requests, expected['round_robin'], strict=True)]}"
    )
    print(summary)
    assert cache_aware.prompt_tokens == rr.prompt_tokens, "both passes must send the same token counts"
    for turns in cache_aware.placement.values():
        assert len(turns) == TURNS and len(set(turns)) == 1, summary
    for turns in rr.placement.values():  # round robin really moved every conversation around
        assert len(set(turns)) == 2, summary
    for run in (cache_aware, rr):
        assert run.hits == sum(r.hits for r in run.requests), summary
    # No request reuses more than its placement allows (no block of another conversation or replica)...
    for run, name in ((cache_aware, "cache_aware"), (rr, "round_robin")):
        for r, e in zip(run.requests, expected[name], strict=True):
            assert r.hits <= e, summary
    # ...and keeping conversations in place reuses more, by what placement allows and by what the
    # replicas served. Which of the allowed blocks vLLM holds a GDN state for depends on its chunking
    # (a state is kept at block boundaries a prefill chunk or a decode step ends on), so the served
    # hits are compared, not predicted.
    assert sum(expected["cache_aware"]) > sum(expected["round_robin"]), summary
    assert cache_aware.hits > rr.hits, summary

    # The router's own account of it: one cache-aware decision per request.
    decisions = router.metrics()["vllm_router_policy_decisions_total"]
    assert {s.labels["policy"] for s in decisions} == {"cache_aware"}
    assert sum(s.value for s in decisions) >= len(cache_aware.placement) * TURNS


def test_auth_is_checked_by_the_replicas_through_the_router(workdir, replicas, router) -> None:
    assert "--api-key" not in router.args  # the router holds no key; it forwards the client's
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(timeout=30) as http:
        error_of(http.post(router.url + "/v1/chat/completions", json=body), 401)
        wrong = {"Authorization": "Bearer not-a-key"}
        error_of(http.post(router.url + "/v1/chat/completions", json=body, headers=wrong), 401)
        ok = http.post(
            router.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert ok.status_code == 200, ok.text
        models = http.get(router.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert [m["id"] for m in models.json()["data"]] == ["tiny"]
        # cache_aware asked the replicas to render the request into tokens (with the client's key)
        # and found the route: no 404 from the router's own calls.
        counts: dict[tuple[str, str], float] = {}
        for replica in replicas:
            for sample in replica.metrics()["qwen4exp_http_requests_total"]:
                key = (sample.labels["route"], sample.labels["status"])
                counts[key] = counts.get(key, 0.0) + sample.value
        assert counts.get(("/v1/chat/completions/render", "200"), 0) > 0, counts
        assert ("other", "404") not in counts, counts
        # What the router polls without a key: health (/ready) and load.
        for replica in replicas:
            assert http.get(replica.url + "/ready").status_code == 200
            load = http.get(replica.url + "/get_load")
            assert load.status_code == 200 and isinstance(load.json()["load"], int), load.text

    # power_of_two compares the loads it polls from /get_load (-1 when a poll fails).
    p2 = start_router(workdir, [x.url for x in replicas], "power_of_two")
    try:
        deadline = time.monotonic() + 30
        loads: list[int] = []
        while time.monotonic() < deadline:
            loads = [w["load"] for w in httpx.get(p2.url + "/get_loads", timeout=5).json()["workers"]]
            if loads and all(x >= 0 for x in loads):
                break
            time.sleep(0.5)
        assert len(loads) == 2 and all(x >= 0 for x in loads), (loads, p2.log()[-2000:])
    finally:
        p2.stop()


@dataclass
class Outcome:
    conversation: int
    started: float
    ended: float
    tokens: int
    finish_reason: str | None
    error: str | None


STREAM_TOKENS = 64
STREAM_TIMEOUT_S = 60.0  # a request still open after this is a hang


def converse(base_url: str, c: int, requests: int, results: list[Outcome], stop: threading.Event) -> None:
    """One client: a conversation of up to ``requests`` streamed turns, each exactly
    STREAM_TOKENS long (ignore_eos), recording how each ended."""
    api = client(base_url, timeout=STREAM_TIMEOUT_S)
    messages = [{"role": "system", "content": f"failover conversation {c}: {words(500 + c, 30)}"}]
    for turn in range(requests):
        if stop.is_set():
            return
        messages.append({"role": "user", "content": f"turn {turn}: {words(600 + c + turn, 10)}"})
        started, tokens, finish, error = time.monotonic(), 0, None, None
        try:
            stream = api.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=STREAM_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except openai.APITimeoutError:
            error = "hang"
        except (openai.APIError, httpx.HTTPError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        results.append(Outcome(c, started, time.monotonic(), tokens, finish, error))
        messages.append({"role": "assistant", "content": "noted"})
        messages = messages[:1] + messages[-4:]  # keep the prompt short: many turns, 2,048 tokens


def wait_for_inflight(replicas: list[Replica], timeout: float = 30.0) -> Replica:
    """The replica with the most chat streams in progress, once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inflight = [(r.chats_in_progress(), i) for i, r in enumerate(replicas)]
        busiest, index = max(inflight)
        if busiest > 0:
            return replicas[index]
        time.sleep(0.05)
    raise AssertionError("no request in flight on any replica")


def test_a_killed_replica_fails_over_and_comes_back(replicas, router: Router) -> None:
    results: list[Outcome] = []
    stop = threading.Event()
    clients = [
        threading.Thread(target=converse, args=(router.url, c, 6, results, stop), daemon=True)
        for c in range(4)
    ]
    for t in clients:
        t.start()
    try:
        time.sleep(1.0)  # let the conversations spread over both replicas
        victim = wait_for_inflight(replicas)
        killed_at = time.monotonic()
        victim.kill()
        router.wait_health(victim.url, False, timeout=30)
    finally:
        for t in clients:
            t.join(STREAM_TIMEOUT_S * 8)
        stop.set()
    assert not any(t.is_alive() for t in clients), "a client thread is stuck"

    lines = "\n".join(
        f"conv {o.conversation} start {o.started - killed_at:+.2f}s end {o.ended - killed_at:+.2f}s "
        f"tokens {o.tokens} finish {o.finish_reason} error {o.error}"
        for o in sorted(results, key=lambda o: o.started)
    )
    print(lines)
    assert not [o for o in results if o.error == "hang"], lines
    after = [o for o in results if o.started > killed_at]
    assert after, lines
    for o in after:  # nothing that starts after the kill fails
        assert o.error is None and o.finish_reason == "length" and o.tokens == STREAM_TOKENS, lines
    cut = [o for o in results if o.error is not None or o.finish_reason != "length"]
    assert cut, f"the kill cut no stream (victim {victim.url}):\n{lines}"
    for o in cut:  # only requests in flight at the kill, and they got an error, not a silent end
        assert o.started < killed_at and o.error is not None, lines

    # The replica returns on the same address; the router's health checks take it back.
    victim.launch()
    victim.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
    router.wait_health(victim.url, True, timeout=30)
    health = {s.labels["worker"]: s.value for s in router.metrics()["vllm_router_worker_health"]}
    assert health == {r.url: 1.0 for r in replicas}, health
    again = client(router.url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "back"}], max_tokens=2
    )
    assert again.choices[0].finish_reason == "length"


def test_scale_out_dashboard_reads_metrics_that_exist(replicas, router: Router) -> None:
    """Every metric the scale-out dashboard charts is exported: vllm_router_* by the real router
    (after the traffic above), vllm:* and qwen4exp_* by the replicas."""
    dashboard = json.loads((ROOT / "k8s" / "qwen4exp" / "dashboards" / "qwen4exp-scale-out.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {
        m for e in exprs for m in re.findall(r"\b(vllm_router_[a-z_]+|vllm:[a-z_:]+|qwen4exp_[a-z0-9_]+)", e)
    }
    exported = set(router.metrics()) | set(replicas[0].metrics())
    # Counters of events that may not have happened yet appear at their first increment.
    on_first_event = {"vllm_router_retries_total", "vllm_router_retries_exhausted_total"}
    missing = {m for m in used - on_first_event if m not in exported}
    assert not missing, (missing, sorted(n for n in exported if n.startswith("vllm_router")))
