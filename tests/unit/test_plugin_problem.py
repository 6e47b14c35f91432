"""``service.engine.plugin_problem``: the service refuses to start an engine that would run without
this project's vLLM plugin (vLLM only logs a plugin that fails to import)."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from service import engine


def test_the_installed_plugin_loads(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert engine.plugin_problem() is None
    monkeypatch.setenv("VLLM_PLUGINS", "other,qwen4exp")
    assert engine.plugin_problem() is None


@pytest.mark.parametrize("value", ["", "none", "other", "other, qwen4exp"])
def test_vllm_plugins_leaving_ours_out_is_refused(monkeypatch, value):
    # "other, qwen4exp": vLLM matches " qwen4exp" (with its space), so it would not load ours.
    monkeypatch.setenv("VLLM_PLUGINS", value)
    problem = engine.plugin_problem()
    assert problem and "VLLM_PLUGINS" in problem and "add qwen4exp" in problem


def test_a_stale_entry_point_is_refused_with_the_fix(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    stale = EntryPoint(name="qwen4exp", value="model.runtime.plugin:register", group=engine.PLUGIN_GROUP)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [stale])
    problem = engine.plugin_problem()
    assert "'qwen4exp = model.runtime.plugin:register' cannot be loaded" in problem
    assert "ModuleNotFoundError" in problem and "reinstall this project" in problem


def test_no_entry_point_is_refused(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [])
    assert "no vLLM plugin named 'qwen4exp' is installed" in engine.plugin_problem()
