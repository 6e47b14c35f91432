"""Soak: mixed traffic with injected faults for a given time; outcomes by status, 5xx, memory drift.

Starts the real service on loopback (``python -m service``, the checkpoint given, small admission
limits so that bursts overload it) or targets a running one (``--url``), then keeps ``--workers``
clients busy for ``--minutes`` with a weighted mix of:

* ``complete``: a short non-streamed completion (expects 200; 429 when a burst is on);
* ``stream``: a chat stream read to ``[DONE]``;
* ``disconnect``: a stream dropped after 0-30 events, or before the answer starts;
* ``bad_body``: malformed or invalid bodies (broken JSON, wrong types, unknown model, a prompt over
  the context, negative max_tokens, a body over the size cap): expects 4xx;
* ``trickle``: a body sent a byte at a time (slowloris): expects 408 from the body time limit;

and every ``--burst-every`` seconds an overload burst of ``--burst`` simultaneous requests
(expects 200 or 429 with Retry-After). Every ``--sample-every`` seconds it records the resident
memory of the service and its engine processes (when it started them, or ``--pid``) and, where
``nvidia-smi`` exists, GPU memory used. At the end it waits for the engine to go idle, reads the
gauges that must be back to 0, and prints a markdown table: requests by kind and outcome, 5xx
(must be 0), memory at the end of warm-up, at the end and its maximum. ``--json`` writes the same
data. Exit status 1 if any 5xx or unexpected client error was seen.

    .venv/bin/python bench/soak.py --minutes 30 --json bench/results/soak-cpu.json

Timing and counting only: nothing here asserts on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' loopback plumbing
from tests.net import free_port  # noqa: E402

KEY = "soak-key"
GENERATION = ("/v1/completions", "/v1/chat/completions")


def start_service(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(("QWEN4EXP_", "VLLM_QSA_", "VLLM_PLE_"))
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
    env.update(
        QWEN4EXP_MODEL=str(args.model),
        QWEN4EXP_HOST="127.0.0.1",
        QWEN4EXP_PORT=str(port),
        QWEN4EXP_API_KEYS=KEY,
        QWEN4EXP_MAX_MODEL_LEN=str(args.max_model_len),
        QWEN4EXP_MAX_CONCURRENT_REQUESTS=str(args.max_running),
        QWEN4EXP_MAX_QUEUED_REQUESTS=str(args.max_queued),
        QWEN4EXP_MAX_BODY_BYTES=str(64 * 1024),
        QWEN4EXP_BODY_TIMEOUT_SECONDS="5",
        QWEN4EXP_REQUEST_TIMEOUT_SECONDS="60",
    )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the service exited with {proc.returncode} while starting; see {log_path}")
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"the service was not ready after 600 s; see {log_path}")


def descendants(pid: int) -> list[int]:
    found, frontier = [pid], [pid]
    while frontier:
        p = frontier.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            frontier += kids
    return found


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    total = 0
    for p in descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def gpu_mib() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return sum(float(x) for x in out.stdout.split())


class Soak:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.auth = {"Authorization": f"Bearer {args.key}"}
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.errors: list[str] = []
        self.rng = random.Random(args.seed)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(120), limits=httpx.Limits(max_connections=None))

    def count(self, kind: str, outcome: str) -> None:
        self.outcomes[(kind, outcome)] += 1

    def count_response(self, kind: str, r: httpx.Response) -> None:
        self.count(kind, str(r.status_code))
        if r.status_code == 429 and "retry-after" not in r.headers:
            self.errors.append(f"{kind}: 429 without Retry-After")
        if r.status_code >= 500:
            self.errors.append(f"{kind}: {r.status_code} {r.text[:300]}")

    def prompt(self) -> list[int]:
        return [self.rng.randrange(10, 500) for _ in range(self.rng.randrange(3, 300))]

    async def complete(self) -> None:
        body = {"model": self.args.name, "prompt": self.prompt(), "max_tokens": self.rng.randrange(4, 32)}
        self.count_response(
            "complete", await self.client.post(self.url + GENERATION[0], headers=self.auth, json=body)
        )

    async def stream(self) -> None:
        body = {
            "model": self.args.name,
            "messages": [{"role": "user", "content": "word " * self.rng.randrange(1, 100)}],
            "max_tokens": self.rng.randrange(8, 64),
            "stream": True,
        }
        async with self.client.stream("POST", self.url + GENERATION[1], headers=self.auth, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self.count_response("stream", r)
                return
            last = ""
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = line
            self.count("stream", "200" if last == "data: [DONE]" else "200 unfinished")
            if last != "data: [DONE]":
                self.errors.append(f"stream: ended without [DONE] ({last[:200]})")

    async def disconnect(self) -> None:
        body = {
            "model": self.args.name,
            "prompt": self.prompt(),
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        if self.rng.random() < 0.3:
            try:
                await asyncio.wait_for(
                    self.client.post(self.url + GENERATION[0], headers=self.auth, json=body),
                    self.rng.uniform(0.01, 0.5),
                )
            except TimeoutError:
                self.count("disconnect", "dropped before the answer")
                return
            self.count("disconnect", "finished first")
            return
        stop_after = self.rng.randrange(0, 31)
        async with self.client.stream("POST", self.url + GENERATION[0], headers=self.auth, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self.count_response("disconnect", r)
                return
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen > stop_after:
                        self.count("disconnect", "dropped mid-stream")
                        return
        self.count("disconnect", "finished first")

    def bad_bodies(self) -> list[tuple[str, bytes]]:
        name = self.args.name
        return [
            ("broken json", b'{"model": "x", "prompt": '),
            ("wrong type", json.dumps({"model": name, "prompt": "a", "max_tokens": "many"}).encode()),
            ("unknown model", json.dumps({"model": "nope", "prompt": "a"}).encode()),
            ("negative max_tokens", json.dumps({"model": name, "prompt": "a", "max_tokens": -3}).encode()),
            (
                "over the context",
                json.dumps({"model": name, "prompt": [7] * (self.args.max_model_len + 5)}).encode(),
            ),
            ("no messages", json.dumps({"model": name}).encode()),
            ("over the size cap", json.dumps({"model": name, "prompt": "x" * 70_000}).encode()),
            ("not an object", b"[1, 2, 3]"),
        ]

    async def bad_body(self) -> None:
        _, raw = self.rng.choice(self.bad_bodies())
        path = self.rng.choice(GENERATION)
        headers = self.auth | {"Content-Type": "application/json"}
        r = await self.client.post(self.url + path, headers=headers, content=raw)
        self.count_response("bad_body", r)
        if not 400 <= r.status_code < 500:
            self.errors.append(f"bad_body: {r.status_code} for a bad body")

    async def trickle(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        body = json.dumps({"model": self.args.name, "prompt": "x" * 40, "max_tokens": 4}).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {self.args.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        writer.write(head)
        status = "closed without an answer"
        try:
            for i in range(len(body) - 1):
                writer.write(body[i : i + 1])
                await writer.drain()
                try:
                    line = await asyncio.wait_for(reader.readline(), 0.5)
                except TimeoutError:
                    continue
                status = line.decode(errors="replace").split(" ")[1] if line else status
                break
        except OSError:
            pass
        finally:
            writer.close()
        self.count("trickle", status)
        if status.startswith("5"):
            self.errors.append(f"trickle: {status}")

    async def worker(self, until: float) -> None:
        kinds = [self.complete, self.stream, self.disconnect, self.bad_body, self.trickle]
        weights = [40, 25, 20, 13, 2]
        while time.monotonic() < until:
            action = self.rng.choices(kinds, weights)[0]
            try:
                await action()
            except httpx.HTTPError as exc:
                self.count(action.__name__, f"client error {type(exc).__name__}")
                self.errors.append(f"{action.__name__}: {type(exc).__name__}: {exc}")

    async def burst(self, until: float) -> None:
        while time.monotonic() + self.args.burst_every < until:
            await asyncio.sleep(self.args.burst_every)
            body = {"model": self.args.name, "prompt": [5, 6, 7], "max_tokens": 16}
            answers = await asyncio.gather(
                *(
                    self.client.post(self.url + GENERATION[0], headers=self.auth, json=body)
                    for _ in range(self.args.burst)
                ),
                return_exceptions=True,
            )
            for r in answers:
                if isinstance(r, BaseException):
                    self.count("burst", f"client error {type(r).__name__}")
                    self.errors.append(f"burst: {r!r}")
                else:
                    self.count_response("burst", r)

    async def sampler(self, until: float, pid: int | None, samples: list[dict]) -> None:
        start = time.monotonic()
        while True:
            samples.append(
                {"t": round(time.monotonic() - start, 1), "rss_mib": rss_mib(pid), "gpu_mib": gpu_mib()}
            )
            if time.monotonic() >= until:
                return
            await asyncio.sleep(min(self.args.sample_every, max(until - time.monotonic(), 0.1)))

    async def gauges_after(self) -> dict[str, float]:
        names = (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "qwen4exp_admission_running",
            "qwen4exp_admission_queued",
        )
        values: dict[str, float] = {}
        for _ in range(60):
            text = (await self.client.get(self.url + "/metrics", headers=self.auth)).text
            values = {n: 0.0 for n in names}
            for line in text.splitlines():
                for n in names:
                    if line.startswith(n + "{") or line.startswith(n + " "):
                        values[n] += float(line.rsplit(" ", 1)[1])
            if not any(values.values()):
                break
            await asyncio.sleep(0.5)
        return values

    async def server_statuses(self) -> dict[str, float]:
        """The service's own count of generation answers by status (``qwen4exp_http_requests_total``;
        the 503s of ``/ready`` while the service loads are left out)."""
        text = (await self.client.get(self.url + "/metrics", headers=self.auth)).text
        out: Counter[str] = Counter()
        for line in text.splitlines():
            if line.startswith("qwen4exp_http_requests_total{") and any(
                f'route="{r}"' in line for r in GENERATION
            ):
                status = line.split('status="', 1)[1].split('"', 1)[0]
                out[status] += float(line.rsplit(" ", 1)[1])
        return dict(sorted(out.items()))

    async def run(self, pid: int | None) -> dict:
        started = time.monotonic()
        until = started + self.args.minutes * 60
        samples: list[dict] = []
        tasks = [self.worker(until) for _ in range(self.args.workers)]
        await asyncio.gather(*tasks, self.burst(until), self.sampler(until, pid, samples))
        elapsed = time.monotonic() - started
        gauges = await self.gauges_after()
        statuses = await self.server_statuses()
        samples.append(
            {"t": round(time.monotonic() - started, 1), "rss_mib": rss_mib(pid), "gpu_mib": gpu_mib()}
        )
        await self.client.aclose()
        return {
            "elapsed_s": round(elapsed, 1),
            "samples": samples,
            "gauges_after": gauges,
            "server_statuses": statuses,
        }


def memory_row(samples: list[dict], key: str, warmup_s: float) -> str:
    values = [(s["t"], s[key]) for s in samples if s[key] is not None]
    if not values:
        return "n/a"
    after_warmup = [v for t, v in values if t >= warmup_s] or [values[-1][1]]
    base, end = after_warmup[0], values[-1][1]
    return f"{base:.0f} -> {end:.0f} MiB (drift {end - base:+.0f} MiB, max {max(v for _, v in values):.0f})"


def table(result: dict, outcomes: Counter, errors: list[str], warmup_s: float) -> str:
    kinds = sorted({k for k, _ in outcomes})
    rows = [
        f"Soak: {result['elapsed_s'] / 60:.1f} min, {sum(outcomes.values())} requests",
        "",
        "| kind | outcome | count |",
        "|---|---|---|",
    ]
    for kind in kinds:
        for (k, outcome), n in sorted(outcomes.items()):
            if k == kind:
                rows.append(f"| {kind} | {outcome} | {n} |")
    fives = sum(n for (_, o), n in outcomes.items() if o.startswith("5"))
    rows += [
        "",
        f"- 5xx: {fives} seen by the clients, "
        f"{sum(v for k, v in result['server_statuses'].items() if k.startswith('5')):.0f} counted by the service",
        f"- unexpected client-side errors: {len(errors)}",
        f"- the service's own count of generation answers by status: "
        f"{ {k: int(v) for k, v in result['server_statuses'].items()} }",
        f"- gauges after the run: {result['gauges_after']}",
        f"- resident memory (service + engine), from the end of warm-up ({warmup_s:.0f} s): "
        + memory_row(result["samples"], "rss_mib", warmup_s),
        "- GPU memory: " + memory_row(result["samples"], "gpu_mib", warmup_s),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--url", help="a running service (default: start one on loopback)")
    parser.add_argument("--key", default=KEY, help="bearer key of --url's service")
    parser.add_argument("--pid", type=int, help="the --url service's process id, for its memory")
    parser.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "tiny")
    parser.add_argument("--name", default=None, help="served model name (default: the directory name)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--max-queued", type=int, default=8)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--burst", type=int, default=64, help="requests per overload burst")
    parser.add_argument("--burst-every", type=float, default=60.0)
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--warmup-fraction", type=float, default=0.1, help="memory drift counts from here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the counts and samples here")
    args = parser.parse_args(argv)
    args.name = args.name or args.model.name

    proc = None
    log_path = Path(tempfile.mkdtemp(prefix="soak-")) / "service.log"
    if args.url is None:
        proc, url = start_service(args, log_path)
        pid = proc.pid
        print(f"service on {url} (log {log_path})", flush=True)
    else:
        url, pid = args.url, args.pid
    soak = Soak(url, args)
    try:
        result = asyncio.run(soak.run(pid))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
    warmup_s = args.minutes * 60 * args.warmup_fraction
    print(table(result, soak.outcomes, soak.errors, warmup_s))
    for line in soak.errors[:20]:
        print("  error:", line)
    if proc is not None:
        print(f"- service exit code after SIGTERM: {proc.returncode}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "outcomes": [
                {"kind": k, "outcome": o, "count": n} for (k, o), n in sorted(soak.outcomes.items())
            ],
            "errors": soak.errors,
            "exit_code": None if proc is None else proc.returncode,
            **result,
        }
        args.json.write_text(json.dumps(data, indent=1))
    fives = sum(n for (_, o), n in soak.outcomes.items() if o.startswith("5"))
    fives += sum(v for k, v in result["server_statuses"].items() if k.startswith("5"))
    return 1 if fives or soak.errors else 0


if __name__ == "__main__":
    sys.exit(main())
