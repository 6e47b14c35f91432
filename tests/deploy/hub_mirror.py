"""A file-based Hugging Face Hub mirror on loopback, for the ``download`` profile's test.

It serves one directory per repository (``ROOT/org/name``) with the endpoints ``huggingface_hub``
uses to download a snapshot: the revision metadata (``/api/models/{repo}/revision/{rev}``), the file
list (``/api/models/{repo}/tree/{rev}``) and the files (``/{repo}/resolve/{commit}/{path}``, HEAD and
GET with byte ranges). ``HF_ENDPOINT`` points the client at it. Requests
are counted per path so a test can see that a resumed download fetched only what was missing.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubMirror:
    def __init__(self, root: Path, commit: str = "0123456789abcdef0123456789abcdef01234567") -> None:
        self.root = root
        self.commit = commit
        self.gets: Counter[str] = Counter()
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                mirror.answer(self, body=False)

            def do_GET(self) -> None:
                mirror.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubMirror:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> list[Path]:
        base = self.root / repo
        return sorted(p for p in base.rglob("*") if p.is_file())

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and "revision" in parts:
            repo = "/".join(parts[2 : parts.index("revision")])
            if not (self.root / repo).is_dir():
                return self.send(
                    h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}
                )
            siblings = [
                {"rfilename": str(p.relative_to(self.root / repo)), "size": p.stat().st_size}
                for p in self.files(repo)
            ]
            doc = {"id": repo, "modelId": repo, "sha": self.commit, "siblings": siblings, "private": False}
            return self.send(h, 200, json.dumps(doc).encode(), {"Content-Type": "application/json"}, body)
        if parts[:2] == ["api", "models"] and "tree" in parts:
            repo = "/".join(parts[2 : parts.index("tree")])
            entries = [
                {
                    "type": "file",
                    "path": str(p.relative_to(self.root / repo)),
                    "size": p.stat().st_size,
                    "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                }
                for p in self.files(repo)
            ]
            return self.send(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body)
        if "resolve" in parts:
            i = parts.index("resolve")
            repo, name = "/".join(parts[:i]), "/".join(parts[i + 2 :])
            file = self.root / repo / name
            if not file.is_file():
                return self.send(h, 404, b"not found", {"X-Error-Code": "EntryNotFound"}, body)
            data = file.read_bytes()
            headers = {
                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                "X-Repo-Commit": self.commit,
                "Content-Type": "application/octet-stream",
            }
            status, start = 200, 0
            if (rng := h.headers.get("Range")) and rng.startswith("bytes="):
                start = int(rng[6:].split("-")[0] or 0)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if body:
                self.gets[name] += 1
            return self.send(h, status, data[start:], headers, body)
        return self.send(h, 404, b"not found", {}, body)

    @staticmethod
    def send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict, body: bool = True) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)
