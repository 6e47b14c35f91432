"""Tool calls and reasoning: which of vLLM's parsers read this model's output, decided from its chat template.

Why from the template: a tool-call parser must match the syntax the template teaches the model
(Qwen templates wrap JSON calls in ``<tool_call>`` tags, read by vLLM's ``hermes`` parser; the
coder templates write ``<function=name><parameter=...>`` XML, read by ``qwen3_coder``), and a
reasoning parser only makes sense where the template opens a ``<think>`` block. ``auto`` reads the
template the engine will use (``QWEN4EXP_CHAT_TEMPLATE``, else the checkpoint's
``chat_template.jinja`` or ``tokenizer_config.json``), and takes a reasoning parser only where the
tokenizer has ``<think>`` and ``</think>`` as tokens; ``none`` turns a parser off; any other value
must be a name vLLM registers, checked here so a typo fails at start-up naming the variable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .settings import ServiceSettings

# Template marker -> vLLM parser, first match wins (the XML form also uses <tool_call> tags).
TOOL_SYNTAX = (("<function=", "qwen3_coder"), ("<tool_call>", "hermes"))
THINKING_MARKER, REASONING_PARSER = "<think>", "qwen3"
THINKING_TOKENS = ("<think>", "</think>")


@dataclass(frozen=True)
class ChatFeatures:
    """The parsers the engine's OpenAI layer is given (None: off), and why."""

    tool_call_parser: str | None
    reasoning_parser: str | None
    notes: tuple[str, ...]

    def cli_args(self) -> list[str]:
        argv = []
        if self.tool_call_parser is not None:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser is not None:
            argv += ["--reasoning-parser", self.reasoning_parser]
        return argv


def chat_template_text(settings: ServiceSettings) -> str | None:
    """The chat template the engine will apply, as text (None: the checkpoint has none)."""
    if settings.chat_template is not None:
        return settings.chat_template.read_text()
    jinja = Path(settings.model) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = Path(settings.model) / "tokenizer_config.json"
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(template, list):  # named templates: the default one is what chat uses
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def single_tokens(settings: ServiceSettings, texts: tuple[str, ...]) -> bool:
    """Whether every one of ``texts`` is one token of the checkpoint's tokenizer. vLLM's reasoning
    parsers find the end of a thinking block by its token id: without one the block never ends for
    them, and structured output and forced tool calls, which start after it, would never apply."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(settings.model))
    except Exception:  # noqa: BLE001 - vLLM reports an unreadable tokenizer itself, with its reason
        return False
    ids = tokenizer.convert_tokens_to_ids(list(texts))
    return all(isinstance(i, int) and i != tokenizer.unk_token_id for i in ids)


def _registered() -> tuple[list[str], list[str]]:
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered()), sorted(ReasoningParserManager.list_registered())


def resolve(settings: ServiceSettings) -> tuple[ChatFeatures, list[str]]:
    """The parsers for ``settings`` and the problems (``QWEN4EXP_...: why; fix: how`` lines)."""
    template = chat_template_text(settings) or ""
    tools, reasonings = _registered()
    problems: list[str] = []
    notes: list[str] = []

    tool = settings.tool_call_parser
    if tool == "auto":
        tool = next((parser for marker, parser in TOOL_SYNTAX if marker in template), None)
        notes.append(
            f"tool calls: {tool} parser (from the chat template)"
            if tool
            else "tool calls: off (the chat template has no tool-call syntax; set QWEN4EXP_TOOL_CALL_PARSER)"
        )
    elif tool == "none":
        tool = None
    elif tool not in tools:
        problems.append(
            f"QWEN4EXP_TOOL_CALL_PARSER={tool!r}: vLLM has no such tool-call parser; fix: use auto, none "
            f"or one of {', '.join(tools)}"
        )
        tool = None

    reasoning = settings.reasoning_parser
    if reasoning == "auto":
        if THINKING_MARKER not in template:
            reasoning, why = None, "reasoning: off (the chat template has no thinking block)"
        elif not single_tokens(settings, THINKING_TOKENS):
            reasoning = None
            why = "reasoning: off (the chat template has a thinking block, but <think> and </think> are not tokens of this tokenizer)"
        else:
            reasoning, why = (
                REASONING_PARSER,
                "reasoning: qwen3 parser (the chat template has a thinking block)",
            )
        notes.append(why)
    elif reasoning == "none":
        reasoning = None
    elif reasoning not in reasonings:
        problems.append(
            f"QWEN4EXP_REASONING_PARSER={reasoning!r}: vLLM has no such reasoning parser; fix: use auto, "
            f"none or one of {', '.join(reasonings)}"
        )
        reasoning = None
    return ChatFeatures(tool, reasoning, tuple(notes)), problems
