"""One reader of a checkpoint's PLE table format: the planner refuses exactly what the loader
refuses (and the quantizer too), for every kind of ``ple_embedding_dtype`` value.

Each case writes the real-size example config.json with the value and reads it the three ways
the code does: the loader's (the HF config object vLLM builds, read by the function the PLE
layer calls at construction), the quantizer's (``model.tools.ple_quantize.table_format`` on the
directory) and the planner's (``python -m model.tools.planner``'s ``make_plan`` on the file).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.ple import format as ple_format
from model.ple import vllm_table as ple_table
from model.tools import planner, ple_quantize
from tests.deploy.tools import EXAMPLE_CONFIG

ABSENT = object()

# (value written to config.json, format every reader must return, or None: every reader refuses)
CASES = [
    ("bf16", "bf16"),
    (ABSENT, "bf16"),
    ("fp8_e4m3", "fp8_e4m3"),
    ("nvfp4", "nvfp4"),
    ("fp8", None),  # E4M3 or E5M2? Decoding with the wrong one is silently wrong.
    ("garbage", None),
    (8, None),
    (["fp8_e4m3"], None),
    ({"dtype": "nvfp4"}, None),
]


def _checkpoint(tmp_path: Path, value) -> Path:
    """A checkpoint directory holding the real-size example config.json with ``value`` set."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = json.loads(EXAMPLE_CONFIG.read_text())
    config.pop("ple_embedding_dtype", None)
    if value is not ABSENT:
        config["ple_embedding_dtype"] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def _outcome(read) -> str:
    try:
        return read()
    except ValueError as exc:
        return f"refused: {exc}"


def test_the_loader_and_the_planner_use_the_one_reader():
    assert ple_table.table_format_of is ple_format.table_format_of
    assert planner.table_format_of is ple_format.table_format_of


@pytest.mark.parametrize(
    ("value", "expected"), CASES, ids=[repr(v) if v is not ABSENT else "absent" for v, _ in CASES]
)
def test_every_reader_accepts_and_refuses_the_same(tmp_path: Path, value, expected):
    from transformers import AutoConfig

    ckpt = _checkpoint(tmp_path, value)
    hf_config = AutoConfig.from_pretrained(ckpt)  # what vLLM hands the model
    loader = _outcome(lambda: ple_table.table_format_of(hf_config))
    quantizer = _outcome(lambda: ple_quantize.table_format(ckpt))

    def plan() -> str:
        machine = planner.Machine(gpus=4, gpu_mem_gib=23.7, host_ram_gib=128)
        return planner.make_plan(ckpt / "config.json", machine, planner.Options()).ple_format

    planned = _outcome(plan)
    assert loader == quantizer == planned, (loader, quantizer, planned)
    if expected is None:
        assert loader.startswith("refused: config.json ple_embedding_dtype = ")
        assert "is not a PLE table format" in loader
    else:
        assert loader == expected


def test_the_planner_cli_names_the_field(tmp_path: Path, capsys):
    ckpt = _checkpoint(tmp_path, "fp8")
    assert planner.main([str(ckpt / "config.json"), "--gpus", "4"]) == 2
    assert "config.json ple_embedding_dtype = 'fp8' is not a PLE table format" in capsys.readouterr().err
