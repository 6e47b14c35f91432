"""Media URLs against the real service: a remote image URL naming an internal address is refused
before the engine sees it, and nothing fetches from that address.

The listener below stands for an internal service (a metadata endpoint, an admin API) that the
serving host can reach and a client cannot: it counts every connection. With
``QWEN4EXP_ALLOWED_MEDIA_DOMAINS`` unset (the default) the request gets an OpenAI-shaped 400 naming
the variable, the listener sees no connection, and the engine still answers a normal request.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from .conftest import Server, error_of


@pytest.fixture()
def internal_listener():
    """A loopback TCP listener that records every connection made to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(0.2)
    hits: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    hits.append(conn.recv(4096))
                except OSError:
                    hits.append(b"")
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()[1], hits
    stop.set()
    thread.join(timeout=5)
    sock.close()


def image_message(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_an_internal_media_url_is_refused_and_never_fetched(server: Server, internal_listener, route) -> None:
    port, hits = internal_listener
    url = f"http://127.0.0.1:{port}/latest/meta-data/iam.png"
    if route == "/v1/chat/completions":
        body = {"model": "tiny", "messages": image_message(url), "max_tokens": 4}
    elif route == "/v1/messages":
        content = [{"type": "image", "source": {"type": "url", "url": url}}]
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    else:
        content = [{"type": "input_image", "image_url": url}]
        body = {"model": "tiny", "max_output_tokens": 4, "input": [{"role": "user", "content": content}]}
    r = httpx.post(server.url + route, headers=server.auth, json=body, timeout=60)
    err = error_of(r, 400)
    assert "QWEN4EXP_ALLOWED_MEDIA_DOMAINS" in err["message"] and url in err["message"], err
    time.sleep(0.5)  # a fetch started by the engine would have connected by now
    assert hits == [], f"the server connected to the internal address: {hits}"
    ok = httpx.post(
        server.url + "/v1/completions",
        headers=server.auth,
        json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


# ---- the rule itself, in-process -------------------------------------------------------------


def test_allowed_hosts_and_inline_data_pass_and_every_other_url_is_named() -> None:
    from service.media_urls import refused_media_url

    allowed = ("images.example.com",)
    chat = "/v1/chat/completions"
    assert (
        refused_media_url(chat, {"messages": image_message("https://images.example.com/a.png")}, allowed)
        is None
    )
    assert (
        refused_media_url(chat, {"messages": image_message("https://IMAGES.example.com./a.png")}, allowed)
        is None
    )
    assert (
        refused_media_url(chat, {"messages": image_message("data:image/png;base64,iVBORw0KGgo=")}, ()) is None
    )
    # Plain text that mentions a URL is not a media part.
    text = [{"role": "user", "content": "see http://10.0.0.1/"}]
    assert refused_media_url(chat, {"messages": text}, ()) is None
    for url in (
        "http://images.example.com.evil.test/a.png",
        "file:///etc/passwd",
        "ftp://images/x",
        "//10.0.0.1/a",
    ):
        field, message = refused_media_url(chat, {"messages": image_message(url)}, allowed)
        assert field == "messages" and url in message and "QWEN4EXP_ALLOWED_MEDIA_DOMAINS" in message
    # A part type the rule does not know still cannot carry a URL past it.
    odd = [
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://10.0.0.1/v.mp4"}}]}
    ]
    assert refused_media_url(chat, {"messages": odd}, allowed) is not None


def test_the_setting_is_checked_at_start_up_and_reaches_vllm(tmp_path) -> None:
    from pydantic import ValidationError

    from service.engine import cli_args
    from service.settings import ServiceSettings
    from tests.conftest import ensure_checkpoint

    model = str(ensure_checkpoint("tiny"))
    with pytest.raises(ValidationError, match="not a host name"):
        ServiceSettings(model=model, auth="off", allowed_media_domains="https://images.example.com/")
    settings = ServiceSettings(
        model=model, auth="off", allowed_media_domains=" Images.Example.com, cdn.example.org "
    )
    assert settings.allowed_media_domains == "images.example.com,cdn.example.org"
    argv = cli_args(settings, "cpu")
    i = argv.index("--allowed-media-domains")
    assert argv[i + 1 : i + 3] == ["images.example.com", "cdn.example.org"]
    assert "--allowed-media-domains" not in cli_args(ServiceSettings(model=model, auth="off"), "cpu")
