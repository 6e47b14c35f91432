"""API keys fail closed and rotate without a restart, on the real service (tiny checkpoint, loopback).

A keys file that is configured but holds no key (empty, only comments: a failed secret mount, a
truncated write) stops start-up with the variable and the fix named, instead of turning auth off.
A running service re-reads the file when it changes: a new key is accepted and a removed one refused
on the next request, and a version of the file without any key is ignored (the previous keys stay).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, ensure_checkpoint
from tests.net import free_port, wait_ready
from tests.service.conftest import service_env as base_service_env

STARTUP_TIMEOUT_S = 300
OLD_KEY = "old-key-0123456789abcdef"
NEW_KEY = "new-key-fedcba9876543210"


def service_env(**overrides: str) -> dict[str, str]:
    """The service's environment for the real ``tiny`` service on loopback, plus ``overrides``."""
    return base_service_env(
        QWEN4EXP_MODEL=str(ensure_checkpoint("tiny")), QWEN4EXP_HOST="127.0.0.1", **overrides
    )


@pytest.mark.parametrize("content", ["", "# keys go here\n\n   \n"])
def test_a_keys_file_without_a_key_stops_start_up(api_keys_file, content):
    keys = api_keys_file(content)
    proc = subprocess.run(
        [sys.executable, "-m", "service"],
        cwd=ROOT,
        env=service_env(QWEN4EXP_API_KEYS_FILE=str(keys), QWEN4EXP_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"QWEN4EXP_API_KEYS_FILE='{keys}': no API key" in proc.stderr, proc.stderr
    assert "unset QWEN4EXP_API_KEYS_FILE" in proc.stderr  # the explicit way to run without auth


def replace_atomically(path: Path, text: str) -> None:
    """How a Secret update or `install -m 0644 new secrets/api-keys` lands: a new file renamed over."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(path)


def test_keys_rotate_without_restart_and_never_fall_open(tmp_path, api_keys_file):
    keys = api_keys_file(f"# rotated by the operator\n{OLD_KEY}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "service.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service"],
            cwd=ROOT,
            env=service_env(QWEN4EXP_API_KEYS_FILE=str(keys), QWEN4EXP_PORT=str(port)),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            wait_ready(
                "/ready",
                proc,
                time.monotonic() + STARTUP_TIMEOUT_S,
                client=c,
                exited=lambda rc: log.read_text()[-3000:],
                not_ready=lambda: "service not ready: " + log.read_text()[-3000:],
            )

            def status(key: str | None) -> int:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                return c.get("/v1/models", headers=headers).status_code

            assert (status(OLD_KEY), status(NEW_KEY), status(None)) == (200, 401, 401)
            replace_atomically(keys, f"{NEW_KEY}\n")
            assert (status(NEW_KEY), status(OLD_KEY)) == (200, 401)  # the very next request
            keys.write_text(f"{NEW_KEY}\n{OLD_KEY}\n")  # edited in place: both again
            assert (status(NEW_KEY), status(OLD_KEY)) == (200, 200)
            replace_atomically(keys, "# emptied by mistake\n")
            assert (status(NEW_KEY), status(None)) == (200, 401)  # previous keys kept: never open
            keys.unlink()
            assert (status(NEW_KEY), status(None)) == (200, 401)
            assert proc.poll() is None  # all without a restart
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "API keys reloaded" in text and "now holds no key: keeping the previous keys" in text, text[-3000:]
