"""A broken checkpoint stops the engine with a message that names the tensor or field and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import ensure_checkpoint
from tests.vllm_greedy import start_and_stop

SHARD = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_{}.weight"


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(ensure_checkpoint("tiny"), dst)
    return dst


def _edit_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _fails_with(path: Path, capfd, *fragments: str) -> None:
    with pytest.raises(Exception) as info:  # noqa: PT011 - the engine wraps worker errors
        start_and_stop(path)
    out, err = capfd.readouterr()
    text = f"{info.value}\n{out}\n{err}"
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in the start-up error:\n{text[-3000:]}"


def test_missing_ple_shard(tmp_path, capfd):
    path = _copy(tmp_path)
    _edit_weights(path, lambda t: t.pop(SHARD.format(2)))
    _fails_with(path, capfd, "missing PLE table shards [2]", "split_ngram_parts")


def test_hash_buffer_mismatch_and_bad_shard_shape(tmp_path, capfd):
    path = _copy(tmp_path)
    name = "model.layers.1.ple.ple_embedding.layer_multipliers"

    def edit(tensors):
        tensors[name] = tensors[name] + 2

    _edit_weights(path, edit)
    _fails_with(path, capfd, name, "does not match the hash layout derived from the config")

    path = _copy(tmp_path / "second")
    _edit_weights(path, lambda t: t.__setitem__(SHARD.format(0), t[SHARD.format(0)][:-8].clone()))
    _fails_with(path, capfd, SHARD.format(0), "does not match the config")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"indexer_budget": 18}, "indexer_budget must be divisible by indexer_compress_ratio"),
        ({"indexer_head_dim": None}, "QSA config is missing required fields"),
        ({"indexer_kv_heads": 2}, "requires indexer_kv_heads=1"),
    ],
)
def test_qsa_config_rejected(tmp_path, capfd, changes, message):
    path = _copy(tmp_path)
    _edit_config(path, **changes)
    _fails_with(path, capfd, message)


def test_unbroken_copy_starts(tmp_path):
    """The copies above differ from a working checkpoint only by the injected fault."""
    path = _copy(tmp_path)
    _edit_weights(path, lambda t: None)
    start_and_stop(path)
