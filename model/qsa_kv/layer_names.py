"""The names of a model's QSA layers, as both implementations and the scale sidecar spell them.

Why shared: the sidecar of static FP8 K/V scales is keyed by layer name, and a strict sidecar
must list every QSA layer of the whole model (also layers another pipeline stage owns), so each
implementation derives the full list from one layer's own prefix in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence


def qsa_layer_names(prefix: str, layer_types: Sequence[str]) -> list[str]:
    """Prefixes of every QSA layer of the whole model, derived from one layer's own prefix.

    A decoder layer is QSA unless its ``layer_types`` entry is ``linear_attention`` (see
    ``model.py``). vLLM asserts that a layer name holds exactly one integer, the layer index, so
    substituting it gives the other layers' names whatever the outer prefix is.
    """
    parts = prefix.split(".")
    digits = [i for i, part in enumerate(parts) if part.isdigit()]
    if len(digits) != 1:
        raise ValueError(f"cannot find the layer index in QSA layer prefix {prefix!r}")
    at = digits[0]
    names = []
    for index, kind in enumerate(layer_types):
        if kind != "linear_attention":
            names.append(".".join([*parts[:at], str(index), *parts[at + 1 :]]))
    return names
