"""Per-process background work of the QSA KV cache: clip-counter reader and calibration dumps.

One ``QSAKVRuntime`` per worker process knows the ``QSAKVState`` of every QSA layer that process
owns. Two optional daemon threads read their device counters through ``DeviceSnapshot`` (never on
the compute stream):

- the clip reader (``VLLM_QSA_KV_CLIP_COUNT=<seconds>``) turns counter increases into the
  Prometheus counter ``qwen4exp_qsa_kv_clipped_total{layer, rank, tensor}`` and a warning, and logs
  a heartbeat so an operator can tell "no clipping" from "reader dead";
- the collector (``VLLM_QSA_KV_COLLECT=<dir>``) writes ``<dir>/qsa_kv_absmax_dp<d>_pp<p>_tp<t>.json``
  every ``VLLM_QSA_KV_COLLECT_INTERVAL`` seconds and once more at process exit, atomically.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from model.runtime.metrics import counter, gauge

from .sidecar import atomic_write_json
from .snapshot import DeviceSnapshot

logger = logging.getLogger("vllm.qwen4exp.qsa_kv")

DUMP_FORMAT = "qwen4exp-qsa-kv-absmax/1"
DUMP_GLOB = "qsa_kv_absmax_*.json"
HEARTBEAT_S = 60.0
TENSORS = ("k", "v")


def clipped_metric():
    # prometheus_client appends "_total": the exported series is qwen4exp_qsa_kv_clipped_total.
    return counter(
        "qsa_kv_clipped",
        "K/V elements clamped to +-448 when written to the FP8 QSA KV cache (padding rows excluded).",
        ("layer", "rank", "tensor"),
    )


def scale_metric():
    return gauge(
        "qsa_kv_scale",
        "Effective static FP8 scale of a QSA layer's K or V cache (stored code = value / scale).",
        ("layer", "rank", "tensor"),
    )


def parallel_ranks() -> dict[str, int]:
    """This worker's data/pipeline/tensor-parallel position (zeros outside an initialised vLLM worker)."""
    ranks = {"dp_rank": 0, "pp_rank": 0, "pp_size": 1, "tp_rank": 0, "tp_size": 1}
    try:
        from vllm.distributed import parallel_state as ps

        ranks["tp_rank"] = ps.get_tensor_model_parallel_rank()
        ranks["tp_size"] = ps.get_tensor_model_parallel_world_size()
        ranks["pp_rank"] = ps.get_pp_group().rank_in_group
        ranks["pp_size"] = ps.get_pp_group().world_size
    except Exception:  # not inside an initialised vLLM worker (unit tests, CLI)
        pass
    try:
        from vllm.config import get_current_vllm_config

        ranks["dp_rank"] = int(get_current_vllm_config().parallel_config.data_parallel_rank or 0)
    except Exception:
        pass
    return ranks


def _logging_open() -> bool:
    """Whether every stream handler this module's records reach is still open. The final dump runs
    at interpreter exit, after a host such as pytest may have closed the stream it gave logging;
    a record sent there prints a "Logging error" traceback instead of the line (the dump itself is
    written either way)."""
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            stream = getattr(handler, "stream", None)
            if stream is not None and getattr(stream, "closed", False):
                return False
        current = current.parent if current.propagate else None
    return True


class LayerKVState(Protocol):
    """What the runtime reads from a QSA layer's KV state (``model.qsa_kv.state.QSAKVState``).

    A protocol rather than an import: the state hands itself to the runtime, so importing the
    state here would make the two modules import each other.
    """

    layer_name: str
    engine: str  # VllmConfig.instance_id of the engine whose model holds the layer
    settings: Any  # model.qsa_kv.settings.QSAKVSettings
    scale_source: str
    model_name: str
    cache_dtype: str
    expected_layers: tuple[str, ...]
    clip_counts: torch.Tensor | None
    absmax: torch.Tensor | None
    tokens: torch.Tensor | None

    @property
    def quantized(self) -> bool: ...

    @property
    def calibrated(self) -> bool: ...

    @property
    def k_scale_value(self) -> float: ...

    @property
    def v_scale_value(self) -> float: ...


