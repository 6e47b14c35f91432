"""Our front end (``python -m service``) against vLLM's own OpenAI server on the same model and load.

Both servers run in turn (never together) on loopback with the same engine settings (eager,
prefix caching off, same max model length, an API key), and get the same fixed number of chat
completion requests from ``--concurrency`` client loops. Reported per server: requests/s, latency
p50/p99 (whole request; first token too with ``--stream``) and generated tokens/s; then the ratios.
The difference measures what our layer costs on top of vLLM's: auth, admission, body limit, error
reshaping and HTTP metrics middlewares, multiprocess Prometheus.

    .venv/bin/python bench/bench_service.py                      # tiny model, 64 requests, 4 loops
    .venv/bin/python bench/bench_service.py --requests 128 --concurrency 8 --stream --rounds 2

``vllm`` (the console script) is broken on the CPU build, hence ``python -m vllm.entrypoints...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' loopback plumbing
from tests.net import free_port  # noqa: E402

HOST = "127.0.0.1"  # loopback only
KEY = "bench-key"


@dataclass
class Result:
    name: str
    requests: int
    seconds: float
    latencies: list[float]
    ttfts: list[float]
    tokens: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def pct(self, values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def server_command(kind: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN4EXP_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
    if kind == "service":
        env.update(
            QWEN4EXP_MODEL=str(args.model),
            QWEN4EXP_SERVED_MODEL_NAME="bench",
            QWEN4EXP_HOST=HOST,
            QWEN4EXP_PORT=str(port),
            QWEN4EXP_API_KEYS=KEY,
            QWEN4EXP_MAX_MODEL_LEN=str(args.max_model_len),
            QWEN4EXP_ENFORCE_EAGER="true",
            QWEN4EXP_LOG_LEVEL="warning",
        )
        return [sys.executable, "-m", "service"], env
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(args.model), "--served-model-name", "bench",
        "--host", HOST, "--port", str(port), "--api-key", KEY,
        "--max-model-len", str(args.max_model_len),
        "--enforce-eager", "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    return cmd, env


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting")
        try:
            r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not start in time")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def payload(i: int, args: argparse.Namespace) -> dict:
    words = " ".join(f"word{(i * 7 + j) % 97}" for j in range(args.prompt_words))
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # vLLM extension: every request generates exactly max_tokens
    }
    if args.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, int]:
    started = time.perf_counter()
    if not body.get("stream"):
        r = await client.post(url, json=body)
        r.raise_for_status()
        elapsed = time.perf_counter() - started
        return elapsed, elapsed, r.json()["usage"]["completion_tokens"]
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in event["choices"]):
                first = time.perf_counter() - started
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    elapsed = time.perf_counter() - started
    return elapsed, first if first is not None else elapsed, tokens


async def load(base: str, args: argparse.Namespace, n: int) -> tuple[float, list[tuple[float, float, int]]]:
    """``n`` requests from ``args.concurrency`` loops; returns wall time and per-request results."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    results: list[tuple[float, float, int]] = []
    headers = {"Authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=300, limits=limits) as client:

        async def loop() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results.append(await one(client, base + "/v1/chat/completions", payload(i, args)))

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(args.concurrency)))
        return time.perf_counter() - started, results


def run_one(kind: str, args: argparse.Namespace) -> Result:
    port = free_port()
    cmd, env = server_command(kind, args, port)
    with tempfile.NamedTemporaryFile("wb", prefix=f"bench-{kind}-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://{HOST}:{port}"
    try:
        started = time.monotonic()
        wait_ready(base, proc)
        print(f"# {kind}: up in {time.monotonic() - started:.0f} s (log {log.name})", file=sys.stderr)
        asyncio.run(load(base, args, args.warmup))
        seconds, results = asyncio.run(load(base, args, args.requests))
    finally:
        stop(proc)
    return Result(
        name="qwen4exp service" if kind == "service" else "vLLM api_server",
        requests=len(results),
        seconds=seconds,
        latencies=[r[0] for r in results],
        ttfts=[r[1] for r in results],
        tokens=sum(r[2] for r in results),
    )


def pool(results: list[Result]) -> Result:
    """One result from several rounds of the same server: all latencies, total time."""
    return Result(
        name=results[0].name,
        requests=sum(r.requests for r in results),
        seconds=sum(r.seconds for r in results),
        latencies=[x for r in results for x in r.latencies],
        ttfts=[x for r in results for x in r.ttfts],
        tokens=sum(r.tokens for r in results),
    )


def table(results: list[Result], args: argparse.Namespace) -> str:
    head = "| server | requests | concurrency | req/s | p50 latency (s) | p99 latency (s) |"
    sep = "|---|---|---|---|---|---|"
    if args.stream:
        head += " p50 TTFT (s) |"
        sep += "---|"
    head += " gen tok/s |"
    sep += "---|"
    rows = [head, sep]
    for r in results:
        row = (
            f"| {r.name} | {r.requests} | {args.concurrency} | {r.rps:.2f} | "
            f"{r.pct(r.latencies, 0.5):.3f} | {r.pct(r.latencies, 0.99):.3f} |"
        )
        if args.stream:
            row += f" {r.pct(r.ttfts, 0.5):.3f} |"
        row += f" {r.tokens / r.seconds:.0f} |"
        rows.append(row)
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "tiny")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument(
        "--stream", action="store_true", help="SSE streaming; also reports time to first token"
    )
    parser.add_argument("--only", choices=["service", "vllm"], help="run one server only")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, alternating which server goes first")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        parser.error(
            f"{args.model} has no config.json (generate it: python -m model.tools.checkpoints --preset tiny ...)"
        )
    if min(args.requests, args.concurrency, args.rounds) < 1:
        parser.error("--requests, --concurrency and --rounds must be positive")

    kinds = [args.only] if args.only else ["service", "vllm"]
    runs: dict[str, list[Result]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        order = kinds if round_ % 2 == 0 else kinds[::-1]  # ABBA: neither server always goes first
        for kind in order:
            result = run_one(kind, args)
            runs[kind].append(result)
            print(f"# round {round_ + 1} {kind}: {result.rps:.2f} req/s", file=sys.stderr)
    results = [pool(runs[kind]) for kind in kinds]
    mode = "streaming" if args.stream else "non-streaming"
    print(
        f"model {args.model.name}, chat completions ({mode}), {args.prompt_words}-word prompts, "
        f"{args.max_tokens} tokens each (ignore_eos), {args.warmup} warm-up requests, "
        f"{args.rounds} round(s) per server\n"
    )
    print(table(results, args))
    if len(results) == 2:
        ours, theirs = results
        print(
            f"\nratio service / vLLM: req/s {ours.rps / theirs.rps:.3f}, "
            f"p50 latency {ours.pct(ours.latencies, 0.5) / theirs.pct(theirs.latencies, 0.5):.3f}, "
            f"p99 latency {ours.pct(ours.latencies, 0.99) / theirs.pct(theirs.latencies, 0.99):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
