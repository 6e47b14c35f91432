"""Loading PLE tables of every format through vLLM's loader; broken checkpoints fail with their message.

Most cases run in one subprocess that builds the real vLLM model for each checkpoint with
vLLM's own loader (``_load_harness``); two cases start a full engine to show that the error
stops ``LLM(...)`` at start-up with the same message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import pythonpath_with
from tests.net import free_port
from tests.vllm_greedy import start_and_stop

REPO = Path(__file__).resolve().parents[2]
TABLE0 = "model.layers.0.ple.ple_embedding"
SHARD = TABLE0 + ".ngram_embedding.shard_{}"
ENV_VARS = ("VLLM_PLE_CPU_OFFLOAD", "VLLM_PLE_PREFETCH")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


# Each broken case: (name, builder(checkpoints, tmp) -> path, env, fragments the error must contain).
def _broken_cases(ck: dict[str, Path], tmp: Path) -> list[tuple[str, Path, dict, list[str]]]:
    def fp8(name: str) -> Path:
        return _copy(ck["fp8_e4m3"], tmp / name)

    def nvfp4(name: str) -> Path:
        return _copy(ck["nvfp4"], tmp / name)

    def scale_differs(t):
        t[SHARD.format(2) + ".weight_global_scale"] = t[SHARD.format(2) + ".weight_global_scale"] * 2

    def unpacked(t):
        w = t[SHARD.format(1) + ".weight"]
        t[SHARD.format(1) + ".weight"] = torch.cat([w, w], dim=1)

    return [
        (
            "fp8_missing_global_scale",
            _edit_weights(fp8("a"), lambda t: t.pop(SHARD.format(1) + ".weight_global_scale")),
            {},
            [
                "checkpoint is missing " + SHARD.format(1) + ".weight_global_scale",
                "python -m model.tools.ple_quantize",
            ],
        ),
        (
            "fp8_global_scales_differ",
            _edit_weights(fp8("b"), scale_differs),
            {},
            [SHARD.format(2) + ".weight_global_scale", "differs from " + SHARD.format(0), "one global scale"],
        ),
        (
            "fp8_global_scale_not_positive",
            _edit_weights(fp8("c"), lambda t: t[SHARD.format(0) + ".weight_global_scale"].zero_()),
            {},
            [SHARD.format(0) + ".weight_global_scale = 0.0", "finite and positive"],
        ),
        (
            "fp8_global_scale_wrong_shape",
            _edit_weights(
                fp8("d"), lambda t: t.__setitem__(SHARD.format(0) + ".weight_global_scale", torch.ones(2))
            ),
            {},
            [SHARD.format(0) + ".weight_global_scale", "one fp32 value"],
        ),
        (
            "fp8_rows_wrong_shape",
            _edit_weights(
                fp8("e"),
                lambda t: t.__setitem__(SHARD.format(3) + ".weight", t[SHARD.format(3) + ".weight"][:-8]),
            ),
            {},
            [SHARD.format(3) + ".weight: shape (1008, 32) does not match the config (1016 rows"],
        ),
        (
            "config_fp8_but_bf16_tables",
            _edit_config(_copy(ck["bf16"], tmp / "f"), ple_embedding_dtype="fp8_e4m3"),
            {},
            [
                SHARD.format(0) + ".weight is torch.bfloat16",
                "ple_embedding_dtype='fp8_e4m3' expects uint8 E4M3 codes",
                "python -m model.tools.ple_quantize --format fp8_e4m3",
            ],
        ),
        (
            "quantized_tables_without_config",
            _edit_config(fp8("g"), ple_embedding_dtype=None),
            {},
            [SHARD.format(0) + ".weight is torch.uint8", "set ple_embedding_dtype"],
        ),
        (
            "nvfp4_missing_block_scales",
            _edit_weights(nvfp4("h"), lambda t: t.pop(SHARD.format(3) + ".weight_scale")),
            {},
            ["checkpoint is missing " + SHARD.format(3) + ".weight_scale", "block scales"],
        ),
        (
            "nvfp4_block_scales_wrong_shape",
            _edit_weights(
                nvfp4("i"),
                lambda t: t.__setitem__(
                    SHARD.format(0) + ".weight_scale", t[SHARD.format(0) + ".weight_scale"][:, :1]
                ),
            ),
            {},
            [SHARD.format(0) + ".weight_scale is torch.uint8 (1016, 1)", "of shape (1016, 2)"],
        ),
        (
            "nvfp4_rows_not_packed",
            _edit_weights(nvfp4("j"), unpacked),
            {},
            [SHARD.format(1) + ".weight: shape (1016, 32)", "packed: two 4-bit codes per byte"],
        ),
        (
            "block_scales_in_fp8_table",
            _edit_weights(
                fp8("k"),
                lambda t: t.__setitem__(
                    SHARD.format(0) + ".weight_scale", torch.zeros(1016, 2, dtype=torch.uint8)
                ),
            ),
            {},
            [SHARD.format(0) + ".weight_scale holds NVFP4 block scales", "ple_embedding_dtype='fp8_e4m3'"],
        ),
        (
            "unknown_table_format",
            _edit_config(_copy(ck["bf16"], tmp / "l"), ple_embedding_dtype="int4"),
            {},
            ["config.json ple_embedding_dtype = 'int4' is not a PLE table format", "nvfp4"],
        ),
        (
            "malformed_offload_env",
            ck["bf16"],
            {"VLLM_PLE_CPU_OFFLOAD": "maybe"},
            ["VLLM_PLE_CPU_OFFLOAD='maybe' is not a valid value", "1/0"],
        ),
        (
            "malformed_prefetch_env",
            ck["bf16"],
            {"VLLM_PLE_PREFETCH": "2"},
            ["VLLM_PLE_PREFETCH='2' is not a valid value"],
        ),
    ]


GOOD = [
    # name, checkpoint, env, reference checkpoint, expected (mode, storage class)
    ("bf16_default", "bf16", {}, "bf16", ("pinned", "PinnedHostPleStorage")),
    ("bf16_device", "bf16", {"VLLM_PLE_CPU_OFFLOAD": "0"}, "bf16", ("device", "DevicePleStorage")),
    (
        "fp8_pinned_vs_deq",
        "fp8_e4m3",
        {"VLLM_PLE_CPU_OFFLOAD": "1"},
        "fp8_e4m3-deq",
        ("pinned", "PinnedHostPleStorage"),
    ),
    (
        "fp8_device_vs_codes",
        "fp8_e4m3",
        {"VLLM_PLE_CPU_OFFLOAD": "off"},
        "fp8_e4m3",
        ("device", "DevicePleStorage"),
    ),
    ("nvfp4_pinned_vs_deq", "nvfp4", {}, "nvfp4-deq", ("pinned", "PinnedHostPleStorage")),
    (
        "nvfp4_device_vs_codes",
        "nvfp4",
        {"VLLM_PLE_CPU_OFFLOAD": "false"},
        "nvfp4",
        ("device", "DevicePleStorage"),
    ),
]


@pytest.fixture(scope="module")
def harness(ple_checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broken_ple")
    broken = _broken_cases(ple_checkpoints, tmp)
    cases = [
        {"name": name, "path": str(ple_checkpoints[ck]), "env": env, "reference": str(ple_checkpoints[ref])}
        for name, ck, env, ref, _ in GOOD
    ] + [{"name": name, "path": str(path), "env": env} for name, path, env, _ in broken]
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = pythonpath_with(REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ple._load_harness", str(spec), f"tcp://127.0.0.1:{free_port()}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :]), {name: frags for name, _, _, frags in broken}


@pytest.mark.parametrize("case", [g[0] for g in GOOD])
def test_checkpoint_loads_and_lookups_equal_reference(harness, case):
    results, _ = harness
    name, ck, _, _, (mode, cls) = next(g for g in GOOD if g[0] == case)
    got = results[case]
    assert got["ok"], got.get("error")
    fmt = ck if ck != "bf16" else "bf16"
    assert set(got["tables"]) == {TABLE0, "model.layers.1.ple.ple_embedding"}
    for info in got["tables"].values():
        assert info["format"] == fmt
        assert (info["mode"], info["storage_class"]) == (mode, cls)
        assert info["location"] == "cpu"  # vLLM's CPU build: RAM in both modes
        assert info["lookup_equal"] and info["lookup_nonzero"]
    per_row = {"bf16": 64, "fp8_e4m3": 32, "nvfp4": 16 + 2}[fmt]  # 32 values per row
    assert got["tables"][TABLE0]["table_bytes"] == 4064 * per_row


@pytest.mark.parametrize(
    "case",
    [
        "fp8_missing_global_scale",
        "fp8_global_scales_differ",
        "fp8_global_scale_not_positive",
        "fp8_global_scale_wrong_shape",
        "fp8_rows_wrong_shape",
        "config_fp8_but_bf16_tables",
        "quantized_tables_without_config",
        "nvfp4_missing_block_scales",
        "nvfp4_block_scales_wrong_shape",
        "nvfp4_rows_not_packed",
        "block_scales_in_fp8_table",
        "unknown_table_format",
        "malformed_offload_env",
        "malformed_prefetch_env",
    ],
)
def test_broken_checkpoint_fails_with_message(harness, case):
    results, fragments = harness
    got = results[case]
    assert not got["ok"], f"{case} loaded although it is broken"
    for fragment in fragments[case]:
        assert fragment in got["error"], f"{fragment!r} not in: {got['error']}"


# ------------------------------------------------------------------------------------------------
# Through a real engine start
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "env"),
    [("fp8_global_scales_differ", {}), ("malformed_offload_env", {"VLLM_PLE_CPU_OFFLOAD": "of"})],
)
def test_engine_start_fails_with_message(ple_checkpoints, tmp_path, capfd, monkeypatch, case, env):
    if case == "fp8_global_scales_differ":
        path = _copy(ple_checkpoints["fp8_e4m3"], tmp_path / "ckpt")

        def edit(t):
            t[SHARD.format(2) + ".weight_global_scale"] = t[SHARD.format(2) + ".weight_global_scale"] * 2

        _edit_weights(path, edit)
        fragments = [SHARD.format(2) + ".weight_global_scale", "differs from " + SHARD.format(0)]
    else:
        path = ple_checkpoints["bf16"]
        fragments = ["VLLM_PLE_CPU_OFFLOAD='of' is not a valid value"]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(Exception) as info:  # noqa: PT011 - the engine wraps the worker's error
        start_and_stop(path)
    out, err = capfd.readouterr()
    text = f"{info.value}\n{out}\n{err}"
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in the start-up error:\n{text[-3000:]}"
