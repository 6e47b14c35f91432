"""Convert a bf16 Qwen4-Exp checkpoint's PLE tables to FP8 E4M3 or NVFP4 (or back to dequantized bf16).

Usage::

    python -m model.tools.ple_quantize --format nvfp4 --src checkpoints/tiny --out checkpoints/tiny-nvfp4
    python -m model.tools.ple_quantize --format nvfp4 --dequantized --src checkpoints/tiny \\
        --out checkpoints/tiny-nvfp4-deq

Checkpoint convention for quantized PLE tables (what the vLLM loader accepts):

* ``config.json`` (the text config, i.e. ``text_config`` when present) gets
  ``"ple_embedding_dtype": "fp8_e4m3" | "nvfp4"``; absent (or ``"bf16"``) means bf16 tables.
* Per PLE layer ``L`` and checkpoint shard ``i`` (``split_ngram_parts`` shards, as saved by
  transformers), with ``P = model.layers.L.ple.ple_embedding.ngram_embedding.shard_i``:

  - ``P.weight``: fp8_e4m3 -> uint8 ``[rows_i, D]`` E4M3 (fn) codes (``float8_e4m3fn`` is accepted
    too); nvfp4 -> uint8 ``[rows_i, D/2]``, two E2M1 codes per byte, low nibble = even column.
  - ``P.weight_scale`` (nvfp4 only): uint8 ``[rows_i, D/16]`` E4M3 codes, one block scale per 16
    consecutive values of a row.
  - ``P.weight_global_scale``: fp32 scalar (shape ``[]`` or ``[1]``), finite and positive. One
    table has ONE global scale, so every shard of a layer carries the same value.

  Values decode as ``e4m3(code) * global`` (fp8) and ``(e2m1(code) * e4m3(block_scale)) * global``
  (nvfp4), in fp32, then rounded to the model dtype (``model.ple.tables``).
* The hash buffers (``layer_multipliers``, ``ngram_heads_vocab_sizes``, ``ngram_heads_offsets``)
  and every other tensor stay as they are. transformers cannot load such a checkpoint; vLLM with
  this package can.

``--dequantized`` writes a bf16 checkpoint whose PLE tables hold exactly the values the quantized
lookup produces (quantize, then dequantize to bf16), which transformers and vLLM both load: the
reference that generation from the quantized checkpoint must match.

Conversion streams: a first pass reads each table's shards one at a time for the table-wide
absmax, a second pass converts one safetensors file at a time.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import torch

from model.ple.format import parse_format, table_format_of
from model.ple.quantizers import (
    fp8_global_scale,
    nvfp4_global_scale,
    quantize_fp8_rows,
    quantize_nvfp4_rows,
    table_amax,
)
from model.ple.tables import FORMATS, PleTable, dequantize_rows

TABLE_SHARD = re.compile(r"^(?P<owner>.+\.ple_embedding)\.ngram_embedding\.shard_(?P<index>\d+)\.weight$")
INDEX_FILE = "model.safetensors.index.json"


def _weight_files(src: Path) -> list[str]:
    index = src / INDEX_FILE
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (src / "model.safetensors").exists():
        return ["model.safetensors"]
    raise FileNotFoundError(f"{src} has neither model.safetensors nor {INDEX_FILE}")


def _text_config(config: dict) -> dict:
    """The dict that holds the PLE fields (``text_config`` of a multimodal config, else the top level)."""
    text = config.get("text_config")
    return text if isinstance(text, dict) and "ple_layer_ids" in text else config


def table_format(path: str | Path) -> str:
    """The PLE table format of a checkpoint directory, read as the loader and planner read it."""
    return table_format_of(_text_config(json.loads((Path(path) / "config.json").read_text())))


def _table_scales(src: Path, files: list[str], fmt: str) -> dict[str, float]:
    """Per-table global scale from the absmax over all of that table's shards (streamed)."""
    from safetensors import safe_open

    amax: dict[str, float] = defaultdict(float)
    for fname in files:
        with safe_open(str(src / fname), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                m = TABLE_SHARD.match(name)
                if m:
                    amax[m["owner"]] = max(amax[m["owner"]], table_amax([f.get_tensor(name)]))
    scale = fp8_global_scale if fmt == "fp8_e4m3" else nvfp4_global_scale
    return {owner: scale(a) for owner, a in amax.items()}


def convert_checkpoint(src: str | Path, out: str | Path, fmt: str, dequantized: bool = False) -> Path:
    """Write ``out``: ``src`` with its PLE tables in ``fmt`` (or their dequantized bf16 values).

    ``src`` must have bf16 (or other float) PLE tables. Returns ``out``.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    fmt = parse_format(fmt, "--format")
    if fmt == "bf16":
        raise ValueError(f"--format must be one of {[f for f in FORMATS if f != 'bf16']}")
    if table_format(src) != "bf16":
        raise ValueError(f"{src}: PLE tables are already {table_format(src)}; convert from a bf16 checkpoint")
    if out.resolve() == src.resolve():
        raise ValueError("--out must differ from --src")
    files = _weight_files(src)
    scales = _table_scales(src, files, fmt)
    if not scales:
        raise ValueError(f"{src}: no PLE tables (…ple_embedding.ngram_embedding.shard_N.weight) found")

    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in ("config.json", INDEX_FILE):
            shutil.copy2(item, out / item.name)

    weight_map: dict[str, str] = {}
    for fname in files:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(src / fname), framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            for name in f.keys():  # noqa: SIM118
                t = f.get_tensor(name)
                m = TABLE_SHARD.match(name)
                if m is None:
                    tensors[name] = t
                    continue
                if not t.is_floating_point() or t.dim() != 2:
                    raise ValueError(
                        f"{name}: expected a float [rows, D] table shard, got {t.dtype} {list(t.shape)}"
                    )
                gs = scales[m["owner"]]
                base = name[: -len(".weight")]
                if fmt == "fp8_e4m3":
                    codes, _ = quantize_fp8_rows(t, gs)
                    block = None
                else:
                    codes, block, _ = quantize_nvfp4_rows(t, gs)
                if dequantized:
                    tensors[name] = dequantize_rows(fmt, codes, block, gs, torch.bfloat16)
                    continue
                tensors[name] = codes
                if block is not None:
                    tensors[f"{base}.weight_scale"] = block
                tensors[f"{base}.weight_global_scale"] = torch.tensor(gs, dtype=torch.float32)
        save_file(tensors, str(out / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors

    config = json.loads((src / "config.json").read_text())
    text = _text_config(config)
    if dequantized:
        text["ple_embedding_dequantized_from"] = fmt
    else:
        text["ple_embedding_dtype"] = fmt
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (src / INDEX_FILE).exists():
        index = json.loads((src / INDEX_FILE).read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out


def read_tables(path: str | Path) -> dict[str, PleTable]:
    """Every PLE table of a checkpoint as a full :class:`PleTable` (shards concatenated; tests, tools).

    Loads whole tables into memory: for small checkpoints and reference checks only.
    """
    from safetensors import safe_open

    path = Path(path)
    fmt = table_format(path)
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for fname in _weight_files(path):
        with safe_open(str(path / fname), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                m = re.match(r"^(.+\.ple_embedding)\.ngram_embedding\.shard_(\d+)\.(\w+)$", name)
                if m:
                    parts[m[1]][int(m[2])][m[3]] = f.get_tensor(name)
    tables = {}
    for owner, shards in parts.items():
        order = [shards[i] for i in sorted(shards)]
        data = torch.cat([s["weight"] for s in order])
        if data.dtype == torch.float8_e4m3fn:
            data = data.view(torch.uint8)
        block = torch.cat([s["weight_scale"] for s in order]) if fmt == "nvfp4" else None
        gs = float(order[0]["weight_global_scale"]) if fmt != "bf16" else 1.0
        dim = data.shape[1] * (2 if fmt == "nvfp4" else 1)
        if fmt == "bf16":
            data = data.to(torch.bfloat16)
        tables[owner] = PleTable(fmt, data, block, gs, 0, data.shape[0], dim)
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, choices=["fp8_e4m3", "nvfp4"])
    parser.add_argument("--src", required=True, help="checkpoint directory with bf16 PLE tables")
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument(
        "--dequantized",
        action="store_true",
        help="write bf16 tables holding the dequantized values instead (the reference checkpoint)",
    )
    args = parser.parse_args()
    print(convert_checkpoint(args.src, args.out, args.format, args.dequantized))


if __name__ == "__main__":
    main()
