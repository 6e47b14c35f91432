"""The API agents and chat apps use, through the real service and the official clients: tool calls,
the Responses and Anthropic Messages APIs, structured output, cached-token counts, the logprobs cap
and extra engine flags.

The server runs ``tiny`` with a Qwen-style chat template that has tools and a thinking block, so the
service picks vLLM's ``hermes`` tool-call parser itself (and no reasoning parser: tiny's tokenizer has
no ``<think>`` token). An untrained model
emits no tool call of its own accord, so the calls checked here are the ones the API forces
(``tool_choice`` required or named: vLLM constrains decoding to the tools' schemas) and the
round trip feeds a tool result back; what holds for any model is asserted, never a particular text.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.service.conftest import KEY, Server, start_server
from tests.service.test_engine_options import TOOLS_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory) -> Server:
    srv = start_server(
        tmp_path_factory.mktemp("agent"),
        "agent",
        QWEN4EXP_CHAT_TEMPLATE=str(TOOLS_TEMPLATE),
        QWEN4EXP_MAX_MODEL_LEN="2048",
        # Compact JSON under constraints: an untrained model would otherwise pad with newlines
        # until max_tokens (JSON allows any whitespace between tokens).
        QWEN4EXP_ENGINE_ARGS="--max-num-batched-tokens 2048 "
        '--structured-outputs-config \'{"backend": "xgrammar", "disable_any_whitespace": true}\'',
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(agent_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_the_start_up_log_names_the_parsers_and_the_engine_flags(agent_server: Server):
    log = agent_server.log()
    assert "tool calls: hermes parser (from the chat template)" in log
    # tiny's tokenizer has no <think> token, so no reasoning parser (its block could never end).
    assert "<think> and </think> are not tokens of this tokenizer" in log
    flags = next(line for line in log.splitlines() if "vLLM engine flags:" in line)
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in flags
    assert flags.rstrip().endswith(
        """--max-num-batched-tokens 2048 --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'"""
    )


def forced_call_name(message) -> str:
    """The function a forced call names: parsed, or (cut by max_tokens before the call closed) read
    from the constrained text, which starts with the call's syntax whatever the model wants."""
    if message.tool_calls:
        assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
        return message.tool_calls[0].function.name
    prefix = '<tool_call>\n{"name": "'
    assert message.content.startswith(prefix), message.content
    return message.content[len(prefix) :].split('"', 1)[0]


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_a_forced_tool_call_names_an_offered_function(client, choice, names):
    """vLLM constrains the output to the call syntax and the offered (or named) functions; the
    arguments are free JSON for an untrained model, so the function's name is what is asserted."""
    out = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=64, temperature=0
    )
    assert forced_call_name(out.choices[0].message) in names


def test_a_tool_result_round_trip_is_answered(client):
    """A call, its result and the final answer: the template renders the assistant's call and the
    tool message, and the engine answers the third turn."""
    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": json.dumps({"celsius": 21})},
    ]
    final = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=8)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens > 0


def test_streamed_tool_call_deltas_carry_the_call(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    names, ids = [], set()
    for chunk in stream:
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            ids.add(delta_call.index)
            if delta_call.function and delta_call.function.name:
                names.append(delta_call.function.name)
    # The name once, in call 0's first delta; what an untrained model writes as arguments (JSON,
    # or whitespace the parser holds back) is not asserted.
    assert names == ["get_weather"] and ids == {0}


def test_tool_choice_none_and_auto_answer(client):
    for choice in ("none", "auto"):
        out = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=4
        )
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        if choice == "none":
            assert not out.choices[0].message.tool_calls


def test_json_schema_output_is_honoured(client):
    # Enums only: an untrained model could write digits until max_tokens inside a free number.
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "colour": {"enum": ["red", "blue", "green"]}},
        "required": ["answer", "colour"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        },
        max_tokens=48,
        temperature=0,
    )
    data = json.loads(out.choices[0].message.content)
    assert data["answer"] in ("yes", "no") and data["colour"] in ("red", "blue", "green")
    assert set(data) == {"answer", "colour"}


def test_thinking_switch_and_reasoning_field_pass_through(client):
    """The template's thinking switch reaches it, and the answer carries the reasoning field next
    to the content (empty here: tiny has no reasoning parser; what it writes is not asserted)."""
    for thinking in (True, False):
        out = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=8,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        )
        message = out.choices[0].message.model_dump()
        assert "reasoning" in message or "reasoning_content" in message, message


def test_cached_tokens_are_counted_in_usage(client):
    prompt = [{"role": "user", "content": " ".join(f"word{i % 97}" for i in range(300))}]
    usages = [
        client.chat.completions.create(model="tiny", messages=prompt, max_tokens=1).usage for _ in range(3)
    ]
    assert 600 < usages[0].prompt_tokens < 2000, usages[0]  # over two prefix-cache blocks
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    # Align mode saves the recurrent states at block boundaries as a request passes them, so a
    # repeat hits whole blocks (on this CPU build from the third identical prompt on).
    assert cached[0] == 0 and cached[-1] > 0 and all(c <= usages[0].prompt_tokens for c in cached), cached


def test_logprobs_are_capped_by_the_setting(client):
    ok = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=1, logprobs=True, top_logprobs=20
    )
    assert len(ok.choices[0].logprobs.content[0].top_logprobs) == 20
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=1, logprobs=True, top_logprobs=21
        )


def test_the_responses_api_answers_and_keeps_the_response(client):
    response = client.responses.create(model="tiny", input="Hello there", max_output_tokens=8)
    assert response.status in ("completed", "incomplete") and isinstance(response.output_text, str)
    assert response.usage.input_tokens > 0


def test_the_anthropic_messages_api_answers(agent_server: Server):
    claude = anthropic.Anthropic(base_url=agent_server.url, api_key=KEY, max_retries=0, timeout=120)
    message = claude.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert message.role == "assistant" and message.usage.input_tokens > 0
    assert all(block.type in ("text", "thinking", "tool_use") for block in message.content)
    counted = httpx.post(
        agent_server.url + "/v1/messages/count_tokens",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text


def test_the_new_routes_need_the_key(agent_server: Server):
    for path in ("/v1/responses", "/v1/messages"):
        r = httpx.post(agent_server.url + path, json={"model": "tiny"}, timeout=30)
        assert r.status_code == 401, (path, r.text)
