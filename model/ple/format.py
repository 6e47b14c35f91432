"""The PLE table format a checkpoint declares: the one reader of ``ple_embedding_dtype``.

Why one reader: the planner, the table loader and the offline quantizer each used to read the
field their own way (the planner mapped ``"fp8"`` to E4M3 where the loader refused it, the
quantizer ignored ``quantization_config``), so the planner could size a checkpoint the engine
then refused to load. All three now call :func:`table_format_of`, so they accept and refuse
exactly the same values with the same message.

Only the standard library is imported: the planner runs without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

TableFormat = Literal["bf16", "fp8_e4m3", "nvfp4"]
FORMATS: tuple[str, ...] = ("bf16", "fp8_e4m3", "nvfp4")

# Spellings accepted in checkpoint configs. "fp8" alone is refused on purpose: it does not say
# which of E4M3/E5M2 the codes are, and decoding with the wrong one is silently wrong.
_FORMAT_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "nvfp4": "nvfp4",
}

FIELD = "ple_embedding_dtype"


def parse_format(value: object, source: str) -> str:
    """Canonical table format for a config value; ValueError naming ``source`` and the choices."""
    key = value.strip().lower() if isinstance(value, str) else None
    if key not in _FORMAT_ALIASES:
        raise ValueError(
            f"{source} = {value!r} is not a PLE table format; use one of "
            f"{sorted(_FORMAT_ALIASES)} (canonical: {list(FORMATS)})"
        )
    return _FORMAT_ALIASES[key]


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def table_format_of(config: Any) -> str:
    """The table format of a checkpoint config (an HF config object or the config.json dict).

    ``ple_embedding_dtype`` (absent or null: bf16); a ``quantization_config`` carrying the same
    field is honoured too (tools that record all quantization there); if both are present they
    must agree. Callers pass the config that holds the PLE fields (a multimodal config's text part).
    """
    direct = _field(config, FIELD)
    qc = _field(config, "quantization_config")
    nested = None if qc is None else _field(qc, FIELD)
    a = None if direct is None else parse_format(direct, f"config.json {FIELD}")
    b = None if nested is None else parse_format(nested, f"config.json quantization_config.{FIELD}")
    if a is not None and b is not None and a != b:
        raise ValueError(
            f"config.json {FIELD}={direct!r} contradicts quantization_config.{FIELD}={nested!r}; "
            "keep one of them"
        )
    return a or b or "bf16"
