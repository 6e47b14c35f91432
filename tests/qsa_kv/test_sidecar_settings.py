"""Fail-closed validation of the scale sidecar and the ``VLLM_QSA_KV_*`` settings (no engine)."""

from __future__ import annotations

import json

import pytest
import torch

from model.qsa_kv.settings import FP8_E4M3, NATIVE, QSAKVConfigError, QSAKVSettings, resolve_kv_format
from model.qsa_kv.sidecar import LayerScales, atomic_write_json, load_sidecar, validate_sidecar

L3, L7 = "model.layers.3.self_attn", "model.layers.7.self_attn"
LAYERS = [L3, L7]
GOOD = {L3: {"k_scale": 0.01, "v_scale": 0.002}, L7: {"k_scale": 3, "v_scale": 1e-5}}


def raw(entry3: str, extra: str = "") -> str:
    """Sidecar text with a literal entry for layer 3 (for what ``json.dumps`` cannot write)."""
    return '{"' + L3 + '": ' + entry3 + ', "' + L7 + '": {"k_scale": 1, "v_scale": 1}' + extra + "}"


def write(tmp_path, text: str):
    path = tmp_path / "scales.json"
    path.write_text(text)
    return path


def test_good_sidecar_loads(tmp_path):
    path = write(tmp_path, json.dumps(GOOD))
    assert load_sidecar(path, LAYERS) == {L3: LayerScales(0.01, 0.002), L7: LayerScales(3.0, 1e-5)}


@pytest.mark.parametrize(
    "text, must_contain",
    [
        ("[1, 2]", ["top level must be a JSON object", "got array"]),
        ('"x"', ["top level must be a JSON object"]),
        ("{not json", ["not valid JSON"]),
        (
            json.dumps({**GOOD, "model.layers.9.self_attn": {"k_scale": 1, "v_scale": 1}}),
            ["layer 'model.layers.9.self_attn': not a QSA layer of this model"],
        ),
        (json.dumps({L3: GOOD[L3]}), [f"layer '{L7}': missing"]),
        (
            json.dumps({**GOOD, L3: {"k_scale": 1, "v_scale": 1, "scale": 2}}),
            [f"layer '{L3}' field 'scale': unexpected key"],
        ),
        (json.dumps({**GOOD, L3: {"k_scale": 1}}), [f"layer '{L3}' field 'v_scale': missing"]),
        (json.dumps({**GOOD, L3: [1, 2]}), [f"layer '{L3}': must be an object", "got array"]),
        (
            json.dumps({**GOOD, L3: {"k_scale": "0.1", "v_scale": 1}}),
            [f"layer '{L3}' field 'k_scale': must be a number, got string \"0.1\""],
        ),
        (
            json.dumps({**GOOD, L3: {"k_scale": True, "v_scale": 1}}),
            [f"layer '{L3}' field 'k_scale': must be a number, got boolean true"],
        ),
        (
            json.dumps({**GOOD, L3: {"k_scale": None, "v_scale": 1}}),
            [f"layer '{L3}' field 'k_scale'", "got null"],
        ),
        (
            raw('{"k_scale": NaN, "v_scale": 1}'),
            [f"layer '{L3}' field 'k_scale': must be finite"],
        ),
        (
            raw('{"k_scale": 1, "v_scale": Infinity}'),
            [f"layer '{L3}' field 'v_scale': must be finite"],
        ),
        (
            raw('{"k_scale": 1, "v_scale": 1e400}'),
            [f"layer '{L3}' field 'v_scale': must be finite"],
        ),
        (
            json.dumps({**GOOD, L3: {"k_scale": 0, "v_scale": 1}}),
            [f"layer '{L3}' field 'k_scale': must be > 0, got 0"],
        ),
        (
            json.dumps({**GOOD, L3: {"k_scale": 1, "v_scale": -0.5}}),
            [f"layer '{L3}' field 'v_scale': must be > 0, got -0.5"],
        ),
        (
            raw('{"k_scale": 1, "v_scale": 1}', ', "' + L3 + '": {}'),
            ["duplicate key"],
        ),
    ],
    ids=[
        "array",
        "string",
        "bad-json",
        "unknown-layer",
        "missing-layer",
        "extra-key",
        "missing-field",
        "entry-not-object",
        "string-number",
        "boolean",
        "null",
        "nan",
        "infinity",
        "overflow",
        "zero",
        "negative",
        "duplicate-layer",
    ],
)
def test_bad_sidecar_names_file_layer_and_field(tmp_path, text, must_contain):
    path = write(tmp_path, text)
    with pytest.raises(QSAKVConfigError) as err:
        load_sidecar(path, LAYERS)
    message = str(err.value)
    assert f"VLLM_QSA_KV_SCALES={path}" in message
    for part in must_contain:
        assert part in message, message


