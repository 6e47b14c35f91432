"""Merge calibration dumps of all ranks into a static FP8 scale sidecar.

Usage::

    python -m model.qsa_kv.merge --out scales.json DUMPS_DIR [--margin 1.1]

``DUMPS_DIR`` holds the ``qsa_kv_absmax_dp*_pp*_tp*.json`` files that workers write under
``VLLM_QSA_KV_COLLECT``. For every QSA layer the absmax is the maximum over all ranks (tensor-parallel
ranks hold different KV heads of the same layer, pipeline stages hold different layers), and
``scale = absmax / 448 * margin``; a margin above 1 leaves headroom for values larger than any seen
during calibration. The result is validated exactly as the server validates ``VLLM_QSA_KV_SCALES``
before it is written (atomically), and the merge refuses incomplete inputs instead of guessing:
dumps of different models, a missing rank of the tensor/pipeline grid, a layer that saw no tokens
or produced a non-finite absmax.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from model.ops.fp8_e4m3 import E4M3_MAX

from .runtime import DUMP_FORMAT, DUMP_GLOB
from .settings import QSAKVConfigError
from .sidecar import LayerScales, atomic_write_json, sidecar_json, validate_sidecar


class MergeError(QSAKVConfigError):
    """The dumps cannot be merged into a trustworthy sidecar."""


def read_dumps(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    files = sorted(directory.glob(DUMP_GLOB))
    if not files:
        raise MergeError(
            f"{directory}: no calibration dumps ({DUMP_GLOB}); run the server with VLLM_QSA_KV_COLLECT"
        )
    dumps = []
    for path in files:
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise MergeError(f"{path}: unreadable calibration dump: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != DUMP_FORMAT:
            raise MergeError(f"{path}: not a calibration dump of format {DUMP_FORMAT}")
        dumps.append((path, doc))
    return dumps


def merge_dumps(
    dumps: list[tuple[Path, dict[str, Any]]], margin: float
) -> tuple[dict[str, LayerScales], dict]:
    """Scales per layer from the dumps, and a summary (absmax, tokens, ranks) for the report."""
    if not math.isfinite(margin) or margin <= 0:
        raise MergeError(f"--margin must be a finite number > 0, got {margin}")
    first_path, first = dumps[0]
    expected = first.get("expected_layers")
    if not isinstance(expected, list) or not expected:
        raise MergeError(f"{first_path}: dump lists no expected_layers")
    tp_size, pp_size = int(first.get("tp_size", 1)), int(first.get("pp_size", 1))
    seen_ranks: set[tuple[int, int, int]] = set()
    absmax: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for path, doc in dumps:
        for key, want in (("expected_layers", expected), ("tp_size", tp_size), ("pp_size", pp_size)):
            got = doc.get(key, want if key != "expected_layers" else None)
            if key != "expected_layers":
                got = int(got)
            if got != want:
                raise MergeError(
                    f"{path}: {key}={got!r} differs from {first_path} ({want!r}); dumps of different "
                    "models or parallel layouts are mixed in one directory"
                )
        if doc.get("model") != first.get("model"):
            raise MergeError(
                f"{path}: model {doc.get('model')!r} differs from {first_path} ({first.get('model')!r})"
            )
        rank = (int(doc.get("dp_rank", 0)), int(doc.get("pp_rank", 0)), int(doc.get("tp_rank", 0)))
        if rank in seen_ranks:
            raise MergeError(f"{path}: a second dump of rank dp{rank[0]}/pp{rank[1]}/tp{rank[2]}")
        seen_ranks.add(rank)
        layers = doc.get("layers")
        if not isinstance(layers, dict):
            raise MergeError(f"{path}: 'layers' is not an object")
        for name, entry in layers.items():
            if name not in expected:
                raise MergeError(f"{path}: layer {name!r} is not among expected_layers")
            cur = absmax.setdefault(name, [0.0, 0.0])
            for i, field in enumerate(("k_absmax", "v_absmax")):
                value = entry.get(field)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise MergeError(
                        f"{path}: layer {name!r} field {field!r} is {value!r}: the layer produced non-finite "
                        "K/V during calibration; fix the model before calibrating"
                    )
                cur[i] = max(cur[i], float(value))
            tokens[name] = tokens.get(name, 0) + int(entry.get("tokens", 0))
    for dp in {r[0] for r in seen_ranks}:
        missing = [
            f"pp{p}/tp{t}" for p in range(pp_size) for t in range(tp_size) if (dp, p, t) not in seen_ranks
        ]
        if missing:
            raise MergeError(
                f"dumps of data-parallel rank {dp} are missing for {missing} (tp_size={tp_size}, "
                f"pp_size={pp_size}); every rank must contribute"
            )
    scales: dict[str, LayerScales] = {}
    problems = []
    for name in expected:
        if name not in absmax:
            problems.append(f"layer {name!r}: no rank dumped it")
            continue
        k, v = absmax[name]
        if tokens.get(name, 0) == 0 or k <= 0 or v <= 0:
            problems.append(
                f"layer {name!r}: no calibration data (tokens={tokens.get(name, 0)}, absmax K={k}, V={v})"
            )
            continue
        scales[name] = LayerScales(k / E4M3_MAX * margin, v / E4M3_MAX * margin)
    if problems:
        raise MergeError("cannot build a complete sidecar:\n  - " + "\n  - ".join(problems))
    summary = {"absmax": absmax, "tokens": tokens, "ranks": sorted(seen_ranks), "expected_layers": expected}
    return scales, summary


def merge_directory(directory: Path, out: Path, margin: float = 1.0) -> tuple[dict[str, LayerScales], dict]:
    """Merge, validate as the server would, and write the sidecar atomically; returns scales and summary."""
    dumps = read_dumps(directory)
    scales, summary = merge_dumps(dumps, margin)
    doc = sidecar_json(scales)
    validate_sidecar(doc, source=str(out), expected_layers=summary["expected_layers"], strict=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, doc)
    summary["num_dumps"] = len(dumps)
    return scales, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model.qsa_kv.merge",
        description="Merge QSA KV calibration dumps (VLLM_QSA_KV_COLLECT) into a VLLM_QSA_KV_SCALES sidecar.",
    )
    parser.add_argument("dumps_dir", type=Path, help="directory given to VLLM_QSA_KV_COLLECT")
    parser.add_argument("--out", type=Path, required=True, help="sidecar JSON to write")
    parser.add_argument(
        "--margin", type=float, default=1.0, help="multiply every scale by this (headroom; default 1.0)"
    )
    args = parser.parse_args(argv)
    try:
        scales, summary = merge_directory(args.dumps_dir, args.out, args.margin)
    except QSAKVConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.margin < 1.0:
        print(f"warning: --margin {args.margin} < 1 clips the largest calibration values", file=sys.stderr)
    print(
        f"merged {summary['num_dumps']} dump(s) of ranks {summary['ranks']} (dp, pp, tp) into {args.out} (margin {args.margin:g}):"
    )
    for name, s in scales.items():
        k, v = summary["absmax"][name]
        print(
            f"  {name}: tokens {summary['tokens'][name]}, absmax K {k:.6g} V {v:.6g} -> "
            f"k_scale {s.k_scale:.6g} v_scale {s.v_scale:.6g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
