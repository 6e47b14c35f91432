"""Helpers of the QSA FP8 KV tests: engine runs, metrics, merging dumps.

The outlier variant of the tiny checkpoint (K/V beyond E4M3's +-448 with the same BF16 logits) is
:func:`model.tools.cases.make_outlier_checkpoint`, shared with ``bench/qsa_kv_accuracy.py``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from model.tools.cases import V_FACTOR, make_outlier_checkpoint, qsa_layer_indices  # noqa: F401 (re-exported)

ROOT = Path(__file__).resolve().parents[2]


def run_merge(dumps: Path, sidecar: Path, margin: str = "1.1") -> subprocess.CompletedProcess:
    """``python -m model.qsa_kv.merge --out SIDECAR DUMPS --margin M``, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "model.qsa_kv.merge", "--out", str(sidecar), str(dumps), "--margin", margin],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


@contextmanager
def patched_env(**values: str | None) -> Iterator[None]:
    """Set (or, with None, remove) environment variables for the duration, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


QSA_ENV = (
    "VLLM_QSA_KV_SCALES",
    "VLLM_QSA_KV_SCALES_STRICT",
    "VLLM_QSA_KV_COLLECT",
    "VLLM_QSA_KV_COLLECT_INTERVAL",
    "VLLM_QSA_KV_CLIP_COUNT",
)


@contextmanager
def output_to(log_path: Path) -> Iterator[None]:
    """Send this process's stdout/stderr file descriptors to ``log_path`` for the duration.

    vLLM's engine and worker processes inherit the descriptors when they are spawned, so wrapping
    the engine's construction captures their logs for the whole engine lifetime.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def prompt_logprobs_run(
    path: Path,
    prompts: list[list[int]],
    kv_cache_dtype: str,
    env: dict[str, str],
    log_path: Path,
    linger_s: float = 0.0,
) -> list[list[float]]:
    """Log-probability of every prompt token (positions 1..) under vLLM, one engine, eager, CPU.

    Only the ``VLLM_QSA_KV_*`` variables in ``env`` are set (the others are removed) while the
    engine starts, since workers read them at start-up; ``env`` may also carry e.g.
    ``PROMETHEUS_MULTIPROC_DIR``. The engine's logs go to ``log_path``. ``linger_s`` keeps the
    engine alive after the requests so background readers get at least one more period.
    """
    import time

    from vllm import LLM, SamplingParams

    settings: dict[str, str | None] = dict.fromkeys(QSA_ENV)
    settings.update(env)
    with patched_env(**settings), output_to(log_path):
        llm = LLM(
            model=str(path),
            dtype="bfloat16",
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=True,
            enable_prefix_caching=False,
            max_model_len=1024,
            seed=0,
        )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        result = []
        for ids, out in zip(prompts, outs, strict=True):
            lps = out.prompt_logprobs[1:]
            result.append([entry[tok].logprob for entry, tok in zip(lps, ids[1:], strict=True)])
        if linger_s:
            time.sleep(linger_s)
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def mean_abs_error(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(diffs) / len(diffs)


def multiproc_samples(directory: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample in a Prometheus multiprocess directory: (name, sorted labels) -> value."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    out = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
