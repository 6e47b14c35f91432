"""``model.runtime.envs``: every model variable declared once, parsed strictly, read the same everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.runtime import envs
from model.runtime.engine_guard import fault_injector


def test_every_variable_is_documented_and_unset_gives_its_default():
    assert len(envs.BY_NAME) == len(envs.VARIABLES)
    for var in envs.VARIABLES:
        assert var.doc and var.fix and var.default_doc, var.name
        assert envs.read(var.name, {}) == var.default
        assert envs.read(var.name, {var.name: "  "}) == var.default  # empty counts as unset


@pytest.mark.parametrize("name", [v.name for v in envs.VARIABLES if v.parse is envs.parse_flag])
def test_every_flag_takes_the_same_spellings(name):
    for on in ("1", "true", "YES", " on "):
        assert envs.read(name, {name: on}) is True
    for off in ("0", "False", "no", "OFF"):
        assert envs.read(name, {name: off}) is False
    for bad in ("2", "y", "t", "of"):
        with pytest.raises(envs.EnvError, match=f"^{name}='{bad}' is not a valid value"):
            envs.read(name, {name: bad})


def test_fault_injection_tokens_are_parsed_by_envs_into_the_deployment():
    from model.deployment.resolve import DeploymentError, resolve

    with pytest.raises(DeploymentError, match="QWEN4EXP_FAULT_INJECT_TOKEN='seven': must be a token id"):
        resolve({envs.FAULT_INJECT_TOKEN: "seven"}, cpu_build=True)
    tokens = resolve(
        {envs.FAULT_INJECT_TOKEN: "7", envs.FAULT_INJECT_FATAL_TOKEN: "9"}, cpu_build=True
    ).fault_tokens
    assert tokens == ((7, False), (9, True))
    check = fault_injector(tokens)
    check(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="injected fault: token 7"):
        check(torch.tensor([7]))
    with pytest.raises(RuntimeError, match="CUDA error"):
        check(torch.tensor([9]))
    assert fault_injector(resolve({}, cpu_build=True).fault_tokens) is None


def test_collect_dir_problems(tmp_path: Path):
    assert envs.collect_dir_problem(tmp_path) is None
    assert envs.collect_dir_problem(tmp_path / "new" / "deeper") is None
    (tmp_path / "f").write_text("")
    assert "exists and is not a directory" in envs.collect_dir_problem(tmp_path / "f")
    assert "cannot create directory" in envs.collect_dir_problem(tmp_path / "f" / "sub")


def test_qsa_selection_defaults_by_device_and_is_strict():
    assert envs.qsa_selection(cuda=True, env={}) == "batched"
    assert envs.qsa_selection(cuda=False, env={}) == "loop"
    assert envs.qsa_selection(cuda=True, env={envs.QSA_SELECTION: " Loop "}) == "loop"
    assert envs.qsa_selection(cuda=False, env={envs.QSA_SELECTION: "batched"}) == "batched"
    with pytest.raises(envs.EnvError, match="QWEN4EXP_QSA_SELECTION='fast' is not a valid value"):
        envs.qsa_selection(cuda=True, env={envs.QSA_SELECTION: "fast"})
