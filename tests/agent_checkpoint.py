"""A small checkpoint that calls tools and thinks: what the agent API's tests need from a model.

An untrained checkpoint emits no tool call and no thinking block of its own accord, so a test could
only check what the API forces. This one is ``tiny``'s shape with a tokenizer that has Qwen3's
``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and
``</tool_response>`` as tokens of their own (added, not special: they stay in decoded text, as in
Qwen3's tokenizer), the Qwen3-style template of ``tests/data/templates/qwen_tools_thinking.jinja``,
and weights trained on the CPU until greedy decoding writes the :data:`CONVERSATIONS` answers:

* asked for the weather in Paris or Oslo with the weather tool offered: a thinking block, then a
  call of ``get_weather`` with that city (the arguments come from the prompt, not from a constraint);
* given the tool's result: a thinking block, then the answer with the result's number;
* asked to say hello with no tools: a thinking block and a greeting; with thinking switched off
  (the template opens and closes the block itself), the greeting alone.

The answers are learnt by heart (the loss ends near zero), so greedy decoding is decisive on every
CPU kind although the weights differ between hosts. Each prompt is learnt under several renderings
of the tool list (one tool or two, either order), as clients and vLLM's Responses and Anthropic
adapters present it differently. Pinned as test data (``tests/data/checkpoints/agent``); without a
current pin, built once per machine under ``checkpoints/agent`` (about a minute on 2 cores) and
rebuilt when this file changes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tests" / "data" / "templates" / "qwen_tools_thinking.jinja"
AGENT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SEED = 5
STEPS = 400

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
TOOL_LISTS = ([WEATHER], [WEATHER, TIME], [TIME, WEATHER])


def ask(city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city}?"}]


def call(city: str) -> dict:
    return {
        "id": "call-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


CELSIUS = {"Paris": 21, "Oslo": 4}
REASONING = {
    "call": "The user wants the weather in {city}, so I call the tool.",
    "answer": "The tool answered for {city}.",
    "hello": "A greeting is asked for.",
}
GREETING = "Hello! How are you today?"


def answer(city: str) -> str:
    return f"It is {CELSIUS[city]} degrees in {city}."


def with_result(city: str) -> list[dict]:
    """The conversation after the call: the call and the tool's result."""
    return [
        *ask(city),
        {"role": "assistant", "content": None, "tool_calls": [call(city)]},
        {"role": "tool", "tool_call_id": "call-1", "content": json.dumps({"celsius": CELSIUS[city]})},
    ]


def think(text: str) -> str:
    return f"<think>\n{text}\n</think>\n\n"


def tool_call_text(city: str) -> str:
    return (
        '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps({"city": city}) + "}\n</tool_call>"
    )


def conversations() -> list[tuple[list[dict], list[dict] | None, bool, str]]:
    """(messages, tools, thinking switch, the answer to learn, end token included)."""
    out = []
    for city in CELSIUS:
        for tools in TOOL_LISTS:
            out.append(
                (ask(city), tools, True, think(REASONING["call"].format(city=city)) + tool_call_text(city))
            )
            out.append(
                (with_result(city), tools, True, think(REASONING["answer"].format(city=city)) + answer(city))
            )
    hello = [{"role": "user", "content": "Say hello."}]
    out.append((hello, None, True, think(REASONING["hello"]) + GREETING))
    out.append((hello, None, False, GREETING))
    return [(m, t, thinking, text + "<|im_end|>") for m, t, thinking, text in out]


