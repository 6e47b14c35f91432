"""Calibrate the FP8 QSA KV cache's static scales (compose's ``calibrate`` profile).

``python -m service.calibrate --prompts FILE --dumps DIR --out SIDECAR [--margin 1.1]``

The steps the README documents by hand, in one container: the service starts on loopback with the
collector on (``VLLM_QSA_KV_COLLECT=DIR``, eager mode, which the collector needs, and the bf16 KV
cache, so the absmax seen is that of unquantised K/V), answers every prompt of ``FILE`` (one per
line), and is stopped with SIGTERM, which writes each rank's final dump. Then
``model.qsa_kv.merge`` turns the dumps into the sidecar (max over ranks, ``absmax / 448 * margin``,
validated as the server validates it, written atomically), and the result is checked once more
against the checkpoint's QSA layers, exactly as the serving preflight does. Old dumps in ``DIR``
are removed first: the merge refuses a directory mixing runs, and stale ranks would be merged in.

``--merge-only`` skips the serving run (dumps already collected, e.g. by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from model.qsa_kv.merge import MergeError, merge_directory
from model.qsa_kv.runtime import DUMP_GLOB

# What the collecting service must not inherit from the serving configuration.
DROPPED = ("VLLM_QSA_KV_SCALES", "VLLM_QSA_KV_CLIP_COUNT", "QWEN4EXP_API_KEYS", "QWEN4EXP_API_KEYS_FILE")


def read_prompts(path: Path) -> list[str]:
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompt (one per line expected)")
    return prompts


def collecting_env(base: dict[str, str], dumps: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in DROPPED}
    env.update(
        QWEN4EXP_ENFORCE_EAGER="true",
        QWEN4EXP_KV_CACHE_DTYPE="auto",
        QWEN4EXP_HOST="127.0.0.1",
        QWEN4EXP_PORT=str(port),
        VLLM_QSA_KV_COLLECT=str(dumps),
    )
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the collecting service exited with code {proc.returncode} before it was ready"
            )
        try:
            with urllib.request.urlopen(url + "/ready", timeout=15) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise RuntimeError(f"the collecting service was not ready within {timeout_s:.0f} s")


def complete(url: str, model: str, prompt: str, max_tokens: int) -> int:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return int(json.loads(r.read())["usage"]["total_tokens"])


def collect(args: argparse.Namespace, prompts: list[str]) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = collecting_env(dict(os.environ), args.dumps, port)
    model = env.get("QWEN4EXP_SERVED_MODEL_NAME") or Path(env.get("QWEN4EXP_MODEL", "model")).name
    print(f"calibrate: starting the service (eager, bf16 KV cache, collector -> {args.dumps})", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "service"], env=env)
    try:
        wait_ready(url, proc, args.ready_timeout)
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            tokens = sum(pool.map(lambda p: complete(url, model, p, args.max_tokens), prompts))
        print(f"calibrate: {len(prompts)} prompts answered, {tokens} tokens through the model", flush=True)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # final dump of every rank at exit
            try:
                proc.wait(timeout=args.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def check_against_checkpoint(sidecar: Path, checkpoint: Path | None) -> str:
    """The serving preflight's own check of the sidecar (``service.cuda_preflight.sidecar_problem``)."""
    from service.preflight_checks import sidecar_problem

    if checkpoint is None:
        return "no QWEN4EXP_MODEL to check against"
    problem = sidecar_problem(sidecar, checkpoint)
    if problem:
        raise MergeError(problem)
    return f"matches the QSA layers of {checkpoint}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=Path, help="calibration prompts, one per line")
    parser.add_argument("--dumps", type=Path, required=True, help="collector directory")
    parser.add_argument("--out", type=Path, required=True, help="sidecar to write (qsa-kv-scales.json)")
    parser.add_argument("--margin", type=float, default=1.1)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds to wait for /ready")
    parser.add_argument("--stop-timeout", type=float, default=300.0)
    parser.add_argument("--merge-only", action="store_true", help="merge the dumps already in --dumps")
    args = parser.parse_args(argv)
    checkpoint = Path(os.environ["QWEN4EXP_MODEL"]) if os.environ.get("QWEN4EXP_MODEL") else None
    try:
        if not args.merge_only:
            if args.prompts is None:
                parser.error("--prompts is required unless --merge-only")
            prompts = read_prompts(args.prompts)
            args.dumps.mkdir(parents=True, exist_ok=True)
            for old in args.dumps.glob(DUMP_GLOB):
                old.unlink()
            collect(args, prompts)
        scales, summary = merge_directory(args.dumps, args.out, args.margin)
        verdict = check_against_checkpoint(args.out, checkpoint)
    except (OSError, ValueError, RuntimeError, MergeError) as exc:
        sys.stderr.write(f"calibrate: failed: {exc}\n")
        return 1
    print(
        f"calibrate: wrote {args.out}: {len(scales)} QSA layers from {summary['num_dumps']} dump(s), "
        f"margin {args.margin}; {verdict}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
