"""Loopback plumbing for tests that start a server process: a free port, and waiting until it answers."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on: the OS picks it and it is released at once,
    so the process started next can bind it (a fixed port would collide with parallel runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ok(response: httpx.Response) -> bool:
    return response.status_code == 200


def wait_ready(
    url: str,
    proc: subprocess.Popen,
    deadline: float,
    *,
    exited: Callable[[int], str],
    not_ready: Callable[[], str],
    error: Callable[[str], BaseException] = AssertionError,
    on_timeout: Callable[[], object] | None = None,
    until: Callable[[httpx.Response], bool] = _ok,
    on_answer: Callable[[httpx.Response], object] | None = None,
    client: httpx.Client | None = None,
    timeout: float = 5.0,
    interval: float = 0.5,
) -> httpx.Response:
    """GET ``url`` every ``interval`` s until ``until(response)`` (default: status 200); return it.

    ``proc`` is checked before each request, so a start that crashes fails at once with
    ``error(exited(returncode))`` instead of as a timeout minutes later; past ``deadline``
    (``time.monotonic()``) ``on_timeout()`` runs, then ``error(not_ready())``. The messages are
    callables so that a log is read only on failure. ``on_answer`` sees every response first.
    Requests use ``client`` if given, else ``httpx.get`` with ``timeout``; a request that fails
    (``httpx.HTTPError``: nothing listening yet) is retried.
    """
    get = client.get if client is not None else lambda u: httpx.get(u, timeout=timeout)
    while True:
        if (returncode := proc.poll()) is not None:
            raise error(exited(returncode))
        if time.monotonic() >= deadline:
            if on_timeout is not None:
                on_timeout()
            raise error(not_ready())
        try:
            response = get(url)
        except httpx.HTTPError:
            pass
        else:
            if on_answer is not None:
                on_answer(response)
            if until(response):
                return response
        time.sleep(interval)
