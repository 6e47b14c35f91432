"""This project's section of vLLM's ``additional_config``: how the service's decisions reach vLLM's processes.

Why this channel: vLLM hands ``VllmConfig`` (``--additional-config`` included) to its engine core
and every worker it starts, so the deployment the service resolved once arrives in each process as
data, with no environment variable written on the way. Only the key lives here, on the lowest
floor, so that any module that holds a ``VllmConfig`` can read the section;
:class:`model.deployment.resolve.Deployment` writes and reads its content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KEY = "qwen4exp"


def section(vllm_config: Any) -> Mapping[str, Any] | None:
    """The ``qwen4exp`` section of ``vllm_config.additional_config``, or None (vLLM started without
    the service, e.g. ``vllm serve`` with this plugin installed)."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, Mapping):
        return None
    value = extra.get(KEY)
    return value if isinstance(value, Mapping) else None
