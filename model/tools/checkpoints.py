"""Deterministic small Qwen4-Exp checkpoints in the real Hugging Face format.

No real checkpoint can be downloaded here, so tests, benchmarks and the quick start use small
models built with transformers' own Qwen4-Exp classes and saved with ``save_pretrained`` (PLE
tables in ``ngram_embedding.shard_{i}`` files, hash buffers, per-expert weights), plus a
byte-level BPE tokenizer trained locally with a ChatML chat template and an EOS token.

Usage: ``python -m model.tools.checkpoints --preset tiny --out checkpoints/tiny``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

PRESETS: dict[str, dict] = {
    # The quick-start and test default (~2M parameters): 3 GDN layers + 1 QSA layer, 2 PLE layers.
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        hc_count=2,
        hc_lowrank=16,
        ple_layer_ids=[1, 2],
        ple_embed_dim=128,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=4,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=64,
        indexer_budget=16,
        indexer_compress_ratio=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # Different shapes everywhere, so no code depends on one: 8 layers (2 QSA), 4 streams,
    # 3 PLE layers with 4-grams, GQA 4:1 with partial RoPE, a larger budget and compression,
    # sigmoid output gate, PLE shards of unequal size.
    "wide": dict(
        vocab_size=512,
        hidden_size=192,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=64,
        hc_count=4,
        hc_lowrank=24,
        ple_layer_ids=[1, 2, 5],
        ple_embed_dim=192,
        ngram_size=4,
        heads_per_ngram=2,
        ngram_vocab_size_base=1500,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=3,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=96,
        indexer_budget=32,
        indexer_compress_ratio=8,
        output_gate_type="sigmoid",
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    ),
    # A QSA indexer of real shape and nothing else big, to compare our engine with vLLM's own
    # CUDA Qwen4Exp: budget 2048 / ratio 4 = 512 selected blocks (upstream's top-k kernels take
    # only 512, 1024 or 2048), a 128-dim index head with 64 rotary dims (upstream's fused
    # pre-indexer shape), 8 layers (2 QSA), 4 streams. output_gate_type is written out because
    # upstream rejects null; "silu" is what transformers uses for null (hidden_act), so both
    # implementations compute the same model. 64k positions, so 32k-token prompts need no override.
    "qsa512": dict(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        hc_count=4,
        hc_lowrank=32,
        ple_layer_ids=[1, 2],
        ple_embed_dim=256,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=4,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=128,
        indexer_budget=2048,
        indexer_compress_ratio=4,
        output_gate_type="silu",
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    ),
}

# The real Qwen4-Exp's per-token compute (transformers' config defaults: hidden 2048, 40 layers of
# which every 4th is QSA, 16/2 heads of 256, GDN 16/32 heads of 128, top-10 experts of width 512 plus
# a shared one, low-rank 320 hyper-connections) on qsa512's indexer, vocabulary and PLE vocabulary,
# with 16 experts instead of 512: ~4B parameters (~8 GB bf16), ~3.3B active. For timing only (random
# weights, ``--train-steps 0 --device cuda`` draws them on a GPU in a minute): a prefill that costs
# what the real model's does, which qsa512 (hidden 256, 8 layers) is too small to show. The real 16
# index heads (upstream's indexer prefill runs them with a tile sized for the GPU,
# model.upstream.indexer_tiles). RoPE on a quarter of
# the 256-wide heads, 64 dimensions: what transformers' rotary embedding assumes (its default MRoPE
# sections [11, 11, 10] interleave 32 frequency pairs, ``modeling_qwen4_exp.py`` Qwen4ExpTextRotaryEmbedding)
# and what upstream's fused QSA prepare is written for; keeping qsa512's factor 0.5 on 256-wide heads
# (128 dimensions) sends every indexer through upstream's unfused prepare.
PRESETS["real-compute"] = {
    **PRESETS["qsa512"],
    **dict(
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=16,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        hc_lowrank=320,
        ple_embed_dim=2048,
        heads_per_ngram=8,
        indexer_n_heads=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
    ),
}

# The shape on which the CUDA default was once found twice as far from float32 as ours: odd stream
# count, many experts, PLE on three layers, two index heads, a 1024-token budget at ratio 2, RoPE on
# a quarter of 128-wide heads (32 dimensions) and a null output gate.
PRESETS["holdout"] = {
    **PRESETS["qsa512"],
    **dict(
        hc_count=3,
        num_experts=24,
        num_experts_per_tok=4,
        ple_layer_ids=[1, 2, 5],
        ple_embed_dim=240,
        ngram_size=4,
        indexer_n_heads=2,
        indexer_budget=1024,
        indexer_compress_ratio=2,
        output_gate_type=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
    ),
}

# The real model's shape (deploy/qwen4-exp-config.example.json: transformers' defaults with 16 index
# heads of 128, budget 2048 / ratio 4, a null output gate, 512 experts) cut to 4 layers (3 GDN + 1
# QSA) with the checkpoints' small vocabulary and PLE vocabulary, so transformers can be the float32
# reference on one GPU: ~13 GB in bf16.
PRESETS["real-4layer"] = {
    **PRESETS["real-compute"],
    **dict(
        num_hidden_layers=4,
        num_experts=512,
        ple_layer_ids=[2],
        make_ngram_vocab_size_divisible_by=128,
        indexer_n_heads=16,
        output_gate_type=None,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
}


# The real model as one rank of TP=4 computes it, for timing on one GPU (random weights drawn there:
# ``--train-steps 0 --device cuda``): the per-rank attention (4 query heads, 1 KV head) and GDN heads
# (4 key, 8 value), all 512 experts and the shared expert at a quarter of their width, the 16
# replicated index heads, 40 layers, the real hyper-connections and PLE dimensions with a smaller
# n-gram vocabulary, and the vocabulary shard of the LM head (248,320 / 4).
PRESETS["real-rank"] = {
    **PRESETS["real-4layer"],
    **dict(
        vocab_size=62080,
        num_hidden_layers=40,
        num_attention_heads=4,
        num_key_value_heads=1,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        ple_layer_ids=[2],
        ngram_vocab_size_base=100000,
    ),
}


# Fidelity shapes: random-weight checkpoints of shapes unlike the presets above, so that no path is
# only ever checked on shapes it was developed on. ``drawn-<seed>`` names one; each seed varies the
# hyper-connection count (odd counts included), the expert count and top-k, which layers carry PLE
# and its n-gram size, index heads, QSA budget and compression, the RoPE fraction and head size, and
# the GDN output gate (null included: transformers reads it as ``hidden_act``).
DRAWN_PREFIX = "drawn-"


def drawn_shape(seed: int) -> dict:
    """The ``drawn-<seed>`` preset: a valid Qwen4-Exp text config of small width and random shape."""
    import random

    rng = random.Random(seed)
    layers = rng.choice([4, 8])
    gdn_layers = [i + 1 for i in range(layers) if (i + 1) % 4]  # every 4th layer is QSA
    ratio = rng.choice([2, 4, 8])
    top_k_blocks = rng.choice([512, 1024])  # upstream's QSA top-k kernels take 512, 1024 or 2048 blocks
    head_dim = rng.choice([128, 256])
    rope = rng.choice([0.25, 0.5])
    experts = rng.choice([8, 12, 24])
    return dict(
        vocab_size=512,
        hidden_size=rng.choice([192, 256]),
        num_hidden_layers=layers,
        num_attention_heads=rng.choice([2, 4]),
        num_key_value_heads=1,
        head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=rng.choice([2, 4]),
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=experts,
        num_experts_per_tok=rng.choice([2, 3, 4]),
        moe_intermediate_size=128,
        shared_expert_intermediate_size=rng.choice([64, 128]),
        hc_count=rng.choice([2, 3, 4]),
        hc_lowrank=rng.choice([16, 32]),
        ple_layer_ids=sorted(rng.sample(gdn_layers, min(len(gdn_layers), rng.choice([1, 2, 3])))),
        ple_embed_dim=192,  # divisible by 2, 4 and 6 n-gram heads
        ngram_size=rng.choice([2, 3, 4]),
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=2,
        indexer_n_heads=rng.choice([1, 2, 4, 16]),
        indexer_kv_heads=1,
        indexer_head_dim=128,
        indexer_budget=top_k_blocks * ratio,
        indexer_compress_ratio=ratio,
        output_gate_type=rng.choice([None, "silu", "sigmoid"]),
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": rope},
    )


def preset_spec(name: str) -> dict:
    """A preset's config fields: one of :data:`PRESETS`, or ``drawn-<seed>`` (:func:`drawn_shape`)."""
    if name.startswith(DRAWN_PREFIX) and name[len(DRAWN_PREFIX) :].isdigit():
        return drawn_shape(int(name[len(DRAWN_PREFIX) :]))
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: use one of {sorted(PRESETS)} or {DRAWN_PREFIX}<seed>")
    return dict(PRESETS[name])


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Serving large language models needs memory for weights, for the key value cache and for activations.
Four graphics cards share the work: each holds a slice of every matrix and they sum their results.
Linear attention keeps a fixed size state per request, while full attention keeps every past key.
Sparse attention picks the most useful blocks of keys for each query and skips the rest.
Hashed n-gram tables add lexical memory to the model without making every layer wider.
The cache stores eight bit floating point numbers with a scale chosen from calibration data.
Once upon a time there was a small model that learned to count: one, two, three, four, five, six.
Hello! How are you today? I am fine, thank you. What is the weather like? It is sunny and warm.
def add(a, b): return a + b. for i in range(10): print(i). import torch; x = torch.zeros(4, 4).
"""


def build_tokenizer(vocab_size: int, out: Path, corpus: str = "") -> dict[str, int]:
    """Train a byte-level BPE on the built-in corpus (and ``corpus``, text a checkpoint must
    encode in few tokens) and save it with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4 + [corpus] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out)
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every parameter a non-trivial value.

    transformers initialises zero-centred norms and the PLE conv to zero, which would leave
    those code paths untested; larger random weights also make greedy decoding decisive.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log") or name.endswith("dt_bias"):
                continue
            noise = torch.randn(param.shape, generator=generator, device=generator.device)
            if param.ndim == 1:
                param.copy_(0.2 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def _dense_indexer_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values):
    """The indexer's mask when every visible token is selected (true whenever seq_len <= budget)."""
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


