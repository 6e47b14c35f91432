"""A quantized/twin divergence is accepted at a router top-k tie of the twin, and only there.

``tests.quant.parity.compare`` says why router ties matter (routing is discontinuous). These tests
check the margin against a router built to tie, the refusal of an ordinary divergence, and the
measured case that motivated it: ``qsa512``'s FP8-experts twin at ``chat`` token 3, where upstream's
Marlin experts and the twin's Triton experts choose different tokens on an H200, deterministically.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.tools.quantize import convert_checkpoint
from tests.conftest import ensure_checkpoint
from tests.parity.prompts import parity_prompts

from .parity import ROUTER_TIE_LOGITS, RouterTies, compare


def _diverging(token: int, other: int) -> tuple[dict, dict]:
    """``got``/``want`` for four prompts: ``p``'s first token differs, the twin preferring its own
    by more than any output near-tie (``other`` is outside its top 5); the other three agree (one
    tie in four prompts is within ``compare``'s "too undecided" limit)."""
    want = {"p": ([token], [{token: -0.1, 7: -1.0}])}
    got = {"p": ([other], [{other: -0.1}])}
    for name in ("a", "b", "c"):
        want[name] = got[name] = ([3], [{3: -0.2}])
    return got, want


@pytest.fixture(scope="module")
def tied_tiny(tmp_path_factory):
    """``tiny`` with every row of layer 0's router equal: all its logits tie at every position."""
    src = ensure_checkpoint("tiny")
    out = tmp_path_factory.mktemp("tied") / "tiny-tied"
    shutil.copytree(src, out)
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(weights)
    name = "model.layers.0.mlp.gate.weight"
    tensors[name] = tensors[name][:1].expand_as(tensors[name]).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    return out


def test_router_tie_explains_a_divergence(tied_tiny):
    margin, layer = RouterTies(tied_tiny).margin([5, 6, 7])
    assert margin == 0.0 and layer == "model.layers.0.mlp.gate", (margin, layer)
    got, want = _diverging(11, 12)
    assert compare(got, want, prompts={"p": [5, 6, 7]}, twin=tied_tiny) == []


def test_divergence_without_a_tie_is_a_problem():
    tiny = ensure_checkpoint("tiny")
    margin, _ = RouterTies(tiny).margin([5, 6, 7])
    assert margin >= ROUTER_TIE_LOGITS, f"tiny itself ties at this position ({margin}); pick another"
    got, want = _diverging(11, 12)
    for kwargs in ({}, {"prompts": {"p": [5, 6, 7]}, "twin": tiny}):
        (problem,) = compare(got, want, **kwargs)
        assert "token 0 differs (twin prefers its token by" in problem


def test_fp8_experts_chat_token_3_is_a_router_tie(tmp_path):
    from transformers import AutoTokenizer

    twin = convert_checkpoint(
        ensure_checkpoint("qsa512"),
        tmp_path / "deq",
        "fp8-block",
        scope="experts",
        scales="pow2",
        dequantized=True,
    )
    chat = parity_prompts(AutoTokenizer.from_pretrained(twin))["chat"]
    # The twin's first three tokens on the H200 (upstream, Triton experts), equal in both engines.
    margin, layer = RouterTies(twin).margin(chat + [284, 315, 455])
    assert margin < ROUTER_TIE_LOGITS, (margin, layer)
    assert torch.isfinite(torch.tensor(margin))
