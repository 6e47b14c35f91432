"""Hypothesis strategies for adversarial OpenAI request bodies, derived from vLLM's own schema.

Every top-level field of vLLM's ``CompletionRequest``/``ChatCompletionRequest`` (their pydantic
JSON schema, i.e. what vLLM's ``/openapi.json`` publishes) gets values of its declared types and,
as often, of the wrong type; hand-picked edge cases (out-of-vocabulary and
negative ids, empty and 1-token prompts, huge n/logprobs/max_tokens, broken JSON schemas,
unicode junk, 5k-word prompts) come as explicit bodies.

Valid but merely expensive requests (thousands of tokens or sequences) are scaled down so the
run stays short on two cores: the test is about answers, not about capacity.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

VOCAB = 512  # the tiny checkpoint
JUNK_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
INTERESTING_INTS = st.sampled_from([-(2**63), -1, 0, 1, 2, 5, VOCAB - 1, VOCAB, 2**31, 2**63 - 1, 10**30])
SCALAR_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    INTERESTING_INTS,
    st.floats(allow_nan=False, allow_infinity=False),
    JUNK_TEXT,
    st.lists(st.integers(-5, 10), max_size=3),
    st.dictionaries(JUNK_TEXT, st.integers(), max_size=2),
)


def from_schema(node: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of the JSON-schema ``node``'s declared types (a small, lenient subset of JSON schema)."""
    if depth > 3:
        return st.none()
    if "$ref" in node:
        return from_schema(defs.get(node["$ref"].rsplit("/", 1)[-1], {}), defs, depth + 1)
    if "anyOf" in node or "oneOf" in node:
        return st.one_of([from_schema(n, defs, depth + 1) for n in node.get("anyOf", node.get("oneOf"))])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if "const" in node:
        return st.just(node["const"])
    kind = node.get("type")
    if kind == "string":
        return JUNK_TEXT
    if kind == "integer":
        return st.one_of(INTERESTING_INTS, st.integers(-3, VOCAB + 3))
    if kind == "number":
        return st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.floats(-3, 3))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(node.get("items", {}), defs, depth + 1), max_size=4)
    if kind == "object":
        props = node.get("properties", {})
        if props:
            return st.fixed_dictionaries(
                {}, optional={k: from_schema(v, defs, depth + 1) for k, v in list(props.items())[:8]}
            )
        return st.dictionaries(JUNK_TEXT, SCALAR_JUNK, max_size=3)
    return SCALAR_JUNK


def schema_fields(model_cls) -> tuple[dict[str, st.SearchStrategy], dict]:
    schema = model_cls.model_json_schema()
    defs = schema.get("$defs", {})
    return {
        name: st.one_of(from_schema(node, defs), SCALAR_JUNK) for name, node in schema["properties"].items()
    }, schema


def scale_down(body: dict[str, Any]) -> dict[str, Any]:
    """Keep valid-but-expensive values cheap; leave invalid ones (vLLM must reject them) alone."""
    for key, cap in (
        ("max_tokens", 8),
        ("max_completion_tokens", 8),
        ("min_tokens", 8),
        ("n", 2),
        ("best_of", 2),
    ):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and cap < value <= 20000:
            body[key] = cap
    if body.get("use_beam_search") is True:
        body["n"] = 1
    return body


MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer"]), JUNK_TEXT),
        "content": st.one_of(
            JUNK_TEXT,
            st.none(),
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url", "x"]), "text": JUNK_TEXT}
                )
            ),
            SCALAR_JUNK,
        ),
    }
)


def bodies(model_cls, fixed: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Bodies with ``fixed`` fields always present and a random subset of the schema's others."""
    fields, _ = schema_fields(model_cls)
    optional = {k: v for k, v in fields.items() if k not in fixed and k != "model"}
    return st.fixed_dictionaries(
        {"model": st.one_of(st.just("tiny"), st.just("tiny"), JUNK_TEXT), **fixed}, optional=optional
    ).map(scale_down)


def completion_bodies() -> st.SearchStrategy:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    prompt = st.one_of(
        JUNK_TEXT,
        st.lists(st.integers(-3, VOCAB + 3), max_size=12),
        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), max_size=3),
        SCALAR_JUNK,
    )
    return bodies(CompletionRequest, {"prompt": prompt})


def chat_bodies() -> st.SearchStrategy:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return bodies(ChatCompletionRequest, {"messages": st.one_of(st.lists(MESSAGE, max_size=3), SCALAR_JUNK)})


FIVE_K_WORDS = " ".join(["word"] * 5000)
USER = [{"role": "user", "content": "hi"}]


def _schema_chat(schema: dict) -> dict:
    """A short chat request whose answer must follow ``schema``."""
    return {
        "model": "tiny",
        "messages": USER,
        "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


EDGE_CASES: list[tuple[str, dict]] = [
    ("/v1/completions", {"model": "tiny", "prompt": [VOCAB + 10]}),
    ("/v1/completions", {"model": "tiny", "prompt": [2**40]}),
    ("/v1/completions", {"model": "tiny", "prompt": [-1, 3]}),
    ("/v1/completions", {"model": "tiny", "prompt": []}),
    ("/v1/completions", {"model": "tiny", "prompt": ""}),
    ("/v1/completions", {"model": "tiny", "prompt": [5], "max_tokens": 3}),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 3}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 10**6, "max_tokens": 1}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10**12}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -5}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 10**6, "max_tokens": 1}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "prompt_logprobs": 10**6, "max_tokens": 1}),
    ("/v1/completions", {"model": "tiny", "prompt": FIVE_K_WORDS, "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": "\x00\ufffe\U0010ffff" * 50, "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 10**9}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": FIVE_K_WORDS}]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "\ud83d\x00" * 30}]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "n": 10**6}),
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "top_logprobs": 10**6, "logprobs": True}),
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_completion_tokens": 10**12}),
    ("/v1/chat/completions", _schema_chat({"type": 7})),
    ("/v1/chat/completions", _schema_chat({"$ref": "#/no"})),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": USER, "max_tokens": 3, "structured_outputs": {"regex": "(("}},
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": USER, "max_tokens": 3, "logit_bias": {"99999": 100}},
    ),
]


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# Bodies built to hold the engine: long stop lists, deep schemas, many tools, wide logit_bias.
HEAVY = [f"stop-{i}" for i in range(500)]
EDGE_CASES += [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stop": HEAVY}),
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 3, "stop": HEAVY}),
    ("/v1/chat/completions", _schema_chat(_nested_schema(400))),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": USER,
            "max_tokens": 3,
            "tools": [
                {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                for i in range(1000)
            ],
        },
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": 3, "logit_bias": {str(i): 1 for i in range(5000)}},
    ),
    ("/v1/completions", {"model": "tiny", "prompt": ["hi"] * 5000, "max_tokens": 1}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1, "n": 16384, "best_of": 16384}),
]
