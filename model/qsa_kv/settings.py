"""Start-up settings of the QSA KV cache: cache format and the ``VLLM_QSA_KV_*`` variables.

Everything is parsed once per worker, when the first QSA layer is built, and every malformed
value raises ``QSAKVConfigError``: a scale file or counter interval that is silently ignored would
change numerics or hide clipping in production, so the server must not start instead.

The variables themselves (parsers, defaults, docs) are declared in ``model.runtime.envs``, which the
service validates at start-up with the same parsers and checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from model.runtime import envs

ENV_SCALES = envs.QSA_KV_SCALES
ENV_SCALES_STRICT = envs.QSA_KV_SCALES_STRICT
ENV_COLLECT = envs.QSA_KV_COLLECT
ENV_COLLECT_INTERVAL = envs.QSA_KV_COLLECT_INTERVAL
ENV_CLIP_COUNT = envs.QSA_KV_CLIP_COUNT
ALL_ENV = (ENV_SCALES, ENV_SCALES_STRICT, ENV_COLLECT, ENV_COLLECT_INTERVAL, ENV_CLIP_COUNT)

DEFAULT_COLLECT_INTERVAL_S = envs.DEFAULT_COLLECT_INTERVAL_S

# Storage formats of a QSA layer's K/V: the model dtype as is, or E4M3 codes in uint8.
NATIVE = "native"
FP8_E4M3 = "fp8_e4m3"
_FP8_NAMES = ("fp8", "fp8_e4m3")
_FLOAT_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


class QSAKVConfigError(ValueError):
    """A start-up configuration error of the QSA KV cache (the message names what to fix)."""


def resolve_kv_format(cache_dtype: str, model_dtype: torch.dtype) -> str:
    """Storage format of QSA K/V for vLLM's ``--kv-cache-dtype``.

    ``auto`` or the model's own dtype keep K/V unquantised; ``fp8``/``fp8_e4m3`` store E4M3 codes.
    Anything else is refused: E5M2 and the per-token/packed formats have no scale handling here, and
    a float cache dtype different from the model dtype would need a conversion nobody validated.
    """
    name = str(cache_dtype)
    if name == "auto":
        return NATIVE
    if name in _FP8_NAMES:
        return FP8_E4M3
    if name in _FLOAT_NAMES and _FLOAT_NAMES[name] == model_dtype:
        return NATIVE
    raise QSAKVConfigError(
        f"--kv-cache-dtype {name!r} is not supported by Qwen4-Exp QSA layers (model dtype "
        f"{str(model_dtype).removeprefix('torch.')}): use 'auto', the model dtype, 'fp8' or 'fp8_e4m3'"
    )


@dataclass(frozen=True)
class QSAKVSettings:
    """The parsed ``VLLM_QSA_KV_*`` variables (``None`` = feature off)."""

    scales_path: Path | None = None
    strict: bool = True
    collect_dir: Path | None = None
    collect_interval_s: float = DEFAULT_COLLECT_INTERVAL_S
    clip_interval_s: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> QSAKVSettings:
        """Read the variables through ``model.runtime.envs`` (one parser for the model and the service)."""
        try:
            return cls(
                scales_path=envs.read(ENV_SCALES, env),
                strict=envs.read(ENV_SCALES_STRICT, env),
                collect_dir=envs.read(ENV_COLLECT, env),
                collect_interval_s=envs.read(ENV_COLLECT_INTERVAL, env),
                clip_interval_s=envs.read(ENV_CLIP_COUNT, env),
            )
        except envs.EnvError as exc:
            raise QSAKVConfigError(str(exc)) from None

    def check_against(self, kv_format: str, eager: bool) -> None:
        """Refuse combinations that cannot mean what the operator asked for."""
        if kv_format != FP8_E4M3 and self.scales_path is not None:
            raise QSAKVConfigError(
                f"{ENV_SCALES}={self.scales_path}: a scale sidecar was given but the KV cache is not FP8 "
                "(scales only apply to --kv-cache-dtype fp8/fp8_e4m3); unset it or switch the cache dtype"
            )
        if kv_format != FP8_E4M3 and self.clip_interval_s is not None:
            raise QSAKVConfigError(
                f"{ENV_CLIP_COUNT}={self.clip_interval_s:g}: clip counting needs --kv-cache-dtype "
                "fp8/fp8_e4m3 (an unquantised cache never clips)"
            )
        if self.collect_dir is not None and not eager:
            raise QSAKVConfigError(
                f"{ENV_COLLECT}={self.collect_dir}: calibration needs eager execution (enforce_eager=True / "
                "--enforce-eager); CUDA graphs or torch.compile would freeze or drop the running absmax"
            )
        if self.collect_dir is not None:
            try:
                envs.prepare_collect_dir(self.collect_dir)
            except envs.EnvError as exc:
                raise QSAKVConfigError(str(exc)) from None
