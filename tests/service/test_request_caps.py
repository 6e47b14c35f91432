"""Per-request caps and sequence-weighted admission: one request cannot hold the engine.

``cap_problem`` is checked cap by cap (at the limit passes, one over names the setting);
``RequestCaps`` and ``Admission`` are driven as ASGI apps in-process; the last tests send
over-cap requests through the ``openai`` client to the shared real server (default caps,
``QWEN4EXP_MAX_MODEL_LEN=2048``) and check that it still answers afterwards.
"""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.guards import Admission
from service.lifecycle import Lifecycle
from service.request_caps import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
    Limits,
    RequestCaps,
    as_int,
    cap_problem,
    prompt_count,
    sequence_weight,
)
from service.settings import ServiceSettings

from .conftest import KEY, Server, error_of

LIMITS = Limits(
    max_n=4,
    max_prompts=3,
    max_stop=2,
    max_logit_bias=5,
    max_tools=2,
    max_schema_bytes=300,
    max_logprobs=5,
    max_new_tokens=100,
)
MSGS = [{"role": "user", "content": "hi"}]


def tool(i: int, padding: str = "") -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "description": padding, "parameters": {}}}


def bias(k: int) -> dict[str, float]:
    return {str(i): 1.0 for i in range(k)}


# name -> (path, field, the body at the limit, the body one over, the setting named)
CAPS: dict[str, tuple[str, str, dict, dict, str]] = {
    "n": (COMPLETIONS, "n", {"n": 4}, {"n": 5}, "QWEN4EXP_MAX_N"),
    "chat n": (CHAT, "n", {"n": 4}, {"n": 5}, "QWEN4EXP_MAX_N"),
    "best_of": (COMPLETIONS, "best_of", {"best_of": 4}, {"best_of": 5}, "QWEN4EXP_MAX_N"),
    "n as a string": (COMPLETIONS, "n", {"n": "4"}, {"n": "5"}, "QWEN4EXP_MAX_N"),
    "n as a float": (COMPLETIONS, "n", {"n": 4.0}, {"n": 5.0}, "QWEN4EXP_MAX_N"),
    "prompt strings": (
        COMPLETIONS,
        "prompt",
        {"prompt": ["a"] * 3},
        {"prompt": ["a"] * 4},
        "QWEN4EXP_MAX_PROMPTS_PER_REQUEST",
    ),
    "prompt token lists": (
        COMPLETIONS,
        "prompt",
        {"prompt": [[1, 2]] * 3},
        {"prompt": [[1, 2]] * 4},
        "QWEN4EXP_MAX_PROMPTS_PER_REQUEST",
    ),
    "stop list": (
        CHAT,
        "stop",
        {"stop": ["a", "b"]},
        {"stop": ["a", "b", "c"]},
        "QWEN4EXP_MAX_STOP_SEQUENCES",
    ),
    "completion stop": (
        COMPLETIONS,
        "stop",
        {"stop": ["a", "b"]},
        {"stop": ["a", "b", "c"]},
        "QWEN4EXP_MAX_STOP_SEQUENCES",
    ),
    "messages stop_sequences": (
        MESSAGES,
        "stop_sequences",
        {"stop_sequences": ["a", "b"]},
        {"stop_sequences": ["a", "b", "c"]},
        "QWEN4EXP_MAX_STOP_SEQUENCES",
    ),
    "logit_bias": (
        CHAT,
        "logit_bias",
        {"logit_bias": bias(5)},
        {"logit_bias": bias(6)},
        "QWEN4EXP_MAX_LOGIT_BIAS_ENTRIES",
    ),
    "completion logit_bias": (
        COMPLETIONS,
        "logit_bias",
        {"logit_bias": bias(5)},
        {"logit_bias": bias(6)},
        "QWEN4EXP_MAX_LOGIT_BIAS_ENTRIES",
    ),
    "tools": (
        CHAT,
        "tools",
        {"tools": [tool(1), tool(2)]},
        {"tools": [tool(i) for i in range(3)]},
        "QWEN4EXP_MAX_TOOLS",
    ),
    "responses tools": (
        RESPONSES,
        "tools",
        {"tools": [tool(1), tool(2)]},
        {"tools": [tool(i) for i in range(3)]},
        "QWEN4EXP_MAX_TOOLS",
    ),
    "messages tools": (
        MESSAGES,
        "tools",
        {"tools": [tool(1), tool(2)]},
        {"tools": [tool(i) for i in range(3)]},
        "QWEN4EXP_MAX_TOOLS",
    ),
    "completion logprobs": (
        COMPLETIONS,
        "logprobs",
        {"logprobs": 5},
        {"logprobs": 6},
        "QWEN4EXP_MAX_LOGPROBS",
    ),
    "chat top_logprobs": (
        CHAT,
        "top_logprobs",
        {"logprobs": True, "top_logprobs": 5},
        {"logprobs": True, "top_logprobs": 6},
        "QWEN4EXP_MAX_LOGPROBS",
    ),
    "chat max_tokens": (
        CHAT,
        "max_tokens",
        {"max_tokens": 100},
        {"max_tokens": 101},
        "QWEN4EXP_MAX_MODEL_LEN",
    ),
    "chat max_completion_tokens": (
        CHAT,
        "max_completion_tokens",
        {"max_completion_tokens": 100},
        {"max_completion_tokens": 101},
        "QWEN4EXP_MAX_MODEL_LEN",
    ),
    "completion max_tokens": (
        COMPLETIONS,
        "max_tokens",
        {"max_tokens": 100},
        {"max_tokens": 101},
        "QWEN4EXP_MAX_MODEL_LEN",
    ),
    "responses max_output_tokens": (
        RESPONSES,
        "max_output_tokens",
        {"max_output_tokens": 100},
        {"max_output_tokens": 101},
        "QWEN4EXP_MAX_MODEL_LEN",
    ),
    "messages max_tokens": (
        MESSAGES,
        "max_tokens",
        {"max_tokens": 100},
        {"max_tokens": 101},
        "QWEN4EXP_MAX_MODEL_LEN",
    ),
}


