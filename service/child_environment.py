"""The one place this process writes ``os.environ``: what the processes vLLM starts must inherit.

Why a single place: configuration handed over by environment writes is invisible at the call
site, so it travels through vLLM's ``additional_config`` instead
(:meth:`model.deployment.resolve.Deployment.additional_config`). What remains are variables that
only the environment can carry: those vLLM and prometheus-client read themselves, and those needed
in a child before any configuration reaches it (:meth:`~model.deployment.resolve.Deployment.child_environment`).
A test checks that no other module of ``service/`` or ``model/`` writes the environment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("service.child_environment")


def export(values: Mapping[str, str], *, keep_operator_values: tuple[str, ...] = ()) -> dict[str, str]:
    """Set ``values`` in this process's environment, which vLLM's processes inherit; a name in
    ``keep_operator_values`` that the operator set already keeps the operator's value. Returns what
    was written."""
    written = {}
    for name, value in values.items():
        if name in keep_operator_values and os.environ.get(name, "").strip():
            continue
        os.environ[name] = written[name] = str(value)
    if written:
        log.debug("environment for vLLM's processes: %s", written)
    return written
