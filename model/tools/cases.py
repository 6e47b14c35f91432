"""Inputs shared by the tests and the benchmarks: the parity prompts and the outlier checkpoint.

They live here, not in ``tests/``, so that ``bench/`` measures with the same inputs the tests judge
with without importing test code. Nothing here is used when serving.

* :func:`parity_prompts`: prompts as token ids covering what can go wrong in serving: short
  prompts, prompts far longer than the QSA budget (so selection is really sparse), prompts with EOS
  in the middle (PLE n-grams must not cross documents), a one-token prompt and lengths around the
  compression ratio.
* :func:`make_outlier_checkpoint`: the tiny checkpoint's K/V stay within a few units, where E4M3 at
  scale 1.0 is already about as precise as it gets (its precision is relative), so calibration
  barely matters there. Real models have K/V beyond +-448, which an uncalibrated cache clips. This
  reproduces that without changing the model's function: the V projections of the QSA layers are
  multiplied by ``2**9`` and their output projections divided by ``2**9``. Attention is linear in V
  and powers of two are exact in bf16, so the BF16 model computes the same logits, while its cached
  V values reach ~1,000.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from model.tools.checkpoints import CORPUS

SENTENCES = [line.strip() for line in CORPUS.splitlines() if line.strip()]
V_FACTOR = 2.0**9


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


def qsa_layer_indices(config: dict) -> list[int]:
    return [i for i, kind in enumerate(config["layer_types"]) if kind != "linear_attention"]


def make_outlier_checkpoint(src: Path, dst: Path, factor: float = V_FACTOR) -> Path:
    """A copy of ``src`` whose QSA V values exceed E4M3's range, with the same BF16 logits."""
    from safetensors.torch import load_file, save_file

    if (dst / "model.safetensors").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            shutil.copy2(item, dst / item.name)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    for i in qsa_layer_indices(config):
        v, o = f"model.layers.{i}.self_attn.v_proj.weight", f"model.layers.{i}.self_attn.o_proj.weight"
        tensors[v] = (tensors[v].float() * factor).to(tensors[v].dtype)
        tensors[o] = (tensors[o].float() / factor).to(tensors[o].dtype)
    save_file(
        {k: t.contiguous() for k, t in tensors.items()}, str(dst / "model.safetensors"), {"format": "pt"}
    )
    return dst
