"""vllm-router's overhead: the same streamed load straight to one replica and through the router.

The router fronts that one replica only, so any difference is the router's (an extra hop, its
policy, and for cache_aware the tokenization it asks the replica for), not a second replica's
capacity. Both targets get the same requests at the same concurrency; the passes alternate
(direct, router, direct, router, ...) so a drift of the machine hits both alike. Reported per
target: output tokens/s, time to first token p50/p99, and the router/direct ratios.

    # against running servers (e.g. the chart's router with one replica behind it)
    python bench/router_overhead.py --direct http://replica:8000 --router http://router:8000 \
        --key "$KEY" --model qwen4-exp --concurrency 64 --requests 512 --max-tokens 256

    # self-contained on the CPU: starts one `tiny` replica and vllm-router on loopback
    python bench/router_overhead.py --launch checkpoints/tiny --concurrency 4 --requests 48

Timing only: nothing is asserted (tests/router checks behaviour).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' loopback plumbing
from tests.net import free_port  # noqa: E402

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()


@dataclass
class Pass:
    target: str
    seconds: float
    output_tokens: int
    ttft: list[float]
    errors: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def prompt(i: int, words: int) -> list[dict]:
    """Distinct prompts (no prefix shared across requests): the router's cache-aware tree and the
    replica's prefix cache give neither target an advantage."""
    text = " ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] for k in range(words))
    return [{"role": "user", "content": f"request {i}: {text}"}]


async def one(api: openai.AsyncOpenAI, model: str, i: int, args) -> tuple[int, float | None, bool]:
    start = time.perf_counter()
    first, tokens = None, 0
    try:
        stream = await api.chat.completions.create(
            model=model,
            messages=prompt(i, args.prompt_words),
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIError:
        return 0, None, False
    return tokens, first, True


async def run_pass(name: str, url: str, args, offset: int) -> Pass:
    api = openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key=args.key,
        max_retries=0,
        timeout=600,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=args.concurrency + 8)),
    )
    queue = list(range(offset, offset + args.requests))
    results: list[tuple[int, float | None, bool]] = []

    async def worker() -> None:
        while queue:
            i = queue.pop()
            results.append(await one(api, args.model, i, args))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    seconds = time.perf_counter() - start
    await api.close()
    return Pass(
        name,
        seconds,
        sum(t for t, _, _ in results),
        [f for _, f, ok in results if ok and f is not None],
        sum(1 for *_, ok in results if not ok),
    )


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready in {timeout} s:\n{log.read_text()[-3000:]}")


@contextmanager
def launched(checkpoint: Path, key: str, policy: str):
    """One ``python -m service`` replica and vllm-router (this venv's) in front of it, on loopback."""
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    replica_port, router_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN4EXP_", "PROMETHEUS_MULTIPROC_DIR"))}
    env |= {
        "QWEN4EXP_MODEL": str(checkpoint.resolve()),
        "QWEN4EXP_HOST": "127.0.0.1",
        "QWEN4EXP_PORT": str(replica_port),
        "QWEN4EXP_API_KEYS": key,
        "QWEN4EXP_MAX_MODEL_LEN": "2048",
        "QWEN4EXP_MAX_CONCURRENT_REQUESTS": "256",
        "QWEN4EXP_MAX_QUEUED_REQUESTS": "1024",
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "TMPDIR": str(tmp),
    }
    procs = []
    try:
        with open(tmp / "replica.log", "wb") as log:
            procs.append(
                subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=log, stderr=log)
            )
        replica = f"http://127.0.0.1:{replica_port}"
        wait_http(replica + "/ready", procs[0], tmp / "replica.log", 300)
        router_bin = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"
        router_args = [
            router_bin, "--host", "127.0.0.1", "--port", str(router_port), "--worker-urls", replica,
            "--policy", policy, "--prometheus-port", str(free_port()), "--health-check-endpoint", "/ready",
        ]  # fmt: skip
        with open(tmp / "router.log", "wb") as log:
            procs.append(subprocess.Popen(router_args, stdout=log, stderr=log))
        router = f"http://127.0.0.1:{router_port}"
        wait_http(router + "/readiness", procs[1], tmp / "router.log", 60)
        yield replica, router
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


async def measure(direct: str, router: str, args) -> list[Pass]:
    await run_pass(
        "warm-up", direct, argparse.Namespace(**{**vars(args), "requests": args.concurrency}), 10**6
    )
    passes = []
    for r in range(args.rounds):
        for t, (name, url) in enumerate((("direct", direct), ("router", router))):
            # Prompts never repeat across passes: no pass finds another's prompts in the prefix cache.
            passes.append(await run_pass(name, url, args, offset=(2 * r + t + 1) * 10**5))
    return passes


def report(passes: list[Pass], args) -> str:
    rows = [
        "| target | concurrency | requests | output tok/s | TTFT p50 (s) | TTFT p99 (s) | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for name in ("direct", "router"):
        mine = [p for p in passes if p.target == name]
        tps = statistics.median(p.tokens_per_s for p in mine)
        ttft = [t for p in mine for t in p.ttft]
        p50, p99 = percentile(ttft, 0.5), percentile(ttft, 0.99)
        summary[name] = (tps, p50, p99)
        rows.append(
            f"| {name} | {args.concurrency} | {sum(args.requests for _ in mine)} | {tps:.1f} | "
            f"{p50:.3f} | {p99:.3f} | {sum(p.errors for p in mine)} |"
        )
    d, r = summary["direct"], summary["router"]
    rows.append("")
    rows.append(
        f"router/direct: throughput {r[0] / d[0]:.3f}, TTFT p50 {r[1] / d[1]:.3f}, TTFT p99 {r[2] / d[2]:.3f} "
        f"(overhead {100 * (1 - r[0] / d[0]):+.1f}% tokens/s)"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--direct", help="one replica's base URL")
    parser.add_argument("--router", help="the router's base URL (with that one replica behind it)")
    parser.add_argument("--launch", type=Path, help="checkpoint: start one replica and the router here")
    parser.add_argument("--policy", default="cache_aware", help="router policy with --launch")
    parser.add_argument("--key", default=os.environ.get("QWEN4EXP_BENCH_KEY", "bench-key"))
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--concurrency", type=int, default=64, help="streams in flight")
    parser.add_argument("--requests", type=int, default=256, help="requests per pass")
    parser.add_argument("--rounds", type=int, default=3, help="direct/router pass pairs")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=60)
    args = parser.parse_args()
    if args.launch is None and not (args.direct and args.router):
        parser.error("give --direct and --router, or --launch CHECKPOINT")

    def go(direct: str, router: str) -> None:
        if args.model is None:
            models = httpx.get(
                direct + "/v1/models", headers={"Authorization": f"Bearer {args.key}"}, timeout=30
            )
            args.model = models.json()["data"][0]["id"]
        passes = asyncio.run(measure(direct, router, args))
        print(report(passes, args))

    if args.launch is not None:
        with launched(args.launch, args.key, args.policy) as (direct, router):
            go(direct, router)
    else:
        go(args.direct.rstrip("/"), args.router.rstrip("/"))


if __name__ == "__main__":
    main()