def schema_of_size(path: str, field: str, size: int) -> dict:
    """A body whose schema fields on ``path`` hold exactly ``size`` bytes of compact JSON."""
    empty = {
        "tools": [tool(0)],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"d": ""}}},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"d": ""}}},
    }[field]
    base = len(json.dumps(empty, separators=(",", ":")))
    if field == "tools":
        return {field: [tool(0, "x" * (size - base))]}
    value = json.loads(json.dumps(empty).replace('"d": ""', json.dumps({"d": "x" * (size - base)})[1:-1]))
    return {field: value}


@pytest.mark.parametrize("name", list(CAPS))
def test_each_cap_passes_at_the_limit_and_names_its_setting_one_over(name: str) -> None:
    path, field, at_limit, over, setting = CAPS[name]
    assert cap_problem(path, at_limit, LIMITS) is None
    problem = cap_problem(path, over, LIMITS)
    assert problem is not None
    assert problem[0] == field, problem
    assert setting in problem[1] and field in problem[1], problem


@pytest.mark.parametrize(
    "path,field",
    [(CHAT, "tools"), (CHAT, "response_format"), (COMPLETIONS, "response_format"), (RESPONSES, "text")],
)
def test_schema_size_cap(path: str, field: str) -> None:
    assert cap_problem(path, schema_of_size(path, field, 300), LIMITS) is None
    problem = cap_problem(path, schema_of_size(path, field, 301), LIMITS)
    assert problem is not None and problem[0] == field, problem
    assert "301 bytes" in problem[1] and "300 bytes" in problem[1], problem
    assert "QWEN4EXP_MAX_TOOL_SCHEMA_BYTES" in problem[1]


def test_schema_sizes_add_up_and_the_largest_field_is_named() -> None:
    body = {**schema_of_size(CHAT, "tools", 200), **schema_of_size(CHAT, "response_format", 101)}
    problem = cap_problem(CHAT, body, LIMITS)
    assert problem is not None and problem[0] == "tools", problem
    assert "tools + response_format" in problem[1], problem


def test_message_names_field_value_limit_and_setting() -> None:
    assert cap_problem(COMPLETIONS, {"n": 10000}, Limits()) == (
        "n",
        "n=10000 exceeds this server's limit of 16 (QWEN4EXP_MAX_N).",
    )
    field, message = cap_problem(CHAT, {"stop": ["x"] * 17}, Limits()) or ("", "")
    assert field == "stop" and "17" in message and "16" in message


