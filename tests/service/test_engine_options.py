"""What the service adds to vLLM's command line for agents, checked without an engine: the tool-call
and reasoning parsers picked from the chat template, the operator's extra engine flags, the
logprobs cap and cached-token counts."""

from __future__ import annotations

import pytest

from service import chat_features, engine
from service.settings import ServiceSettings, SettingsError
from tests.conftest import ROOT, ensure_checkpoint

TOOLS_TEMPLATE = ROOT / "tests" / "data" / "templates" / "qwen_tools_thinking.jinja"


def settings(monkeypatch, **env: str) -> ServiceSettings:
    for name in ("TOOL_CALL_PARSER", "REASONING_PARSER", "ENGINE_ARGS", "CHAT_TEMPLATE", "MAX_LOGPROBS"):
        monkeypatch.delenv(f"QWEN4EXP_{name}", raising=False)
    monkeypatch.setenv("QWEN4EXP_MODEL", str(ensure_checkpoint("tiny")))
    for name, value in env.items():
        monkeypatch.setenv(f"QWEN4EXP_{name}", value)
    return ServiceSettings()  # type: ignore[call-arg]


def test_parsers_follow_the_chat_template(monkeypatch, tmp_path):
    features, problems = chat_features.resolve(settings(monkeypatch))  # tiny: a plain template
    assert problems == [] and features.cli_args() == []
    # tiny's tokenizer has no <think> token: a reasoning parser could never see the block end.
    features, problems = chat_features.resolve(settings(monkeypatch, CHAT_TEMPLATE=str(TOOLS_TEMPLATE)))
    assert problems == [] and features.reasoning_parser is None
    assert any("<think> and </think> are not tokens of this tokenizer" in n for n in features.notes)
    monkeypatch.setattr(chat_features, "single_tokens", lambda settings, texts: True)
    features, problems = chat_features.resolve(settings(monkeypatch, CHAT_TEMPLATE=str(TOOLS_TEMPLATE)))
    assert problems == []
    assert features.cli_args() == [
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"
    ]  # fmt: skip
    coder = tmp_path / "coder.jinja"
    coder.write_text(
        "<tool_call>\n<function={{ name }}>\n<parameter=x>1</parameter>\n</function>\n</tool_call>"
    )
    features, _ = chat_features.resolve(settings(monkeypatch, CHAT_TEMPLATE=str(coder)))
    assert (features.tool_call_parser, features.reasoning_parser) == ("qwen3_coder", None)


def test_parsers_can_be_named_or_turned_off_and_a_typo_is_refused(monkeypatch):
    s = settings(
        monkeypatch, CHAT_TEMPLATE=str(TOOLS_TEMPLATE), TOOL_CALL_PARSER="NONE", REASONING_PARSER="none"
    )
    assert chat_features.resolve(s)[0].cli_args() == []
    s = settings(monkeypatch, TOOL_CALL_PARSER="qwen3_xml", REASONING_PARSER="deepseek_r1")
    features, problems = chat_features.resolve(s)
    assert problems == [] and (features.tool_call_parser, features.reasoning_parser) == (
        "qwen3_xml",
        "deepseek_r1",
    )
    _, problems = chat_features.resolve(
        settings(monkeypatch, TOOL_CALL_PARSER="hermess", REASONING_PARSER="qwen")
    )
    assert len(problems) == 2
    assert problems[0].startswith("QWEN4EXP_TOOL_CALL_PARSER='hermess'") and "hermes" in problems[0]
    assert problems[1].startswith("QWEN4EXP_REASONING_PARSER='qwen'") and "qwen3" in problems[1]


def test_extra_engine_flags_reach_vllms_parser(monkeypatch):
    s = settings(monkeypatch, ENGINE_ARGS="--max-num-batched-tokens 4096 --scheduling-policy=priority")
    argv = engine.cli_args(s, "cpu")
    assert argv[-3:] == ["--max-num-batched-tokens", "4096", "--scheduling-policy=priority"]
    args = engine.parse_args(argv)
    assert (args.max_num_batched_tokens, args.scheduling_policy) == (4096, "priority")
    assert args.max_logprobs == 20 and args.enable_prompt_tokens_details


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("--max-model-len 4096", "--max-model-len is set by the service: use QWEN4EXP_MAX_MODEL_LEN"),
        ("--kv_cache_dtype fp8", "--kv_cache_dtype is set by the service: use QWEN4EXP_KV_CACHE_DTYPE"),
        ("--tool-call-parser hermes", "use QWEN4EXP_TOOL_CALL_PARSER"),
        ("--additional-config {}", "the service writes vLLM's additional_config"),
        ("--port 9000", "use QWEN4EXP_PORT"),
        ("""--speculative-config '{"method": "ngram"}'""", "use QWEN4EXP_SPECULATIVE"),
        ("--max-num-batched-token 4096", "--max-num-batched-token is not a vLLM engine flag"),
        ("--chat-template 'unclosed", "No closing quotation"),
    ],
)
def test_extra_engine_flags_the_service_owns_or_vllm_lacks_are_refused(monkeypatch, value, said):
    with pytest.raises(SettingsError) as info:
        engine.cli_args(settings(monkeypatch, ENGINE_ARGS=value), "cpu")
    assert str(info.value).startswith("QWEN4EXP_ENGINE_ARGS=") and said in str(info.value)


def test_a_value_vllm_refuses_names_the_setting(monkeypatch, capsys):
    argv = engine.cli_args(settings(monkeypatch, ENGINE_ARGS="--max-num-batched-tokens many"), "cpu")
    with pytest.raises(SettingsError, match="QWEN4EXP_ENGINE_ARGS: vLLM's parser refused"):
        engine.parse_args(argv)
    assert "max-num-batched-tokens" in capsys.readouterr().err  # vLLM's own words, printed first