def adam_steps(model, batch: Callable[[], dict], steps: int, stop_below: float = 0.0) -> list[float]:
    """Up to ``steps`` AdamW steps (lr 3e-3) on ``batch()``'s model inputs, the losses; stops once a
    loss is below ``stop_below``. The reference indexer runs as its dense equivalent
    (:func:`_dense_indexer_forward`): callers keep every sequence within the QSA budget, where the
    indexer selects every visible token, so the model is unchanged and its per-query Python loop
    does not dominate a CPU training step."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as reference

    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    original = reference.Qwen4ExpTextQSAIndexer.forward
    reference.Qwen4ExpTextQSAIndexer.forward = _dense_indexer_forward
    losses: list[float] = []
    try:
        model.train()
        for _ in range(steps):
            loss = model(**batch()).loss
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
            if losses[-1] < stop_below:
                break
    finally:
        reference.Qwen4ExpTextQSAIndexer.forward = original
        model.eval()
    return losses


def train_briefly(model, tokenizer, steps: int, seq_len: int, seed: int) -> list[float]:
    """A few hundred Adam steps on the built-in corpus, so greedy decoding is decisive.

    Random weights give nearly flat next-token distributions, where bf16 rounding alone flips the
    argmax and a token-for-token comparison says nothing. Training windows are no longer than the
    QSA budget (see :func:`adam_steps`).
    """
    ids = torch.tensor(tokenizer(CORPUS * 4)["input_ids"])
    gen = torch.Generator().manual_seed(seed)

    def windows() -> dict:
        starts = torch.randint(0, ids.numel() - seq_len - 1, (16,), generator=gen)
        batch = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
        return {"input_ids": batch, "labels": batch}

    return adam_steps(model, windows, steps)


# Training windows never exceed the QSA budget (see ``train_briefly``) nor this length: the corpus
# is ~1.5k tokens, so a 2048-token budget (``qsa512``) would not fit one window, and 128-token
# windows keep a CPU training step of ``qsa512`` at ~4 s on 2 cores.
MAX_TRAIN_SEQ_LEN = 128


def text_config(spec: dict, out: Path, corpus: str = ""):
    """The transformers config and generation config of a checkpoint of ``spec`` (preset fields)
    in ``out``, whose tokenizer this writes there (trained with ``corpus`` too): the special
    tokens' ids come from it."""
    from transformers import GenerationConfig, Qwen4ExpTextConfig

    ids = build_tokenizer(spec["vocab_size"] - 12, out, corpus)
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = Qwen4ExpTextConfig(
        **spec, eos_token_id=eos, pad_token_id=pad, bos_token_id=None, tie_word_embeddings=False
    )
    return config, GenerationConfig(eos_token_id=eos, pad_token_id=pad)


