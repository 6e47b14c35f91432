"""The static per-layer FP8 scale sidecar: format, fail-closed validation, atomic writing.

Format (``VLLM_QSA_KV_SCALES=<file>``)::

    {
      "model.layers.3.self_attn": {"k_scale": 0.0123, "v_scale": 0.0045},
      "model.layers.7.self_attn": {"k_scale": 0.0150, "v_scale": 0.0051}
    }

Keys are the QSA layer prefixes as vLLM builds the model (``model.layers.<i>.self_attn``, the
module owning q/k/v projections, for every layer whose ``layer_types`` entry is not
``linear_attention``). A cache element is stored as ``E4M3(clamp(x / scale, -448, 448))``, so
``scale = absmax / 448`` maps the largest observed value to the largest finite code.

Every way a file can be wrong is a start-up error naming the file, the layer and the field: a
scale that is silently ignored or defaulted would quietly degrade accuracy, which is exactly what
the sidecar exists to prevent. The server (``QSAKVState``) and ``python -m model.qsa_kv.merge``
call the same ``validate_sidecar``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .settings import ENV_SCALES, QSAKVConfigError

SCALE_FIELDS = ("k_scale", "v_scale")


@dataclass(frozen=True)
class LayerScales:
    k_scale: float
    v_scale: float


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {json.dumps(value)}"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return repr(value)


def scale_problem(value: Any) -> str | None:
    """Why ``value`` is not a usable scale, or None. Booleans are refused although Python calls them ints."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {_describe(value)}"
    try:
        number = float(value)
    except OverflowError:
        return f"must be finite, got {value}"
    if not math.isfinite(number):
        return f"must be finite, got {value}"
    if number <= 0:
        return f"must be > 0, got {value}"
    return None


def validate_sidecar(
    obj: Any, *, source: str, expected_layers: Sequence[str] | None, strict: bool = True
) -> dict[str, LayerScales]:
    """Check a parsed sidecar; return its scales or raise ``QSAKVConfigError`` listing every problem.

    ``expected_layers``: every QSA layer of the whole model (not only this pipeline stage's), so a
    sidecar calibrated for another model or another stage split is caught; ``None`` skips the name
    checks. ``strict`` (default) also requires every expected layer to be present.
    """
    if not isinstance(obj, dict):
        raise QSAKVConfigError(
            f"invalid QSA KV scale sidecar {source}: the top level must be a JSON object mapping layer "
            f'names to {{"k_scale": <number>, "v_scale": <number>}}, got {_describe(obj)}'
        )
    problems: list[str] = []
    expected = list(expected_layers) if expected_layers is not None else None
    scales: dict[str, LayerScales] = {}
    for layer, entry in obj.items():
        if expected is not None and layer not in expected:
            problems.append(f"layer {layer!r}: not a QSA layer of this model (its QSA layers: {expected})")
        if not isinstance(entry, dict):
            problems.append(
                f'layer {layer!r}: must be an object {{"k_scale": ..., "v_scale": ...}}, got {_describe(entry)}'
            )
            continue
        for key in entry:
            if key not in SCALE_FIELDS:
                problems.append(f"layer {layer!r} field {key!r}: unexpected key (allowed: k_scale, v_scale)")
        values: dict[str, float] = {}
        for field in SCALE_FIELDS:
            if field not in entry:
                problems.append(f"layer {layer!r} field {field!r}: missing")
                continue
            why = scale_problem(entry[field])
            if why:
                problems.append(f"layer {layer!r} field {field!r}: {why}")
            else:
                values[field] = float(entry[field])
        if len(values) == 2:
            scales[layer] = LayerScales(values["k_scale"], values["v_scale"])
    if expected is not None and strict:
        for layer in expected:
            if layer not in obj:
                problems.append(
                    f"layer {layer!r}: missing (every QSA layer of the model needs scales; "
                    "set VLLM_QSA_KV_SCALES_STRICT=0 to run missing layers at 1.0)"
                )
    if problems:
        raise QSAKVConfigError(f"invalid QSA KV scale sidecar {source}:\n  - " + "\n  - ".join(problems))
    return scales


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise QSAKVConfigError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def load_sidecar(
    path: str | os.PathLike[str], expected_layers: Sequence[str] | None, strict: bool = True
) -> dict[str, LayerScales]:
    """Read and validate a sidecar file (errors name ``VLLM_QSA_KV_SCALES=<path>``)."""
    source = f"{ENV_SCALES}={path}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise QSAKVConfigError(f"invalid QSA KV scale sidecar {source}: cannot read it: {exc}") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise QSAKVConfigError(f"invalid QSA KV scale sidecar {source}: not valid JSON: {exc}") from None
    except QSAKVConfigError as exc:
        raise QSAKVConfigError(f"invalid QSA KV scale sidecar {source}: {exc}") from None
    return validate_sidecar(obj, source=source, expected_layers=expected_layers, strict=strict)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write JSON so that readers see the old file or the complete new one, never a partial one.

    The temporary file sits in the same directory (``os.replace`` is atomic only within a file
    system) and is fsynced before the rename, so a crash cannot leave a truncated file under the
    final name.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def sidecar_json(scales: dict[str, LayerScales]) -> dict[str, dict[str, float]]:
    return {name: {"k_scale": s.k_scale, "v_scale": s.v_scale} for name, s in sorted(scales.items())}
