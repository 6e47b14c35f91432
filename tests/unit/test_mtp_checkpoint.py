"""Generated checkpoints with MTP layers (``model.tools.mtp_checkpoints``) in the layout vLLM's own
Qwen4-Exp MTP drafter loads, and accepted for ``QWEN4EXP_SPECULATIVE=mtp``.

Why against vLLM's module rather than a list of names: the layout is whatever
``Qwen4ExpMTP.load_weights`` reads, and only building it and loading the checkpoint into it shows
that every parameter is filled from the intended tensors (packed q/k/v + indexer, per-expert stacks,
the hyper-connections' merged projection). The drafter cannot run forward on vLLM's CPU build (see
``tests/mtp_layout_probe.py``), so the forward composition is checked on the GPU, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from model.deployment import speculative as S
from model.tools import checkpoints, mtp_checkpoints
from tests.conftest import ROOT, pythonpath_with


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """``tiny`` with one MTP layer, two joint training steps (the loss path runs; weights stay random)."""
    return mtp_checkpoints.make_mtp_checkpoint("tiny", tmp_path_factory.mktemp("tiny-mtp1"), 1, train_steps=2)


def test_vllm_mtp_drafter_loads_every_parameter_from_the_mtp_layers(mtp_checkpoint):
    env = {**os.environ, "PYTHONPATH": pythonpath_with(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.mtp_layout_probe", str(mtp_checkpoint)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe["architectures"] == ["Qwen4ExpMTP"]
    assert probe["not_loaded"] == [] and probe["mismatched"] == []
    assert probe["checked"] == len(probe["params"])  # every parameter compared with its source
    layer = {n.removeprefix("model.layers.0.") for n in probe["params"] if n.startswith("model.layers.0.")}
    assert {"self_attn.qkv_proj.weight", "mlp.experts.routed_experts.w13_weight"} <= layer
    assert not any(n.startswith("model.layers.1.") for n in probe["params"])


def test_the_checkpoint_declares_its_mtp_layers_and_speculative_takes_mtp(mtp_checkpoint):
    config = json.loads((mtp_checkpoint / "config.json").read_text())
    assert config[mtp_checkpoints.MTP_FIELD] == 1 and S.mtp_layers(config) == 1
    assert S.mtp_tensors_present(mtp_checkpoint) is True
    on, note = S.choose("mtp", 1, (2, 4), implementation="upstream", config=config, has_mtp_weights=True)
    assert on == S.Speculative("mtp", 1) and "1 MTP layer(s)" in note
    auto, _ = S.choose("auto", 1, (2, 4), implementation="upstream", config=config, has_mtp_weights=True)
    assert auto == S.Speculative("mtp", 1)
    off, note = S.choose("mtp", 1, (2, 4), implementation="ours", config=config, has_mtp_weights=True)
    assert off is None and "does not load" in note and "serving without it" in note


def test_zero_mtp_layers_is_checkpoints_py_unchanged(monkeypatch, tmp_path):
    """Option off: the very function whose output the pinned checkpoints come from."""
    calls = []
    monkeypatch.setattr(checkpoints, "make_checkpoint", lambda *args: calls.append(args) or tmp_path)
    assert mtp_checkpoints.make_mtp_checkpoint("wide", tmp_path, 0, seed=3, train_steps=7) == tmp_path
    assert calls == [("wide", tmp_path, 3, 7, "cpu", "random")]
