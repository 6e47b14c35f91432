"""Bind the listening socket before the engine (and vLLM) is even imported.

A busy port or a wrong address is then reported within a second, as a configuration error naming
the variables, instead of after a model load; and the socket already accepts connections (served
503 by the lifecycle gate) while the engine loads.
"""

from __future__ import annotations

import socket

from .settings import ServiceSettings, SettingsError


def bind(settings: ServiceSettings) -> socket.socket:
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        raise SettingsError(
            f"QWEN4EXP_HOST={settings.host!r} QWEN4EXP_PORT={settings.port}: cannot listen ({exc.strerror}); "
            "fix: choose a free port or an address of this host"
        ) from None
    sock.listen(2048)  # queue connections now; uvicorn answers them once it runs
    return sock
