"""The TLS gate (``deploy/gate/gate.conf.template``, the nginx that compose's ``tls`` and ``scale``
profiles put in front of the service and the router) with a real nginx in front of the real service.

What is shown on loopback: chat completions through TLS with the openai client, streamed too; the
probes and ``/metrics`` pass; every route outside the allow-list (vllm-router's worker admin routes,
the service's router-only ``/get_load``) gets the gate's own OpenAI-shaped 404 and never reaches
the upstream; headers and bodies over the gate's limits are refused there and the gate still serves.
The template is rendered the way the nginx image's entrypoint renders it: ``${GATE_*}`` substituted.
"""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ROOT
from tests.deploy.tools import tool
from tests.net import free_port, wait_ready

from .conftest import KEY, Server, error_of

TEMPLATE = ROOT / "deploy" / "gate" / "gate.conf.template"
ADMIN_ROUTES = [
    ("POST", "/add_worker?url=http://198.51.100.7:8000"),
    ("POST", "/remove_worker?url=http://127.0.0.1:8000"),
    ("GET", "/list_workers"),
    ("POST", "/flush_cache"),
    ("GET", "/get_load"),
    ("GET", "/docs"),
    ("GET", "/v1"),
]


def render(template: str, values: dict[str, str]) -> str:
    """``envsubst`` as the nginx image runs it: each ``${NAME}`` of ``values`` replaced, nginx's own
    ``$variables`` left alone; a ``${GATE_*}`` left over is an error in the template."""
    out = template
    for name, value in values.items():
        out = out.replace("${" + name + "}", value)
    left = re.findall(r"\$\{GATE_[A-Z_]+\}", out)
    assert not left, f"{TEMPLATE}: variables without a value: {left}"
    return out


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "gate.crt", tmp / "gate.key"
    subprocess.run(
        [tool("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def gate(server: Server, tmp_path_factory):
    """nginx with the rendered gate in front of the shared server; yields (url, a TLS context trusting it)."""
    tmp = tmp_path_factory.mktemp("gate")
    cert, key = self_signed(tmp)
    port = free_port()
    site = render(
        TEMPLATE.read_text(),
        {
            "GATE_LISTEN_PORT": f"127.0.0.1:{port}",
            "GATE_TLS_CERT": str(cert),
            "GATE_TLS_KEY": str(key),
            "GATE_UPSTREAM": server.url,
        },
    )
    (tmp / "gate.conf").write_text(site)
    # The image's nginx.conf around conf.d, reduced to what a non-installed nginx needs.
    temp_dirs = "".join(
        f"  {directive} {tmp / directive};\n"
        for directive in (
            "client_body_temp_path",
            "proxy_temp_path",
            "fastcgi_temp_path",
            "uwsgi_temp_path",
            "scgi_temp_path",
        )
    )
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers keep access to the 0700 tmp dirs
    (tmp / "nginx.conf").write_text(
        f"{user}daemon off;\nworker_processes 1;\npid {tmp / 'nginx.pid'};\nerror_log stderr warn;\n"
        "events { worker_connections 256; }\n"
        f"http {{\n  access_log off;\n{temp_dirs}  include {tmp / 'gate.conf'};\n}}\n"
    )
    log = open(tmp / "nginx.log", "wb")
    proc = subprocess.Popen(
        [tool("nginx"), "-p", str(tmp), "-c", str(tmp / "nginx.conf")], stdout=log, stderr=subprocess.STDOUT
    )
    url = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(verify=trust, timeout=2) as client:
        wait_ready(
            url + "/health",
            proc,
            time.monotonic() + 30,
            client=client,
            exited=lambda rc: f"nginx exited with {rc}:\n" + (tmp / "nginx.log").read_text(),
            not_ready=lambda: "nginx did not answer:\n" + (tmp / "nginx.log").read_text(),
            interval=0.2,
        )
    yield url, trust
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


def test_chat_through_tls_with_the_openai_client(gate) -> None:
    url, ca = gate
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, http_client=httpx.Client(verify=ca))
    messages = [{"role": "user", "content": "Hello"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert answer.choices[0].message.content is not None and answer.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1


def test_probes_and_metrics_pass_and_keys_still_count(gate) -> None:
    url, ca = gate
    with httpx.Client(verify=ca, timeout=30) as client:
        assert client.get(url + "/ready").status_code == 200
        assert client.get(url + "/health").status_code == 200
        assert client.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        # The upstream's own refusal reaches the client unchanged: the gate does not replace auth.
        error_of(client.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": []}), 401)


@pytest.mark.parametrize("method,path", ADMIN_ROUTES, ids=[p.split("?")[0] for _, p in ADMIN_ROUTES])
def test_routes_outside_the_allow_list_stop_at_the_gate(gate, server: Server, method: str, path: str) -> None:
    url, ca = gate
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(verify=ca, timeout=30) as client:
        err = error_of(client.request(method, url + path, headers=auth), 404)
    assert err["code"] == "not_found" and "the gate passes" in err["message"], err
    if path == "/get_load":  # the service serves it: only the gate's refusal keeps clients off it
        assert httpx.get(server.url + path, headers=auth, timeout=30).status_code == 200


def test_oversized_headers_and_bodies_are_refused_at_the_gate(gate) -> None:
    url, ca = gate
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(verify=ca, timeout=60) as client:
        r = client.get(url + "/v1/models", headers={**auth, "X-Padding": "x" * (80 * 1024)})
        assert r.status_code in (400, 431), r.text
        assert r.json()["error"]["code"] in ("headers_too_large", "bad_request"), r.text
        body = b'{"model": "tiny", "prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
        r = client.post(
            url + "/v1/completions", headers={**auth, "Content-Type": "application/json"}, content=body
        )
        assert error_of(r, 413)["code"] == "request_too_large"
        assert client.get(url + "/v1/models", headers=auth).status_code == 200
