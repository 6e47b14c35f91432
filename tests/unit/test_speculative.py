"""Which speculative decoding runs (:mod:`model.deployment.speculative`), decided from the request,
the checkpoint and the implementation, and how it reaches vLLM's command line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from model.deployment import resolve as R
from model.deployment import speculative as S
from model.runtime import envs
from tests.unit.test_deployment import A3090, real_shape_config

WINDOW = (2, 4)


def with_mtp(layers: int = 1) -> dict:
    return {**real_shape_config(), "mtp_num_hidden_layers": layers}


def test_auto_takes_mtp_where_the_checkpoint_has_it_and_is_off_otherwise():
    on, note = S.choose("auto", 3, WINDOW, implementation="upstream", config=with_mtp(), has_mtp_weights=True)
    assert on == S.Speculative("mtp", 3) and "mtp, 3 draft tokens" in note
    off, note = S.choose("auto", 3, WINDOW, implementation="upstream", config=real_shape_config())
    assert off is None and "no MTP layers" in note
    off, _ = S.choose("auto", 3, WINDOW, implementation="upstream", config=with_mtp(), has_mtp_weights=False)
    assert off is None


def test_ngram_runs_for_any_checkpoint_on_upstream():
    on, note = S.choose("ngram", 5, (3, 6), implementation="upstream", config=real_shape_config())
    assert on.vllm_config() == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_min": 3,
        "prompt_lookup_max": 6,
    }
    assert "prompt lookup of 3 to 6 tokens" in note


@pytest.mark.parametrize(("config", "weights", "said"), [
    (real_shape_config(), None, "no mtp_num_hidden_layers in config.json"),
    (with_mtp(), False, "no mtp.* tensors in its weights"),
])  # fmt: skip
def test_mtp_without_mtp_layers_is_refused_naming_the_fix(config, weights, said):
    with pytest.raises(S.SpeculativeError) as info:
        S.choose("mtp", 3, WINDOW, implementation="upstream", config=config, has_mtp_weights=weights)
    assert said in str(info.value) and "fix: use QWEN4EXP_SPECULATIVE=ngram or off" in str(info.value)


@pytest.mark.parametrize("requested", ["ngram", "mtp"])
def test_our_implementation_serves_without_speculation_and_says_why(requested):
    off, note = S.choose(requested, 3, WINDOW, implementation="ours", config=None)
    assert off is None and S.declined(requested, off)
    assert f"although QWEN4EXP_SPECULATIVE={requested}" in note and "serving without it" in note


def test_the_choice_reaches_vllms_command_line_and_its_processes():
    env = {envs.SPECULATIVE: "ngram", envs.SPECULATIVE_TOKENS: "4", envs.NGRAM_WINDOW: "1-3"}
    d = R.resolve(env, cpu_build=False, config=real_shape_config(), gpu=A3090)
    argv = d.engine_args()
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    extra = json.loads(json.dumps(d.additional_config()))
    assert R.of(type("C", (), {"additional_config": extra})()) == d
    assert not d.speculative_declined
    cpu = R.resolve(env, cpu_build=True)
    assert cpu.speculative is None and "--speculative-config" not in cpu.engine_args()
    assert cpu.speculative_declined and not R.resolve({}, cpu_build=True).speculative_declined


def test_mtp_on_a_checkpoint_without_it_stops_the_resolution():
    with pytest.raises(R.DeploymentError, match="QWEN4EXP_SPECULATIVE=mtp: this checkpoint has no"):
        R.resolve({envs.SPECULATIVE: "mtp"}, cpu_build=False, config=real_shape_config(), gpu=A3090)


@pytest.mark.parametrize(("name", "raw"), [
    (envs.SPECULATIVE, "eagle"), (envs.SPECULATIVE_TOKENS, "0"), (envs.SPECULATIVE_TOKENS, "9"),
    (envs.SPECULATIVE_TOKENS, "three"), (envs.NGRAM_WINDOW, "4-2"), (envs.NGRAM_WINDOW, "0-3"),
    (envs.NGRAM_WINDOW, "3"),
])  # fmt: skip
def test_malformed_values_are_refused_with_their_fix(name, raw):
    with pytest.raises(R.DeploymentError) as info:
        R.resolve({name: raw}, cpu_build=False, config=real_shape_config(), gpu=A3090)
    assert str(info.value).startswith(f"{name}={raw!r}") and "fix:" in str(info.value)


def test_mtp_tensors_are_found_from_the_index_or_the_headers(tmp_path):
    assert S.mtp_tensors_present(tmp_path / "missing") is None
    plain, mtp = tmp_path / "plain", tmp_path / "mtp"
    plain.mkdir(), mtp.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(2)}, plain / "model.safetensors")
    save_file({"mtp.layers.0.mlp.gate.weight": torch.zeros(2)}, mtp / "model-00002.safetensors")
    assert S.mtp_tensors_present(plain) is False and S.mtp_tensors_present(mtp) is True
    (plain / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.mtp.fc.weight": "model.safetensors"}})
    )
    assert S.mtp_tensors_present(plain) is True
