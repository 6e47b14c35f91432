"""Quantize a bf16 Qwen4-Exp checkpoint into compressed-tensors W4A16 or FP8 block-scaled weights.

Usage::

    python -m model.tools.quantize --format w4a16 --src checkpoints/tiny --out checkpoints/tiny-w4a16
    python -m model.tools.quantize --format fp8-block --src checkpoints/tiny --out checkpoints/tiny-fp8
    python -m model.tools.quantize --format gptq --src checkpoints/tiny --out checkpoints/tiny-gptq
    python -m model.tools.quantize ... --dequantized     # the bf16 twin holding the dequantized values

Why these two formats: they are what a 3090 user runs. 4-bit weights (``pack-quantized``, symmetric
int4 with one bf16 scale per group of input channels) run through Marlin W4A16 on sm_86; FP8
block-scaled weights (``float-quantized``, E4M3 with one fp32 scale per ``block x block`` tile and
dynamic per-token-group FP8 activations, the layout of published Qwen FP8 checkpoints) run on sm_86
as W8A16 through Marlin (no FP8 math on Ampere). vLLM reads both through its compressed-tensors
integration, so the checkpoint carries a standard ``quantization_config``. ``gptq`` and ``awq``
write the same int4 weights in the layouts AutoGPTQ and AutoAWQ publish (``model.tools.quantize_gptq_awq``),
the other 4-bit checkpoints a user brings.

What is quantized (``--scope``): ``experts`` = the routed experts only (what makes the real model
fit 4x24 GB); ``dense`` = the dense projections only (attention q/k/v/o, GDN in_proj_qkv/in_proj_z/
out_proj, shared expert; the int4 layers vLLM's CPU build runs on any x86 host); ``all`` = both. Never quantized, and named in the config's ``ignore`` list so that every
consumer skips them by name: the QSA indexer (token selection must not move with the weight
format), the router and shared-expert gates, GDN's tiny in_proj_a/in_proj_b, the LM head, and all
plain tensors (embeddings, hyper-connections, PLE projections, norms, convs). PLE tables keep their
own format (``model.tools.ple_quantize``) whatever this does.

The quantizer is round-to-nearest: scales from each group's/block's absmax
(``compressed_tensors.quantization.utils.calculate_qparams``), then the library's own compressors
(``PackedQuantizationCompressor``, ``FloatQuantizationCompressor``) quantize and pack, and its
decompressors produce the ``--dequantized`` twin, so the on-disk format is the library's, not ours.
The source may also be an FP8 block-scaled checkpoint as Qwen publishes them (``quant_method:
fp8``, ``weight`` E4M3 + ``weight_scale_inv``): its weights are dequantized to bf16 first, so dense
layers come out in bf16 and the targets in ``--format``. The conversion runs shard by shard (one
output file per input file, plus the weight-map index), so a real checkpoint need not fit in memory.

``--scales pow2`` rounds every scale up to a power of two: dequantized values are then exactly
representable in bf16, which makes the twin an exact reference for token-parity tests.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.tools.quantize_gptq_awq import (
    NATIVE_FORMATS,
    native_quantization_config,
    pow2_up,
    quantize_native,
    unquantized_substrings,
)

FORMATS = ("w4a16", "fp8-block", *NATIVE_FORMATS)
SCOPES = ("experts", "dense", "all")
SCALE_MODES = ("absmax", "pow2")

# Checkpoint module names (without ``.weight``), as transformers saves them.
EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
DENSE_RE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.shared_expert\.(gate|up|down)_proj)$"
)
# Linear-type modules that our vLLM model builds with the quantization config but must stay bf16.
KEEP_RE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.indexer\.index_qk_proj|mlp\.gate|mlp\.shared_expert_gate"
    r"|linear_attn\.in_proj_a|linear_attn\.in_proj_b)$"
)
GROUP_CHOICES = (128, 64, 32)


@dataclass(frozen=True)
class Plan:
    fmt: str
    scope: str
    group: int  # int4 group size, or FP8 block edge
    scales: str


def targets(names: list[str], scope: str) -> list[str]:
    """Module names (``...proj``) to quantize, in checkpoint order."""
    mods = [n.removesuffix(".weight") for n in names if n.endswith(".weight")]
    pattern = {"experts": (EXPERT_RE,), "dense": (DENSE_RE,), "all": (EXPERT_RE, DENSE_RE)}[scope]
    return [m for m in mods if any(p.match(m) for p in pattern)]


def family(module: str) -> str:
    """A compressed-tensors regex matching ``module`` in every layer (and expert)."""
    return "re:^" + r"\.".join(r"\d+" if p.isdigit() else re.escape(p) for p in module.split(".")) + "$"


def ignored(names: list[str], quantized: set[str]) -> list[str]:
    """Linear-type modules that stay unquantized, as name families: the must-keep set plus the
    targetable projections this scope leaves in bf16."""
    mods = [n.removesuffix(".weight") for n in names if n.endswith(".weight")]
    keep = {
        family(m)
        for m in mods
        if KEEP_RE.match(m) or ((DENSE_RE.match(m) or EXPERT_RE.match(m)) and m not in quantized)
    }
    return ["lm_head", *sorted(keep)]


ROW_PARALLEL_RE = re.compile(r"\.(down_proj|o_proj|out_proj)$")


def per_rank_shapes(modules: list[str], shapes: list[tuple[int, int]], tp: int) -> list[tuple[int, int]]:
    """``(N, K)`` each tensor-parallel rank holds: row-parallel layers (down/o/out projections) split
    their input dim, the others their output dim (vLLM's column/row-parallel linears and FusedMoE)."""
    out = []
    for module, (n, k) in zip(modules, shapes, strict=True):
        row = bool(ROW_PARALLEL_RE.search(module))
        if (k if row else n) % tp:
            raise ValueError(
                f"{module}: {'input' if row else 'output'} dim {k if row else n} is not divisible by --tp {tp}"
            )
        out.append((n, k // tp) if row else (n // tp, k))
    return out


def choose_group(shapes: list[tuple[int, int]], fmt: str, requested: int | None) -> int:
    """The group size (int4) or block edge (FP8): the largest of 128/64/32 that tiles every target.

    ``shapes`` are per-rank (``per_rank_shapes``): vLLM's quantized layers need every rank's slice
    to hold whole groups. int4 groups run along the input dim only; FP8 blocks tile both dims.
    """
    dims = [k for _, k in shapes] + ([n for n, _ in shapes] if fmt == "fp8-block" else [])
    if requested is not None:
        bad = sorted({d for d in dims if d % requested})
        if bad:
            raise ValueError(
                f"--group-size {requested} does not divide the per-rank target dims {bad}; "
                f"choose one dividing all of them (or omit it to pick one), or a smaller --tp"
            )
        return requested
    for g in GROUP_CHOICES:
        if all(d % g == 0 for d in dims):
            return g
    raise ValueError(f"no group size in {GROUP_CHOICES} divides the target dims {sorted(set(dims))}")


def scheme(plan: Plan):
    """The compressed-tensors scheme of the quantized modules."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if plan.fmt == "w4a16":
        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=plan.group, dynamic=False
        )
        return QuantizationScheme(targets=["Linear"], weights=weights)
    weights = QuantizationArgs(
        num_bits=8,
        type="float",
        symmetric=True,
        strategy="block",
        block_structure=[plan.group, plan.group],
        dynamic=False,
    )
    acts = QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy="group", group_size=plan.group, dynamic=True
    )
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def _scale(weight: torch.Tensor, plan: Plan, args) -> torch.Tensor:
    """Round-to-nearest scales from absmax: ``[N, K/g]`` (int4 groups) or ``[N/b, K/b]`` (FP8 blocks)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.float()
    n, k = w.shape
    g = plan.group
    if plan.fmt == "w4a16":
        tiles = w.view(n, k // g, g)
        lo, hi = tiles.amin(-1), tiles.amax(-1)
        dtype = torch.bfloat16
    else:
        tiles = w.view(n // g, g, k // g, g)
        lo, hi = tiles.amin((1, 3)), tiles.amax((1, 3))
        dtype = torch.float32
    scale, _ = calculate_qparams(lo, hi, args)
    scale = scale.clamp_min(torch.finfo(torch.bfloat16).tiny)
    if plan.scales == "pow2":
        scale = pow2_up(scale)
    return scale.to(dtype)


def quantize_weight(weight: torch.Tensor, plan: Plan, sch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Compressed tensors of one module (local names) and its dequantized bf16 weight."""
    from compressed_tensors.compressors import BaseCompressor

    fmt_name = "pack-quantized" if plan.fmt == "w4a16" else "float-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt_name)
    state = {"weight": weight.to(torch.bfloat16), "weight_scale": _scale(weight, plan, sch.weights)}
    packed = compressor.compress(state, sch)
    if plan.fmt == "w4a16":
        restored = compressor.decompress(dict(packed), sch)["weight"]
    else:
        # The float decompressor infers the strategy from the scale's shape, which is ambiguous
        # for a one-block-high tile grid, so dequantize with the scheme's arguments instead.
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        restored = dequantize(packed["weight"], packed["weight_scale"], args=sch.weights)
    return dict(packed), restored.to(torch.bfloat16)


def quantization_config(plan: Plan, ignore: list[str], target_names: list[str]) -> dict:
    """The ``quantization_config`` block of config.json (compressed-tensors' own serialisation)."""
    from compressed_tensors.quantization import QuantizationConfig

    sch = scheme(plan)
    # Target the exact module families by regex, so nothing is quantized by accident.
    sch.targets = sorted({family(m) for m in target_names})
    cfg = QuantizationConfig(
        config_groups={"group_0": sch},
        quant_method="compressed-tensors",
        format="pack-quantized" if plan.fmt == "w4a16" else "float-quantized",
        quantization_status="compressed",
        ignore=ignore,
    )
    out = cfg.model_dump(exclude_none=True)
    out["quant_method"] = "compressed-tensors"
    return out


def _shards(src: Path) -> list[Path]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {src}")
    return files


def _shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the file headers (nothing is read into memory)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _fp8_source_block(config: dict, src: Path) -> list[int] | None:
    """The block size of an FP8 block-scaled source (``quant_method: fp8``, as Qwen publishes FP8
    checkpoints), whose weights are dequantized to bf16 first; any other quantized source is refused."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    block = qc.get("weight_block_size")
    if str(qc.get("quant_method")).lower() == "fp8" and isinstance(block, list) and len(block) == 2:
        return [int(b) for b in block]
    raise ValueError(
        f"{src}/config.json has a quantization_config ({qc.get('quant_method')!r}) this converter does not "
        "read; convert a bf16 checkpoint or an FP8 block-scaled one (quant_method fp8, weight_block_size)"
    )


def _dequantize_fp8_source(tensors: dict[str, torch.Tensor], block: list[int], file: Path) -> None:
    """In place: ``X.weight`` (E4M3) with ``X.weight_scale_inv`` (fp32 per block) -> bf16 ``X.weight``."""
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        module = name.removesuffix(".weight_scale_inv")
        weight, inv = tensors[f"{module}.weight"], tensors.pop(name)
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"{file.name}: {module}.weight is {weight.dtype}, expected float8_e4m3fn beside its scale"
            )
        n, k = weight.shape
        want = (-(-n // block[0]), -(-k // block[1]))
        if tuple(inv.shape) != want:
            raise ValueError(
                f"{file.name}: {name} has shape {list(inv.shape)}, block {block} needs {list(want)}"
            )
        full = inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        tensors[f"{module}.weight"] = (weight.float() * full).to(torch.bfloat16)
    for name, tensor in tensors.items():
        if tensor.dtype == torch.float8_e4m3fn:
            raise ValueError(f"{file.name}: {name} is FP8 without a weight_scale_inv beside it")


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    fmt: str,
    *,
    scope: str = "experts",
    group_size: int | None = None,
    scales: str = "absmax",
    dequantized: bool = False,
    tp: int = 1,
) -> Path:
    """Write ``out``: ``src`` with its targets in ``fmt`` (or, ``dequantized``, the bf16 twin).

    ``tp``: the largest tensor-parallel size the checkpoint must serve at; groups/blocks are chosen
    so that each rank's slice holds whole ones.

    Works shard by shard (each input ``*.safetensors`` file becomes one output file of the same
    name, plus the weight-map index), so a real checkpoint never has to fit in memory at once.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    src, out = Path(src), Path(out)
    if src.resolve() == out.resolve():
        raise ValueError("--out must differ from --src")
    config = json.loads((src / "config.json").read_text())
    source_block = _fp8_source_block(config, src)
    files = _shards(src)
    shapes = _shapes(files)
    names = [n for n in shapes if not n.endswith(".weight_scale_inv")]
    mods = targets(names, scope)
    if not mods:
        raise ValueError(f"{src}: no {scope} projections found to quantize")
    rank_shapes = per_rank_shapes(mods, [shapes[f"{m}.weight"] for m in mods], tp)
    plan = Plan(fmt, scope, choose_group(rank_shapes, fmt, group_size), scales)
    sch = None if fmt in NATIVE_FORMATS else scheme(plan)
    wanted = set(mods)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        if source_block is not None:
            _dequantize_fp8_source(tensors, source_block, file)
        result: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            module = name.removesuffix(".weight")
            if module in wanted and name.endswith(".weight"):
                if fmt in NATIVE_FORMATS:
                    packed, restored = quantize_native(tensor, fmt, plan.group, plan.scales, module)
                else:
                    packed, restored = quantize_weight(tensor, plan, sch)
                if dequantized:
                    result[name] = restored.contiguous()
                else:
                    result.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
            else:
                result[name] = tensor.contiguous()
        save_file(result, str(out / file.name), metadata={"format": "pt"})
        weight_map.update({name: file.name for name in result})
        del tensors, result
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            shutil.copy2(file, out / file.name)
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.pop("quantization_config", None)
    if not dequantized and fmt in NATIVE_FORMATS:
        config["quantization_config"] = native_quantization_config(
            fmt, plan.group, unquantized_substrings(scope)
        )
    elif not dequantized:
        config["quantization_config"] = quantization_config(plan, ignored(names, wanted), mods)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "QUANTIZED").write_text(
        json.dumps(
            {"format": fmt, "scope": scope, "group": plan.group, "scales": scales, "dequantized": dequantized}
        )
        + "\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.tools.quantize", description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True, help="bf16 (or FP8 block-scaled) checkpoint directory")
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=FORMATS, required=True)
    p.add_argument("--scope", choices=SCOPES, default="experts")
    p.add_argument("--group-size", type=int, help="int4 group / FP8 block edge (default: 128, 64 or 32)")
    p.add_argument("--scales", choices=SCALE_MODES, default="absmax")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel size to serve at (groups fit each rank)"
    )
    p.add_argument(
        "--dequantized", action="store_true", help="write the bf16 twin with the dequantized values"
    )
    a = p.parse_args(argv)
    try:
        path = convert_checkpoint(
            a.src,
            a.out,
            a.format,
            scope=a.scope,
            group_size=a.group_size,
            scales=a.scales,
            dequantized=a.dequantized,
            tp=a.tp,
        )
    except (ValueError, OSError) as exc:
        print(f"quantize: {exc}", flush=True)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
