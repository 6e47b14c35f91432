"""``model.runtime.detokenize_prime`` against vLLM's own detokenizer, on the CPU: primed with the prompt's
last tokens, ``FastIncrementalDetokenizer`` must produce the same text, step by step, as primed with
the whole prompt, for the kinds of decoder tokenizers has."""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from model.runtime import detokenize_prime
from model.tools.checkpoints import CORPUS, build_tokenizer

TEXT = "Grüße aus Köln: naïve café, 東京タワー, Ελληνικά, 🚀🦀 emoji and a zero-width joiner 👩‍💻. " + CORPUS


def _save(tok: tokenizers.Tokenizer, out, **special) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(out)


def _metaspace(out) -> None:
    """SentencePiece-style: spaces as "▁", the first word's space dropped when decoding."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    _save(tok, out, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _wordpiece(out) -> None:
    """BERT-style: "##" continuations, spaces before punctuation cleaned up when decoding."""
    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.NFD()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=True)
    trainer = trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    _save(tok, out, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


@pytest.fixture(scope="module", params=["byte_level", "metaspace", "wordpiece"])
def tokenizer(request, tmp_path_factory):
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine.detokenizer import uses_fast_detokenizer

    out = tmp_path_factory.mktemp(request.param)
    {"byte_level": lambda o: build_tokenizer(500, o), "metaspace": _metaspace, "wordpiece": _wordpiece}[
        request.param
    ](out)
    tok = get_tokenizer(str(out))
    assert uses_fast_detokenizer(tok), "the patched class is the one vLLM uses for this tokenizer"
    return tok


def _request(prompt: list[int] | None, skip_special_tokens: bool):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(max_tokens=64, skip_special_tokens=skip_special_tokens)
    return EngineCoreRequest("r", prompt, None, params, None, 0.0, None, None, None)


def _texts(tokenizer, request, generated: list[int], primed: bool) -> list[str]:
    """The text deltas a streaming client would get, one per generated token."""
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    detok = FastIncrementalDetokenizer.__new__(FastIncrementalDetokenizer)
    init = (
        FastIncrementalDetokenizer.__init__ if primed else FastIncrementalDetokenizer.qwen4exp_unprimed_init
    )
    init(detok, tokenizer, request)
    deltas = []
    for token in generated:
        detok.update([token], stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    return deltas + [detok.output_text]


def _cases(tokenizer) -> list[tuple[str, list[int], list[int]]]:
    """(name, prompt, generated): real text cut at many points (for the byte-level tokenizer some
    cuts fall inside a UTF-8 character), and random ids with special tokens among them."""
    rng = random.Random(0)
    ids = tokenizer.encode(TEXT * 3, add_special_tokens=False)
    cases = [(f"text cut at {cut}", ids[:cut], ids[cut : cut + 40]) for cut in range(150, 230, 3)]
    vocab = len(tokenizer)
    for n in range(40):  # about a fifth end inside a character with the byte-level tokenizer
        draw = [rng.randrange(vocab) for _ in range(rng.randrange(100, 400))]
        cases.append((f"random {n}", draw[:-30], draw[-30:]))
    cases.append(("shorter than the window", ids[:10], ids[10:40]))
    return cases


def test_install_is_idempotent():
    detokenize_prime.install()  # vLLM may already have loaded our plugin in this process
    assert detokenize_prime.install() is False
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    assert FastIncrementalDetokenizer.qwen4exp_unprimed_init is not FastIncrementalDetokenizer.__init__


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_tail_primed_text_equals_whole_prompt_primed(tokenizer, skip_special_tokens):
    detokenize_prime.install()
    differ = []
    for name, prompt, generated in _cases(tokenizer):
        request = _request(prompt, skip_special_tokens)
        whole = _texts(tokenizer, request, generated, primed=False)
        tail = _texts(tokenizer, request, generated, primed=True)
        if whole != tail:
            differ.append(f"{name}: {whole} != {tail}")
    assert not differ, "\n".join(differ)


def test_stream_gets_only_the_window_and_the_request_keeps_its_prompt(tokenizer, monkeypatch):
    detokenize_prime.install()
    real = tokenizers.decoders.DecodeStream
    primed_with = []

    def recording(ids=None, skip_special_tokens=False):
        primed_with.append(None if ids is None else list(ids))
        return real(ids=ids, skip_special_tokens=skip_special_tokens)

    # vLLM looks the class up on the module at each construction (detokenizer.py:192-195).
    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", recording)
    prompt = list(range(5, 5 + 3 * detokenize_prime.PRIME_TOKENS))
    request = _request(prompt, True)
    _texts(tokenizer, request, [7, 8], primed=True)
    assert primed_with == [prompt[-detokenize_prime.PRIME_TOKENS :]]
    assert request.prompt_token_ids == prompt
    primed_with.clear()
    _texts(tokenizer, request, [7], primed=False)
    assert primed_with == [prompt]  # what vLLM does unpatched: the control
    assert detokenize_prime.prime_window(None, tokenizer.decode) is None
    assert detokenize_prime.prime_window([1, 2], tokenizer.decode) == [1, 2]


def test_a_prompt_ending_inside_a_character_keeps_the_whole_prompt():
    """The exception in the module's docstring: there the stream would put prompt text into the
    first delta, by an amount that depends on the window, so vLLM's own priming is kept; a clean
    ending gets the window."""
    n = detokenize_prime.PRIME_TOKENS
    prompt = list(range(3, 3 + 2 * n))
    assert detokenize_prime.prime_window(prompt, lambda ids: "abc\ufffd") is prompt
    assert detokenize_prime.prime_window(prompt, lambda ids: "abc") == prompt[-n:]


def test_install_refuses_another_vllm(monkeypatch):
    import vllm
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    monkeypatch.delattr(FastIncrementalDetokenizer, "qwen4exp_primes_with_prompt_tail", raising=False)
    monkeypatch.setattr(FastIncrementalDetokenizer, "__init__", FastIncrementalDetokenizer.__init__)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.x.*this is vLLM 0\.33\.0"):
        detokenize_prime.install()


def test_the_plugin_installs_it_in_every_vllm_process(monkeypatch):
    """vLLM runs ``model.plugin.register`` in the API server too (``EngineArgs``), where the output
    processor detokenizes: the plugin is what installs the priming."""
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from model import plugin

    detokenize_prime.install()
    unprimed = FastIncrementalDetokenizer.qwen4exp_unprimed_init
    monkeypatch.setattr(FastIncrementalDetokenizer, "__init__", unprimed)  # as vLLM ships it
    monkeypatch.delattr(FastIncrementalDetokenizer, "qwen4exp_primes_with_prompt_tail")
    plugin.register()
    assert FastIncrementalDetokenizer.qwen4exp_primes_with_prompt_tail
    assert FastIncrementalDetokenizer.__init__ is not unprimed


def test_install_refuses_a_changed_constructor(monkeypatch):
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    monkeypatch.delattr(FastIncrementalDetokenizer, "qwen4exp_primes_with_prompt_tail", raising=False)
    monkeypatch.setattr(
        FastIncrementalDetokenizer, "__init__", lambda self, tokenizer, request, extra=None: None
    )
    with pytest.raises(
        RuntimeError, match=r"changed its parameters: re-check model/runtime/detokenize_prime\.py"
    ):
        detokenize_prime.install()
