"""The official ``openai`` client against the service: models, chat, streaming chat with usage,
completions; plus vLLM's tokenize/detokenize and the checkpoint's chat template."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import FILE_KEY, KEY, Server

PROMPT = [{"role": "user", "content": "Say something."}]
DETERMINISTIC = {"ignore_eos": True}  # vLLM extension: exact token counts regardless of the text


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=PROMPT, max_tokens=8, temperature=0, extra_body=DETERMINISTIC
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=PROMPT,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=DETERMINISTIC,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == 6


def test_completions(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, extra_body=DETERMINISTIC
    )
    assert out.choices[0].text
    assert out.usage.completion_tokens == 5


def test_key_from_the_mounted_file_works(server: Server) -> None:
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=FILE_KEY, max_retries=0)
    assert other.models.list().data


def test_client_sees_typed_errors(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=PROMPT, max_tokens=1)
    assert nf.value.code == "model_not_found"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        bad.models.list()
    assert auth.value.code == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model="tiny", prompt="x", max_tokens=-3)
    assert br.value.code == "invalid_parameter" and br.value.param == "max_tokens"


def test_tokenize_detokenize_and_chat_template(server: Server, client: openai.OpenAI) -> None:
    r = httpx.post(
        server.url + "/tokenize", headers=server.auth, json={"model": "tiny", "prompt": "hello world"}
    )
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    r = httpx.post(server.url + "/detokenize", headers=server.auth, json={"model": "tiny", "tokens": tokens})
    assert r.status_code == 200 and r.json()["prompt"] == "hello world"
    # The checkpoint's chat template renders the messages: same prompt length as a chat request.
    r = httpx.post(
        server.url + "/tokenize",
        headers=server.auth,
        json={"model": "tiny", "messages": PROMPT, "add_generation_prompt": True},
    )
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens
    assert r.json()["count"] > len(tokens)  # role markers were added