def test_caps_only_apply_where_the_field_exists() -> None:
    """No n on Messages/Responses, no stop on Responses, no max_tokens check without a context."""
    assert cap_problem(MESSAGES, {"n": 99, "logit_bias": bias(9)}, LIMITS) is None
    assert cap_problem(RESPONSES, {"n": 99, "stop": ["a"] * 9}, LIMITS) is None
    assert cap_problem(CHAT, {"max_tokens": 10**9}, Limits()) is None  # vLLM shortens it to the room left
    assert cap_problem("/v1/other", {"n": 99}, LIMITS) is None


def test_a_single_stop_string_counts_one() -> None:
    assert cap_problem(CHAT, {"stop": "abc"}, Limits(max_stop=1)) is None
    assert cap_problem(CHAT, {"stop": "abc"}, Limits(max_stop=0)) is not None


@pytest.mark.parametrize(
    "body",
    [
        {"n": "many"},
        {"n": None},
        {"n": [100]},
        {"n": 2.5},
        {"stop": {"a": 1}},
        {"logit_bias": ["1"] * 900},
        {"tools": {"a": 1}},
        {"prompt": 12345},
        {"max_tokens": "lots"},
    ],
)
def test_wrongly_typed_fields_are_left_to_vllm(body: dict) -> None:
    assert cap_problem(COMPLETIONS, body, LIMITS) is None
    assert cap_problem(CHAT, body, LIMITS) is None


def test_values_are_read_as_pydantic_coerces_them() -> None:
    assert [as_int(v) for v in (3, True, 3.0, "3", " 3 ", "3.0", "1_000")] == [3, 1, 3, 3, 3, 3, 1000]
    assert [as_int(v) for v in (2.5, "x", None, [], {}, float("inf"))] == [None] * 6


def test_prompt_count_and_sequence_weight() -> None:
    prompts = {"a": 1, (1, 2, 3): 1, ("a", "b"): 2, ((1,), (2,), (3,)): 3, None: 0, (): 1}
    for prompt, count in prompts.items():
        as_json = json.loads(json.dumps(prompt))  # tuples (hashable here) become JSON lists
        assert prompt_count(as_json) == count, prompt
    assert sequence_weight(COMPLETIONS, {"prompt": "a"}) == 1
    assert sequence_weight(COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}) == 6
    assert sequence_weight(COMPLETIONS, {"prompt": "a", "n": 2, "best_of": 5}) == 5
    assert sequence_weight(CHAT, {"messages": MSGS, "n": 3}) == 3
    assert sequence_weight(CHAT, {"messages": MSGS, "n": None}) == 1
    assert sequence_weight(MESSAGES, {"n": 9}) == 1


# ---- ASGI, in-process --------------------------------------------------------------------------


def settings(**caps: Any) -> ServiceSettings:
    return ServiceSettings.model_construct(model=Path("unused"), **caps)


class Client:
    """One ASGI request: the body, then (when ``leave`` is set) a disconnect."""

    def __init__(self, body: bytes = b"{}", path: str = COMPLETIONS, weight: int | None = None) -> None:
        self.scope: dict[str, Any] = {"type": "http", "method": "POST", "path": path, "headers": []}
        if weight is not None:
            self.scope[Admission.WEIGHT_KEY] = weight
        self.body = body
        self.sent: list[dict] = []
        self.leave = asyncio.Event()
        self._body_sent = False

    async def receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)

    def json(self) -> dict:
        return json.loads(
            b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        )


class Engine:
    """An inner app that holds each request until told to finish it, and records what it saw."""

    def __init__(self) -> None:
        self.running: dict[str, asyncio.Event] = {}
        self.seen: list[tuple[dict, bytes]] = []

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        self.seen.append((scope, message.get("body", b"")))
        try:
            name = json.loads(message.get("body", b"")).get("name", "")
        except (ValueError, AttributeError, RecursionError):
            name = ""
        done = self.running.setdefault(name, asyncio.Event())
        await done.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    def finish(self, name: str) -> None:
        self.running.setdefault(name, asyncio.Event()).set()