class QSAKVRuntime:
    """This process's QSA layer registry: exports, logs, and the reader/dump threads (started once).

    A layer's state only holds device buffers; :meth:`attach` is everything that happens in the
    process because a layer exists: registration, its scale metric and start-up log line, and the
    background clip reader / calibration collector, each started the first time a layer needs it
    (later layers are picked up by the running thread).
    """

    def __init__(self) -> None:
        self.layers: dict[str, LayerKVState] = {}
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()  # one clip read at a time (reader thread, tests, callers)
        self._dump_lock = threading.Lock()  # periodic and at-exit dumps never interleave
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clip_interval: float | None = None
        self._clip_snapshot: DeviceSnapshot | None = None
        self._clip_last: dict[str, list[int]] = {}
        self._clip_order: list[str] = []
        self._last_heartbeat = -math.inf
        self._collect_dir: Path | None = None
        self._collect_interval: float | None = None
        self._collect_snapshot: DeviceSnapshot | None = None
        self._collect_order: list[str] = []
        self._meta: dict[str, Any] = {}
        self.ranks = parallel_ranks()

    # ---- registration ------------------------------------------------------------------------

    def attach(self, state: LayerKVState) -> None:
        """Register a layer whose buffers hold their final scales, export and log it, start readers."""
        self.add(state)
        self._export_and_log(state)
        settings = state.settings
        if state.clip_counts is not None:
            assert settings.clip_interval_s is not None
            self.start_clip_reader(settings.clip_interval_s)
        if state.absmax is not None:
            assert settings.collect_dir is not None
            self.set_meta(
                model=state.model_name,
                kv_cache_dtype=state.cache_dtype,
                expected_layers=list(state.expected_layers),
            )
            self.start_collector(Path(settings.collect_dir), settings.collect_interval_s)

    def _export_and_log(self, state: LayerKVState) -> None:
        settings = state.settings
        calibration = f"to {settings.collect_dir}" if state.absmax is not None else "off"
        if not state.quantized:
            logger.info(
                "QSA KV cache %s (rank %s): %s; calibration %s",
                state.layer_name,
                self.rank,
                state.scale_source,
                calibration,
            )
            return
        for tensor, value in (("k", state.k_scale_value), ("v", state.v_scale_value)):
            scale_metric().labels(layer=state.layer_name, rank=self.rank, tensor=tensor).set(value)
        message = "QSA KV cache %s (rank %s): fp8_e4m3, k_scale=%g v_scale=%g (%s); clip counting %s, calibration %s"
        args = (
            state.layer_name,
            self.rank,
            state.k_scale_value,
            state.v_scale_value,
            state.scale_source,
            f"every {settings.clip_interval_s:g} s" if state.clip_counts is not None else "off",
            calibration,
        )
        if not state.calibrated:
            logger.warning(
                message + ". UNCALIBRATED FP8 KV CACHE: values beyond +-448 are clipped and small values "
                "lose precision; calibrate with VLLM_QSA_KV_COLLECT and python -m model.qsa_kv.merge",
                *args,
            )
        else:
            logger.info(message, *args)

    def add(self, state: LayerKVState) -> None:
        # Ranks are read here, not at construction: registration happens after vLLM set up its groups.
        self.ranks = parallel_ranks()
        with self._lock:
            old = self.layers.get(state.layer_name)
            if old is not None and old is not state:
                if getattr(old, "engine", "") == getattr(state, "engine", ""):
                    raise ValueError(f"QSA KV state for {state.layer_name} registered twice")
                # A new engine in this process (``LLM(...)`` again with VLLM_ENABLE_V1_MULTIPROCESSING=0,
                # as benchmarks do): the earlier engine's layers are gone from the readers' view.
                stale = [
                    n
                    for n, s in self.layers.items()
                    if getattr(s, "engine", "") != getattr(state, "engine", "")
                ]
                for name in stale:
                    del self.layers[name]
                logger.info("QSA KV runtime: a new engine replaces %d layer(s) of an earlier one", len(stale))
            self.layers[state.layer_name] = state

    def set_meta(self, **meta: Any) -> None:
        self._meta.update(meta)

    # ---- clip counters -----------------------------------------------------------------------

    def start_clip_reader(self, interval_s: float) -> None:
        """Start the reader thread once; later calls only pick up newly registered layers."""
        with self._lock:
            self._clip_order = sorted(n for n, s in self.layers.items() if s.clip_counts is not None)
            for name in self._clip_order:
                self._clip_last.setdefault(name, [0, 0])
                for tensor in TENSORS:  # create the series at 0 so /metrics shows them before any clip
                    clipped_metric().labels(layer=name, rank=self.rank, tensor=tensor)
            self._clip_snapshot = DeviceSnapshot(self._clip_tensors)
            if self._clip_interval is not None:
                return
            self._clip_interval = interval_s
        self._spawn("qsa-kv-clip-reader", self._clip_loop, interval_s)

    def _clip_tensors(self) -> list:
        return [self.layers[n].clip_counts for n in self._clip_order]

    @property
    def rank(self) -> str:
        return str(self.ranks["tp_rank"])

    def poll_clips(self) -> dict[str, list[int]]:
        """Read the counters once, export increases, warn on new clips; returns per-layer [K, V] totals."""
        with self._poll_lock:
            return self._poll_clips()

    def _poll_clips(self) -> dict[str, list[int]]:
        with self._lock:
            snapshot, order = self._clip_snapshot, list(self._clip_order)
        if snapshot is None or not order:
            return {}
        values = snapshot.read()
        if values is None:  # a CUDA graph capture held the GPU: skip this round (monotonic counters)
            return {name: list(self._clip_last.get(name, [0, 0])) for name in order}
        totals: dict[str, list[int]] = {}
        news: list[str] = []
        for name, tensor in zip(order, values, strict=True):
            now = [int(x) for x in tensor.tolist()]
            last = self._clip_last.get(name, [0, 0])
            totals[name] = now
            for i, label in enumerate(TENSORS):
                delta = now[i] - last[i]
                if delta > 0:
                    clipped_metric().labels(layer=name, rank=self.rank, tensor=label).inc(delta)
            if now != last:
                state = self.layers[name]
                news.append(
                    f"{name}: K +{now[0] - last[0]} (total {now[0]}, k_scale {state.k_scale_value:g}), "
                    f"V +{now[1] - last[1]} (total {now[1]}, v_scale {state.v_scale_value:g})"
                )
            self._clip_last[name] = now
        if news:
            logger.warning(
                "QSA KV cache clipping on rank %s (values beyond +-448 * scale were clamped; "
                "recalibrate the VLLM_QSA_KV_SCALES sidecar if this persists): %s",
                self.rank,
                "; ".join(news),
            )
        now_t = time.monotonic()
        if now_t - self._last_heartbeat >= max(HEARTBEAT_S, self._clip_interval or 0.0):
            self._last_heartbeat = now_t
            logger.info(
                "QSA KV clip counter alive on rank %s: %d layers, %d K and %d V elements clipped so far",
                self.rank,
                len(order),
                sum(t[0] for t in totals.values()),
                sum(t[1] for t in totals.values()),
            )
        return totals

    def _clip_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.poll_clips()
            except Exception:  # keep counting: a failed read must not kill the reader for good
                logger.exception("QSA KV clip counter read failed")

    # ---- calibration ----------------------------------------------------------------------------

    def start_collector(self, directory: Path, interval_s: float) -> None:
        with self._lock:
            self._collect_order = sorted(n for n, s in self.layers.items() if s.absmax is not None)
            self._collect_snapshot = DeviceSnapshot(self._collect_tensors)
            if self._collect_dir is not None:
                return
            self._collect_dir = directory
            self._collect_interval = interval_s
        atexit.register(self._final_dump)
        try:  # multiprocessing children that leave through os._exit skip atexit, not these finalizers
            from multiprocessing import util

            util.Finalize(self, QSAKVRuntime._final_dump, args=(self,), exitpriority=10)
        except Exception:
            pass
        self._spawn("qsa-kv-collector", self._collect_loop, interval_s)

    def _collect_tensors(self) -> list:
        out = []
        for name in self._collect_order:
            state = self.layers[name]
            out += [state.absmax, state.tokens]
        return out

    @property
    def dump_path(self) -> Path | None:
        if self._collect_dir is None:
            return None
        r = self.ranks
        return self._collect_dir / f"qsa_kv_absmax_dp{r['dp_rank']}_pp{r['pp_rank']}_tp{r['tp_rank']}.json"

    def dump_calibration(self, final: bool = False) -> Path | None:
        """Write this rank's running absmax per layer (atomically); returns the file written."""
        with self._dump_lock:
            return self._dump_calibration(final)

    def _dump_calibration(self, final: bool) -> Path | None:
        with self._lock:
            snapshot, order, path = self._collect_snapshot, list(self._collect_order), self.dump_path
        if snapshot is None or path is None:
            return None
        values = snapshot.read()
        if values is None:  # a CUDA graph capture held the GPU: the next interval writes the file
            return None
        layers: dict[str, dict[str, Any]] = {}
        for i, name in enumerate(order):
            absmax, tokens = values[2 * i].tolist(), int(values[2 * i + 1].item())
            layers[name] = {
                "k_absmax": absmax[0] if math.isfinite(absmax[0]) else None,
                "v_absmax": absmax[1] if math.isfinite(absmax[1]) else None,
                "tokens": tokens,
            }
        doc = {
            "format": DUMP_FORMAT,
            **self.ranks,
            **self._meta,
            "layers": layers,
            "final": final,
            "written_at": time.time(),
        }
        atomic_write_json(path, doc)
        return path

    def _collect_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.dump_calibration()
            except Exception:
                logger.exception("QSA KV calibration dump failed")

    def _final_dump(self) -> None:
        if getattr(self, "_final_done", False):
            return
        self._final_done = True
        self._stop.set()
        try:
            path = self.dump_calibration(final=True)
            if path is not None and _logging_open():
                logger.info("QSA KV calibration: final absmax dump written to %s", path)
        except Exception:
            if _logging_open():
                logger.exception("QSA KV calibration: final dump failed")

    # ---- threads --------------------------------------------------------------------------------

    def _spawn(self, name: str, target, interval_s: float) -> None:
        thread = threading.Thread(target=target, args=(interval_s,), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        """Stop the threads (tests); the process-exit dump still runs if a collector was started."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)


_RUNTIME: QSAKVRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def get_runtime() -> QSAKVRuntime:
    """The process-wide runtime (each vLLM worker process has its own)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = QSAKVRuntime()
        return _RUNTIME
