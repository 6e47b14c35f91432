"""A fidelity case where rounding order decides: transformers' own initialisation, text that repeats.

``python -m tests.fidelity.repetitive_case OUT`` writes ``OUT/ckpt`` (config, bf16 weights, a
byte-level BPE tokenizer and chat template) and ``OUT/prompts.json`` (``{name: token ids}``).

The checkpoint is untrained, drawn by transformers' own initialiser (seed 11, ``initializer_range``
0.06): 8 layers of hidden 384, 3 hyper-connection streams, 24 experts of which 3 are chosen, PLE on
layers 1, 4 and 7, a sigmoid output gate, a quarter of each head rotated. Its next-token
distributions are flat and its MoE routers often sit near ties. The prompts are natural text that
repeats (3 to about 13,000 tokens): a near-tie at one position recurs at every copy, so a path that
rounds one operation differently from the reference there is wrong at every copy, not once.

On it, vLLM's own Qwen4-Exp with its hyper-connection gate mix rounded once in float32 sat twice as
far from float32 as transformers-bf16 and our implementation (docs/fidelity.md), which round after
every op; ``model/upstream/hc_mix.py`` is the served path's answer. The GPU fidelity judge
(``tests/gpu/test_fidelity_cuda.py``) runs it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CORPUS = (
    "the quick brown fox jumps over the lazy dog while numbers 0123456789 count and questions "
    "get answers about science math and code. a river runs past old stone walls; birds sing. "
) * 40
SEED = 11
LAYER_TYPES = [
    "linear_attention",
    "indexed_attention",
    "linear_attention",
    "linear_attention",
    "linear_attention",
    "indexed_attention",
    "linear_attention",
    "indexed_attention",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>'+m['role']+'\n'+m['content']+'<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)


def _tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([CORPUS], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return tok


def build_checkpoint(out: str | Path) -> Path:
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    out = Path(out)
    tok = _tokenizer(out)
    config = Qwen4ExpTextConfig(
        vocab_size=len(tok),
        hidden_size=384,
        num_hidden_layers=8,
        layer_types=LAYER_TYPES,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=32768,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=192,
        shared_expert_intermediate_size=256,
        num_experts=24,
        num_experts_per_tok=3,
        hc_count=3,
        hc_lowrank=24,
        ple_layer_ids=[1, 4, 7],
        ple_embed_dim=384,
        ngram_size=3,
        heads_per_ngram=3,
        ngram_vocab_size_base=3001,
        make_ngram_vocab_size_divisible_by=32,
        split_ngram_parts=3,
        seed=1234,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=128,
        indexer_budget=1024,
        indexer_compress_ratio=2,
        output_gate_type="sigmoid",
        initializer_range=0.06,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.25},
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(SEED)
    Qwen4ExpForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def prompts(checkpoint: str | Path) -> dict[str, list[int]]:
    """The case's prompts: a 3-token phrase, a chat turn, and the corpus repeated to ~600, ~2,500,
    ~6,000 tokens and, word order reversed, ~13,000 tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    words = CORPUS.split()
    texts = {
        "short": "a river runs past",
        "p600": " ".join(words[:600]),
        "p2500": " ".join((words * 4)[:2500]),
        "p6000": " ".join((words * 8)[:6000]),
        "p12000": " ".join((words[::-1] * 16)[:12000]),
    }
    out = {name: tok(text).input_ids for name, text in texts.items()}
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "tell me about the fox"}], add_generation_prompt=True, tokenize=False
    )
    out["chat"] = tok(chat).input_ids
    return out


def build(out: str | Path) -> tuple[Path, Path]:
    """The checkpoint and its prompts file under ``out``."""
    out = Path(out)
    ckpt = build_checkpoint(out / "ckpt")
    prompts_file = out / "prompts.json"
    prompts_file.write_text(json.dumps(prompts(ckpt)))
    return ckpt, prompts_file


if __name__ == "__main__":
    ckpt, prompts_file = build(sys.argv[1])
    print("checkpoint", ckpt, "prompts", prompts_file)