def admission(inner, max_running: int, max_queued: int) -> Admission:
    return Admission(inner, frozenset({COMPLETIONS}), max_running, max_queued, 1, Lifecycle())


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_request_caps_answers_400_with_param_and_passes_the_rest_on_with_their_weight() -> None:
    async def main() -> None:
        engine = Engine()
        engine.finish("")
        caps = RequestCaps(engine, settings(max_n=4), frozenset({COMPLETIONS, CHAT}))
        over = Client(b'{"prompt": "x", "n": 5}')
        await caps(over.scope, over.receive, over.send)
        assert over.status == 400 and not engine.seen
        err = over.json()["error"]
        assert err["param"] == "n" and err["code"] == "invalid_request" and "QWEN4EXP_MAX_N" in err["message"]
        body = b'{"prompt": ["a", "b"], "n": 3}'
        ok = Client(body)
        await caps(ok.scope, ok.receive, ok.send)
        assert ok.status == 200 and engine.seen[-1] == (ok.scope, body)
        assert ok.scope[Admission.WEIGHT_KEY] == 6
        for raw in (b"not json", b"[1, 2]", b'"n"', b"[" * 100_000):  # vLLM answers these itself
            other = Client(raw)
            await caps(other.scope, other.receive, other.send)
            assert other.status == 200 and engine.seen[-1][1] == raw
            assert Admission.WEIGHT_KEY not in other.scope
        elsewhere = Client(b'{"n": 99}', path="/tokenize")
        await caps(elsewhere.scope, elsewhere.receive, elsewhere.send)
        assert elsewhere.status == 200

    asyncio.run(main())


def test_admission_counts_sequences_and_keeps_weight_one_as_before() -> None:
    async def main() -> None:
        engine = Engine()
        gate = admission(engine, max_running=4, max_queued=0)
        heavy = Client(b'{"name": "heavy"}', weight=3)
        task = asyncio.create_task(gate(heavy.scope, heavy.receive, heavy.send))
        await settle()
        assert gate.admitted == 3 and gate.free == 1
        too_heavy = Client(weight=2)
        await gate(too_heavy.scope, too_heavy.receive, too_heavy.send)
        assert too_heavy.status == 429 and "2 sequences" in too_heavy.json()["error"]["message"]
        light = Client(b'{"name": "light"}')
        light_task = asyncio.create_task(gate(light.scope, light.receive, light.send))
        await settle()
        assert gate.admitted == 4 and gate.free == 0
        one_more = Client()
        await gate(one_more.scope, one_more.receive, one_more.send)
        assert one_more.status == 429
        assert one_more.json()["error"]["message"] == (
            "Too many requests: 4 are already running or queued; retry later."
        )
        engine.finish("heavy")
        engine.finish("light")
        await asyncio.gather(task, light_task)
        assert heavy.status == light.status == 200 and gate.admitted == 0 and gate.free == 4

    asyncio.run(main())


def test_a_request_heavier_than_the_engine_runs_alone() -> None:
    async def main() -> None:
        engine = Engine()
        gate = admission(engine, max_running=4, max_queued=4)
        huge = Client(b'{"name": "huge"}', weight=1000)
        task = asyncio.create_task(gate(huge.scope, huge.receive, huge.send))
        await settle()
        assert gate.admitted == 4 and gate.free == 0 and len(engine.seen) == 1
        engine.finish("huge")
        await task
        assert huge.status == 200 and gate.free == 4

    asyncio.run(main())


def test_slots_go_in_arrival_order_and_a_queued_client_that_leaves_frees_its_place() -> None:
    async def main() -> None:
        engine = Engine()
        gate = admission(engine, max_running=4, max_queued=8)
        clients = {
            "a": Client(b'{"name": "a"}', weight=3),
            "b": Client(b'{"name": "b"}', weight=4),
            "c": Client(b'{"name": "c"}', weight=1),
        }
        tasks = {}
        for name, client in clients.items():
            tasks[name] = asyncio.create_task(gate(client.scope, client.receive, client.send))
            await settle()
        # One slot is free, but c does not overtake b, which waits for all four.
        assert [json.loads(body)["name"] for _, body in engine.seen] == ["a"]
        assert gate.admitted == 8 and gate.free == 1
        engine.finish("a")
        await settle()
        assert [json.loads(body)["name"] for _, body in engine.seen] == ["a", "b"]
        d = Client(b'{"name": "d"}', weight=2)
        tasks["d"] = asyncio.create_task(gate(d.scope, d.receive, d.send))
        await settle()
        d.leave.set()  # d's client hangs up while queued behind c
        await tasks["d"]
        assert d.status is None and gate.admitted == 5
        c = clients["c"]
        c.leave.set()  # c too: no slot taken, nothing answered
        await tasks["c"]
        assert c.status is None and gate.admitted == 4
        engine.finish("b")
        await tasks["b"]
        assert gate.admitted == 0 and gate.free == 4 and not gate._waiters

    asyncio.run(main())


