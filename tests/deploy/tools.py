"""Locate the external tools the deployment tests run (installed by ``scripts/ci-tools.sh``).

A missing tool is a failure with the install command, never a skip: a green run must mean the
compose file, Prometheus config, chart and Dockerfile were really checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

INSTALL_HINT = "install the deployment test tools with: bash scripts/ci-tools.sh"
CHART = ROOT / "k8s" / "qwen4exp"
DASHBOARDS = CHART / "dashboards"
RULES = CHART / "rules" / "qwen4exp-alerts.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
EXAMPLE_CONFIG = ROOT / "deploy" / "qwen4-exp-config.example.json"


def tool(name: str) -> str:
    """Absolute path of ``name`` from PATH or the project venv, or fail naming the installer."""
    found = shutil.which(name) or shutil.which(name, path=str(ROOT / ".venv" / "bin"))
    if not found:
        pytest.fail(f"required tool {name!r} is not installed; {INSTALL_HINT}", pytrace=False)
    return found


def run(args: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run a tool with captured text output (never raises on a non-zero exit)."""
    env = {**os.environ, **kwargs.pop("env", {})}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


def python_module_or_fail(module: str) -> None:
    """Fail (not skip) when a Python test dependency from ci-tools.sh is missing."""
    try:
        __import__(module)
    except ImportError:
        pytest.fail(f"Python package for {module!r} is not installed; {INSTALL_HINT}", pytrace=False)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))