def fingerprint() -> str:
    """Changes whenever this file, the template or the base shape's generator changes."""
    digest = hashlib.sha256()
    for path in (Path(__file__), TEMPLATE, ROOT / "model" / "tools" / "checkpoints.py"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build(out: Path) -> Path:
    """Write the checkpoint to ``out`` and check greedy decoding (transformers, float32) writes
    every answer: a checkpoint that does not is an error here, not a puzzle in the tests."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, Qwen4ExpForCausalLM

    from model.tools import checkpoints

    out.mkdir(parents=True, exist_ok=True)
    spec = checkpoints.preset_spec("tiny")
    spec["indexer_budget"] = 1024  # every prompt fits: the reference indexer's dense mask is exact
    # The BPE learns the template's and the answers' text too, so a prompt with two tools is a
    # few hundred tokens, not seven hundred: training is full-batch forward passes on the CPU.
    checkpoints.build_tokenizer(spec["vocab_size"] - 12, out)
    draft = AutoTokenizer.from_pretrained(out)
    texts = [
        render(draft, messages, tools, thinking) + target
        for messages, tools, thinking, target in conversations()
    ]
    config, generation = checkpoints.text_config(spec, out, corpus="\n".join(texts))
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in AGENT_TOKENS])
    tok.chat_template = TEMPLATE.read_text()
    if len(tok) > config.vocab_size:
        raise ValueError(f"{len(tok)} tokens do not fit tiny's vocabulary of {config.vocab_size}")
    tok.save_pretrained(out)

    examples = []
    for messages, tools, thinking, target in conversations():
        prompt = render(tok, messages, tools, thinking)
        prompt_ids = tok(prompt, add_special_tokens=False).input_ids
        target_ids = tok(target, add_special_tokens=False).input_ids
        examples.append((prompt_ids, target_ids))
    if max(len(p) + len(t) for p, t in examples) > spec["indexer_budget"]:
        raise ValueError("a training example exceeds the QSA budget")

    torch.manual_seed(SEED)
    model = Qwen4ExpForCausalLM(config)
    checkpoints._randomize(model, torch.Generator().manual_seed(SEED))
    losses = train(model, examples, tok.pad_token_id)
    print(f"agent checkpoint: {STEPS} steps, loss {losses[0]:.2f} -> {losses[-1]:.4f}")
    model = model.to(torch.bfloat16)
    check_greedy(model, examples, tok)
    model.generation_config = generation
    model.save_pretrained(out)
    (out / "FINGERPRINT").write_text(fingerprint() + "\n")
    return out


def render(tok, messages: list[dict], tools: list[dict] | None, thinking: bool) -> str:
    """The prompt text the template makes of a conversation, ending where the model answers."""
    return tok.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=thinking,
        chat_template=TEMPLATE.read_text(),
    )


def train(model, examples: list[tuple[list[int], list[int]]], pad: int) -> list[float]:
    """Full-batch Adam on the answers only (prompt positions masked out of the loss)."""
    from model.tools.checkpoints import adam_steps

    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.full((len(examples), width), pad)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (prompt, target) in enumerate(examples):
        seq = prompt + target
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(target)
        mask[row, : len(seq)] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return adam_steps(model, lambda: batch, STEPS, stop_below=1e-3)


def check_greedy(model, examples: list[tuple[list[int], list[int]]], tok) -> None:
    with torch.no_grad():
        for prompt, target in examples:
            got = model.generate(
                torch.tensor([prompt]), max_new_tokens=len(target), do_sample=False, eos_token_id=None
            )[0, len(prompt) :].tolist()
            if got != target:
                raise RuntimeError(
                    f"greedy decoding after training writes {tok.decode(got)!r}, not {tok.decode(target)!r}"
                )


def ensure(directory: Path | None = None) -> Path:
    """The pinned copy (``tests/data/checkpoints/agent``) while it matches this file, else the
    checkpoint under ``checkpoints/agent`` (or ``directory``), built if missing or stale.

    Pinned because training it is the slowest part of the agent tests' set-up (about a minute on 2
    cores); its answers are learnt by heart, so one host's weights serve every CPU kind. After a
    change here, ``python -m tests.agent_checkpoint tests/data/checkpoints/agent`` renews the pin
    (``tests/unit/test_pinned_checkpoints.py`` says when)."""
    from tests.conftest import CHECKPOINTS, PINNED

    pinned = PINNED / "agent"
    if directory is None and (pinned / "FINGERPRINT").exists():
        if (pinned / "FINGERPRINT").read_text().strip() == fingerprint():
            return pinned
    path = directory or CHECKPOINTS / "agent"
    stamp = path / "FINGERPRINT"
    if not (stamp.exists() and stamp.read_text().strip() == fingerprint()):
        build(path)
    return path


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
