"""A quantized/twin divergence is accepted at a router top-k tie of the twin, and only there.

``tests.quant.parity.compare`` says why router ties matter (routing is discontinuous). These tests
check the margin against a router built to tie, the refusal of an ordinary divergence, and a tie
built into the checkpoint of the case that motivated it (``qsa512``'s FP8-experts twin at ``chat``
token 3, where upstream's Marlin experts and the twin's Triton experts chose different tokens on an
H200), found at the layer it was built in.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.tools.checkpoints import make_checkpoint
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


def _router_ranking(path, ids: list[int], layer: int) -> tuple[list[int], int]:
    """Experts of ``layer``'s router ordered by logit at the last position of ``ids``, and its top-k."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    gate = model.get_submodule(f"model.layers.{layer}.mlp.gate")
    seen = {}

    def keep_input(_module, args, _out) -> None:
        seen.setdefault("x", args[0])

    handle = gate.register_forward_hook(keep_input)
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        handle.remove()
    x = seen["x"].reshape(-1, seen["x"].shape[-1])[-1].float()
    order = torch.argsort(x @ gate.weight.float().t(), descending=True)
    return order.tolist(), gate.top_k


def test_a_router_tie_built_into_an_fp8_experts_twin_is_found_at_its_layer(tmp_path):
    """On ``qsa512``'s FP8-experts twin (the case where upstream's Marlin experts and the twin's
    Triton experts chose different tokens on an H200): the router of layer 4 gets its k-th expert's
    row copied onto its (k+1)-th at ``chat`` + 3 tokens, so their logits tie there exactly; the
    margin search finds that tie at that layer, and ``compare`` accepts a divergence there. The
    tie is built, not found: a generated checkpoint's weights, and so its near-ties, differ
    between CPU kinds."""
    from transformers import AutoTokenizer

    source = make_checkpoint("qsa512", tmp_path / "qsa512", train_steps=0)  # the tie is built, not trained
    twin = convert_checkpoint(
        source,
        tmp_path / "deq",
        "fp8-block",
        scope="experts",
        scales="pow2",
        dequantized=True,
    )
    ids = parity_prompts(AutoTokenizer.from_pretrained(twin))["chat"] + [284, 315, 455]
    layer = 4
    order, top_k = _router_ranking(twin, ids, layer)
    (weights,) = twin.glob("*.safetensors")
    tensors = load_file(weights)
    name = f"model.layers.{layer}.mlp.gate.weight"
    tensors[name][order[top_k]] = tensors[name][order[top_k - 1]]
    save_file(tensors, weights, metadata={"format": "pt"})

    margin, where = RouterTies(twin).margin(ids)
    assert margin == 0.0 and where == f"model.layers.{layer}.mlp.gate", (margin, where)
    got, want = _diverging(11, 12)
    assert compare(got, want, prompts={"p": ids}, twin=twin) == []