INITS = ("random", "transformers")


def make_checkpoint(
    preset: str,
    out: str | Path,
    seed: int = 0,
    train_steps: int = 80,
    device: str = "cpu",
    init: str = "random",
) -> Path:
    """Build, optionally train, and save ``preset``. ``device`` only decides where the random
    weights are drawn (a GPU makes a multi-billion-parameter timing checkpoint in seconds); the
    same seed gives other weights on another device, and training runs on the CPU only.

    ``init``: ``random`` redraws every parameter (:func:`_randomize`); ``transformers`` keeps
    transformers' own initialisation (small weights, zero-centred norms, a zero PLE conv), whose
    flat distributions put MoE routers and outputs near ties: what a fidelity judge must face."""
    if init not in INITS:
        raise ValueError(f"init {init!r}: use one of {INITS}")
    from transformers import Qwen4ExpForCausalLM

    if train_steps and device != "cpu":
        raise ValueError(f"--train-steps {train_steps} with --device {device}: training runs on the CPU only")

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config, generation = text_config(preset_spec(preset), out)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen4ExpForCausalLM(config)
    if init == "random":
        _randomize(model, torch.Generator(device=device).manual_seed(seed))
    if train_steps:
        from transformers import AutoTokenizer

        losses = train_briefly(
            model,
            AutoTokenizer.from_pretrained(out),
            train_steps,
            min(config.indexer_budget, MAX_TRAIN_SEQ_LEN),
            seed,
        )
        print(f"trained {train_steps} steps: loss {losses[0]:.2f} -> {sum(losses[-10:]) / 10:.2f}")
    model = model.to(torch.bfloat16)
    model.generation_config = generation
    model.save_pretrained(out)
    (out / "PRESET").write_text(
        json.dumps(
            {"preset": preset, "seed": seed, "train_steps": train_steps, "device": device, "init": init}
        )
        + "\n"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)} or {DRAWN_PREFIX}<seed>")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-steps", type=int, default=80)
    parser.add_argument("--device", default="cpu", help="where random weights are drawn (0 train steps)")
    parser.add_argument("--init", default="random", choices=INITS, help="see make_checkpoint")
    args = parser.parse_args()
    print(make_checkpoint(args.preset, args.out, args.seed, args.train_steps, args.device, args.init))


if __name__ == "__main__":
    main()
