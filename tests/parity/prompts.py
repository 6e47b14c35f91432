"""Prompts for the parity tests, as token ids, covering what can go wrong in serving.

Short prompts, prompts far longer than the QSA budget (so selection is really sparse), prompts
with EOS in the middle (PLE n-grams must not cross documents), a one-token prompt and lengths
around the compression ratio.
"""

from __future__ import annotations

from model.checkpoints import CORPUS

SENTENCES = [line.strip() for line in CORPUS.splitlines() if line.strip()]


def parity_prompts(tokenizer) -> dict[str, list[int]]:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    enc = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    long_text = " ".join(SENTENCES[i % len(SENTENCES)] for i in (3, 0, 5, 1, 7, 2, 9, 4))
    chat = enc(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello! How are you today?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
    )
    return {
        "one_token": enc("The")[:1],
        "short": enc("The quick brown fox"),
        "chat": list(chat),
        "ratio_edge": enc(SENTENCES[4])[:24],
        "long_sparse": enc(long_text),
        "very_long_sparse": enc(" ".join([long_text, long_text, SENTENCES[6]])),
        "eos_mid": enc(SENTENCES[0]) + [eos] + enc(SENTENCES[1]),
        "eos_many": enc("Hello!") + [eos, eos] + enc(SENTENCES[8]) + [eos] + enc("Once upon a time"),
    }