def test_all_problems_reported_at_once(tmp_path):
    path = write(
        tmp_path, json.dumps({L3: {"k_scale": -1, "v_scale": False}, "model.layers.0.self_attn": {}})
    )
    message = str(pytest.raises(QSAKVConfigError, load_sidecar, path, LAYERS).value)
    for part in (
        "field 'k_scale': must be > 0",
        "field 'v_scale': must be a number",
        "layers.0",
        f"'{L7}': missing",
    ):
        assert part in message, message


def test_missing_file(tmp_path):
    message = str(pytest.raises(QSAKVConfigError, load_sidecar, tmp_path / "nope.json", LAYERS).value)
    assert "nope.json" in message and "cannot read" in message


def test_non_strict_allows_missing_layers_but_not_unknown_ones():
    assert validate_sidecar({L3: GOOD[L3]}, source="s", expected_layers=LAYERS, strict=False) == {
        L3: LayerScales(0.01, 0.002)
    }
    with pytest.raises(QSAKVConfigError, match="not a QSA layer"):
        validate_sidecar({"x.1": GOOD[L3]}, source="s", expected_layers=LAYERS, strict=False)


def test_atomic_write_roundtrip(tmp_path):
    path = tmp_path / "out.json"
    atomic_write_json(path, GOOD)
    assert json.loads(path.read_text()) == GOOD
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left behind
    with pytest.raises(ValueError):  # NaN is not JSON: refused rather than written
        atomic_write_json(path, {"x": float("nan")})
    assert json.loads(path.read_text()) == GOOD  # the old file survives a failed write


# ---- settings ---------------------------------------------------------------------------------


def test_settings_defaults_and_values(tmp_path):
    assert QSAKVSettings.from_env({}) == QSAKVSettings()
    s = QSAKVSettings.from_env(
        {
            "VLLM_QSA_KV_SCALES": "/x/s.json",
            "VLLM_QSA_KV_SCALES_STRICT": "0",
            "VLLM_QSA_KV_COLLECT": str(tmp_path),
            "VLLM_QSA_KV_COLLECT_INTERVAL": "2.5",
            "VLLM_QSA_KV_CLIP_COUNT": "0.5",
        }
    )
    assert (str(s.scales_path), s.strict, s.collect_dir, s.collect_interval_s, s.clip_interval_s) == (
        "/x/s.json",
        False,
        tmp_path,
        2.5,
        0.5,
    )


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan", "1s"])
@pytest.mark.parametrize("name", ["VLLM_QSA_KV_CLIP_COUNT", "VLLM_QSA_KV_COLLECT_INTERVAL"])
def test_malformed_seconds_refused(name, value):
    with pytest.raises(QSAKVConfigError, match=name):
        QSAKVSettings.from_env({name: value})


def test_malformed_strict_flag_refused():
    with pytest.raises(QSAKVConfigError, match="VLLM_QSA_KV_SCALES_STRICT"):
        QSAKVSettings.from_env({"VLLM_QSA_KV_SCALES_STRICT": "maybe"})


def test_combinations_refused(tmp_path):
    with pytest.raises(QSAKVConfigError, match="scale sidecar was given but the KV cache is not FP8"):
        QSAKVSettings(scales_path=tmp_path / "s.json").check_against(NATIVE, eager=True)
    with pytest.raises(QSAKVConfigError, match="clip counting needs --kv-cache-dtype fp8"):
        QSAKVSettings(clip_interval_s=1.0).check_against(NATIVE, eager=True)
    with pytest.raises(QSAKVConfigError, match="calibration needs eager execution"):
        QSAKVSettings(collect_dir=tmp_path).check_against(FP8_E4M3, eager=False)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(QSAKVConfigError, match="cannot create directory"):
        QSAKVSettings(collect_dir=blocker / "sub").check_against(NATIVE, eager=True)
    QSAKVSettings(collect_dir=tmp_path / "new", clip_interval_s=1).check_against(FP8_E4M3, eager=True)
    assert (tmp_path / "new").is_dir()


def test_kv_format_resolution():
    assert resolve_kv_format("auto", torch.bfloat16) == NATIVE
    assert resolve_kv_format("bfloat16", torch.bfloat16) == NATIVE
    assert resolve_kv_format("fp8", torch.bfloat16) == FP8_E4M3
    assert resolve_kv_format("fp8_e4m3", torch.float16) == FP8_E4M3
    for bad, dtype in (
        ("fp8_e5m2", torch.bfloat16),
        ("float16", torch.bfloat16),
        ("int8_per_token_head", torch.bfloat16),
    ):
        with pytest.raises(QSAKVConfigError, match="not supported by Qwen4-Exp QSA layers"):
            resolve_kv_format(bad, dtype)
