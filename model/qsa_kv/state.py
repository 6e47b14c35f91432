"""``QSAKVState``: the FP8 scales and statistics of one QSA layer, as device tensors.

Only buffers and the per-step ops on them live here; what a layer means for the process (its
metric, its log line, the reader and collector threads) is ``runtime.QSAKVRuntime.attach``. The
runtime does not import this module (it reads a layer through a protocol), so there is no cycle.

Built inside the layer's constructor, which is where start-up errors must surface: settings and the
sidecar are validated then, before any weight is loaded. The scale *values* are written into the
device buffers later, in ``apply()``, which the layer calls from vLLM's post-load hook
(``process_weights_after_loading``): after the weights, before the profiling/warm-up run and any
CUDA-graph capture, so a captured graph reads the final scales. The scales are one-element tensors
(not Python floats) for the same reason: the kernel reads them from memory, so graphs stay valid.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
from torch import nn

from model.ops.fp8_e4m3 import encode_e4m3

from . import ops
from .runtime import get_runtime
from .settings import ENV_SCALES, ENV_SCALES_STRICT, FP8_E4M3, QSAKVConfigError, QSAKVSettings
from .sidecar import LayerScales, load_sidecar


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int, expected: tuple[str, ...], strict: bool) -> dict[str, LayerScales]:
    """Every QSA layer of a worker validates the same file: parse it once (errors are not cached)."""
    return load_sidecar(path, expected, strict)


def load_scales(settings: QSAKVSettings, expected_layers: Sequence[str]) -> dict[str, LayerScales]:
    assert settings.scales_path is not None
    path = str(settings.scales_path)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as exc:
        raise QSAKVConfigError(
            f"invalid QSA KV scale sidecar {ENV_SCALES}={path}: cannot read it: {exc}"
        ) from None
    return _load_cached(path, mtime, tuple(expected_layers), settings.strict)


class QSAKVState(nn.Module):
    """Scales, clip counters and calibration absmax of one QSA layer's KV cache.

    Buffers (non-persistent, so checkpoints never see them): ``k_scale``/``v_scale`` float32 ``[1]``;
    ``clip_counts`` int64 ``[2]`` (K, V) when ``VLLM_QSA_KV_CLIP_COUNT`` is set; ``absmax`` float32
    ``[2]`` and ``tokens`` int64 ``[1]`` when ``VLLM_QSA_KV_COLLECT`` is set.
    """

    def __init__(
        self,
        *,
        layer_name: str,
        kv_format: str,
        settings: QSAKVSettings,
        expected_layers: Sequence[str],
        eager: bool,
        model: str = "",
        cache_dtype: str = "",
        engine: str = "",
    ) -> None:
        super().__init__()
        if layer_name not in expected_layers:
            raise ValueError(
                f"QSA layer {layer_name} is not among the model's QSA layers {list(expected_layers)}"
            )
        settings.check_against(kv_format, eager)
        self.layer_name = layer_name
        self.kv_format = kv_format
        self.settings = settings
        self.expected_layers = tuple(expected_layers)
        self.model_name = model
        self.cache_dtype = cache_dtype
        self.engine = engine  # vLLM's VllmConfig.instance_id: which engine of this process owns the layer
        self.static: LayerScales | None = None
        self.scale_source = "unquantised cache (no scales)"
        if kv_format == FP8_E4M3:
            if settings.scales_path is None:
                self.scale_source = f"default 1.0: {ENV_SCALES} is not set"
            else:
                self.static = load_scales(settings, self.expected_layers).get(layer_name)
                self.scale_source = (
                    f"sidecar {settings.scales_path}"
                    if self.static is not None
                    else f"default 1.0: missing from {settings.scales_path} ({ENV_SCALES_STRICT}=0)"
                )
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        counting = kv_format == FP8_E4M3 and settings.clip_interval_s is not None
        self.register_buffer(
            "clip_counts", torch.zeros(2, dtype=torch.int64) if counting else None, persistent=False
        )
        collecting = settings.collect_dir is not None
        self.register_buffer(
            "absmax", torch.zeros(2, dtype=torch.float32) if collecting else None, persistent=False
        )
        self.register_buffer(
            "tokens", torch.zeros(1, dtype=torch.int64) if collecting else None, persistent=False
        )
        self.applied = False

    @property
    def quantized(self) -> bool:
        return self.kv_format == FP8_E4M3

    @property
    def k_scale_value(self) -> float:
        return self.static.k_scale if self.static is not None else 1.0

    @property
    def v_scale_value(self) -> float:
        return self.static.v_scale if self.static is not None else 1.0

    @property
    def calibrated(self) -> bool:
        """Whether the scales come from a sidecar (an FP8 cache without one runs at 1.0)."""
        return self.static is not None

    def apply(self) -> None:
        """Write the effective scales into the device buffers, then hand the layer to the process
        runtime (which registers, exports and logs it and starts the background readers once)."""
        self.k_scale.fill_(self.k_scale_value)
        self.v_scale.fill_(self.v_scale_value)
        get_runtime().attach(self)
        self.applied = True

    def observe(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Accumulate this step's statistics of the pre-quantisation K/V rows being written (slots >= 0)."""
        if self.clip_counts is None and self.absmax is None:
            return
        keep = slots >= 0
        if self.clip_counts is not None:
            ops.count_clips_(self.clip_counts, k, v, self.k_scale, self.v_scale, keep)
        if self.absmax is not None:
            ops.update_absmax_(self.absmax, self.tokens, k, v, keep)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """E4M3 codes of ``k / k_scale`` and ``v / v_scale`` (clamped to +-448)."""
        return encode_e4m3(k, self.k_scale), encode_e4m3(v, self.v_scale)