def test_a_cancelled_queued_request_lets_lighter_ones_behind_it_in() -> None:
    async def main() -> None:
        engine = Engine()
        gate = admission(engine, max_running=4, max_queued=8)
        a = Client(b'{"name": "a"}', weight=2)
        b = Client(b'{"name": "b"}', weight=4)
        c = Client(b'{"name": "c"}', weight=2)
        ta = asyncio.create_task(gate(a.scope, a.receive, a.send))
        await settle()
        tb = asyncio.create_task(gate(b.scope, b.receive, b.send))
        await settle()
        tc = asyncio.create_task(gate(c.scope, c.receive, c.send))
        await settle()
        assert len(engine.seen) == 1
        tb.cancel()
        await asyncio.gather(tb, return_exceptions=True)
        await settle()
        assert [json.loads(body)["name"] for _, body in engine.seen] == ["a", "c"]
        engine.finish("a")
        engine.finish("c")
        await asyncio.gather(ta, tc)
        assert gate.admitted == 0 and gate.free == 4

    asyncio.run(main())


def test_caps_run_before_admission_in_the_app(tmp_path, monkeypatch) -> None:
    from service.app import build_app

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # for the /metrics registry
    app, _ = build_app(settings(), Namespace(), Lifecycle(), "cpu")
    order = [m.cls for m in app.user_middleware]  # outermost first
    assert order.index(RequestCaps) < order.index(Admission)


# ---- the real service --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def over_cap_calls(client: openai.OpenAI) -> dict[str, tuple[Any, str, str]]:
    """name -> (the call, the field named, the limit's words), with the settings' defaults."""
    chat = client.chat.completions.create
    return {
        "n": (
            lambda: client.completions.create(model="tiny", prompt="hi", n=10000, max_tokens=1),
            "n",
            "16 (QWEN4EXP_MAX_N)",
        ),
        "prompts": (
            lambda: client.completions.create(model="tiny", prompt=["hi"] * 65, max_tokens=1),
            "prompt",
            "64 (QWEN4EXP_MAX_PROMPTS_PER_REQUEST)",
        ),
        "stop": (
            lambda: chat(model="tiny", messages=MSGS, stop=[f"s{i}" for i in range(17)], max_tokens=1),
            "stop",
            "16 (QWEN4EXP_MAX_STOP_SEQUENCES)",
        ),
        "logit_bias": (
            lambda: chat(
                model="tiny", messages=MSGS, logit_bias={str(i): 1 for i in range(301)}, max_tokens=1
            ),
            "logit_bias",
            "300 (QWEN4EXP_MAX_LOGIT_BIAS_ENTRIES)",
        ),
        "tools": (
            lambda: chat(model="tiny", messages=MSGS, tools=[tool(i) for i in range(129)], max_tokens=1),
            "tools",
            "128 (QWEN4EXP_MAX_TOOLS)",
        ),
        "max_tokens": (
            lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2049),
            "max_tokens",
            "2048 tokens (QWEN4EXP_MAX_MODEL_LEN)",
        ),
    }


def test_over_cap_requests_are_400s_naming_the_limit(server: Server, client: openai.OpenAI) -> None:
    for name, (call, field, words) in over_cap_calls(client).items():
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.status_code == 400, name
        assert words in info.value.message and field in info.value.message, (name, info.value.message)
        assert info.value.param == field, (name, info.value.body)
    r = httpx.post(
        server.url + "/v1/completions",
        headers=server.auth,
        json={"model": "tiny", "prompt": "hi", "n": 10000},
        timeout=30,
    )
    err = error_of(r, 400)
    assert (
        err["param"] == "n"
        and err["message"] == "n=10000 exceeds this server's limit of 16 (QWEN4EXP_MAX_N)."
    )


def test_requests_at_the_caps_are_still_served(server: Server, client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="Once upon a time", n=16, max_tokens=2)
    assert len(out.choices) == 16
    chat = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=2, stop=["x"] * 4, logit_bias={"5": 1.0}
    )
    assert chat.choices[0].message is not None
    assert server.wait_engine_idle() == (0, 0)
