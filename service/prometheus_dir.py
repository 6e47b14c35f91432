"""A fresh Prometheus multiprocess directory per start, removed at exit.

vLLM's workers (and the model code's ``qwen4exp_*`` metrics in them) are separate processes; their
samples reach ``/metrics`` only through prometheus-client's multiprocess mode, which is chosen
when prometheus_client is first imported in each process. So ``PROMETHEUS_MULTIPROC_DIR`` has to
be in ``os.environ`` before this process imports vLLM or prometheus_client; children inherit it.
A reused directory double-counts, hence a new one per start. This module imports neither;
the variable is written through :mod:`service.child_environment`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from service.child_environment import export

ENV = "PROMETHEUS_MULTIPROC_DIR"


def create() -> str:
    """Make an empty directory and export it; under an operator-given parent (e.g. a mounted
    emptyDir) when the variable is already set, otherwise under the system temp dir."""
    already = [m for m in ("prometheus_client", "vllm") if m in sys.modules]
    if already:
        raise RuntimeError(f"{ENV} must be set before importing {', '.join(already)}")
    parent = os.environ.get(ENV) or None
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix="qwen4exp-prom-", dir=parent)
    export({ENV: path})
    return path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
