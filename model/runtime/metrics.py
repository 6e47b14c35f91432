"""Prometheus metrics that the model code updates inside vLLM's worker processes.

Workers are separate processes; their samples reach the API server's ``/metrics`` through
prometheus-client's multiprocess mode (the service points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh
directory before vLLM starts). Gauges therefore declare how samples of several processes
combine. Every name starts with ``qwen4exp_``; labels name the layer and the tensor-parallel rank.
"""

from __future__ import annotations

from functools import cache

from prometheus_client import Counter, Gauge

PREFIX = "qwen4exp_"


@cache
def gauge(name: str, documentation: str, labels: tuple[str, ...], mode: str = "mostrecent") -> Gauge:
    return Gauge(PREFIX + name, documentation, labels, multiprocess_mode=mode)


@cache
def counter(name: str, documentation: str, labels: tuple[str, ...]) -> Counter:
    return Counter(PREFIX + name, documentation, labels)


def tp_rank() -> str:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return str(get_tensor_model_parallel_rank())
    except Exception:  # not inside an initialised vLLM worker (unit tests)
        return "0"


def ple_table_bytes():
    return gauge(
        "ple_table_bytes",
        "Bytes of PLE n-gram table rows held by this rank, by layer and storage (device, pinned, cpu).",
        ("layer", "rank", "storage"),
    )
