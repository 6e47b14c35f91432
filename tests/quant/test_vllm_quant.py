"""Quantized checkpoints through vLLM's own loaders and our model's quantization threading (CPU).

Each case builds the model in a vLLM CPU engine and loads the checkpoint (``load_probe``): the
modules the config targets get vLLM's quantized methods with parameters of the format's shapes,
the modules that must stay bf16 (indexer, gates, GDN a/b, LM head) get unquantized methods by
name, and every checkpoint tensor is consumed. Broken checkpoints fail at start-up with a message
naming the tensor. On this host's CPU (AVX2, no AMX) vLLM has no kernel for either format, which
our start-up check reports instead of a failure at the first request.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.tools.quantize import Plan, quantize_weight, scheme
from tests.conftest import ROOT

from .conftest import CASES, DENSE_INT4_CASES, cpu_library_has


class _ProbeServer:
    """One ``load_probe --serve`` process for every probe of the session: it imports vLLM once and
    forks a child per probe (``tests/quant/load_probe.py``), which saves the import each probe
    would otherwise pay in a process of its own."""

    def __init__(self) -> None:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("VLLM_QSA_", "VLLM_PLE_", "QWEN4EXP_"))
        }
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(ROOT / ".cache" / "vllm"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.quant.load_probe", "--serve"],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._until("PROBE_READY", 400)
        atexit.register(self.close)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _until(self, marker: str, timeout: float) -> list[str]:
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {marker} within {timeout} s:\n" + "\n".join(seen[-60:])) from None
            if line is None:
                raise AssertionError(f"the probe server exited before {marker}:\n" + "\n".join(seen[-60:]))
            if line.startswith(marker):
                return seen
            seen.append(line)

    def run(self, args: list[str]) -> list[str]:
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        return self._until("PROBE_DONE", 400)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


_server: _ProbeServer | None = None


def probe(path, *flags: str) -> dict:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _ProbeServer()
    out = _server.run([str(path), *flags])
    marker = [ln for ln in out if ln.startswith("PROBE_JSON=")]
    assert marker, "probe printed no result:\n" + "\n".join(out[-80:])
    return json.loads(marker[-1].removeprefix("PROBE_JSON="))


def _int4_moe_kernel_for(path) -> bool:
    """Whether vLLM's CPU int4 MoE kernel takes this checkpoint's experts on this host:
    ``CPUExpertsInt4`` needs AMX and refuses 32-wide groups (``model.runtime.quant_checks.
    explain_construction_error`` says why; ``wide``'s 96-wide experts get groups of 32)."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    groups = {
        g["weights"].get("group_size")
        for g in config["config_groups"].values()
        if g["weights"]["num_bits"] == 4
    }
    return 32 not in groups


def _flags(case: str, path) -> list[str]:
    """Probe flags for a checkpoint of ``case``'s format at ``path`` (load-only where no kernel runs)."""
    _, fmt, scope = CASES[case]
    flags = ["--skip-kernel-check"]
    if fmt == "w4a16" and scope != "dense" and not _int4_moe_kernel_for(path):
        flags.append("--force-int4-moe-backend")
    return flags


MOE_METHOD = {"w4a16": "CompressedTensorsWNA16MoEMethod", "fp8-block": "CompressedTensorsW8A8Fp8MoEMethod"}
DENSE = re.compile(
    r"(qkv_proj|o_proj|in_proj_qkvz|out_proj|shared_expert\.gate_up_proj|shared_expert\.down_proj)$"
)
KEEP = re.compile(r"(indexer\.index_qk_proj|in_proj_ba|mlp\.gate|shared_expert_gate|conv1d)$")


@pytest.mark.parametrize("case", ["tiny-w4a16", "tiny-fp8", "wide-w4a16", "wide-fp8"])
def test_vllm_loads_the_checkpoint_into_the_declared_methods(quant_checkpoints, case):
    preset, fmt, scope = CASES[case]
    result = probe(quant_checkpoints[case], *_flags(case, quant_checkpoints[case]))
    assert "error" not in result, result["error"]
    methods = result["methods"]
    config = json.loads((quant_checkpoints[preset] / "config.json").read_text())
    experts = {k: v for k, v in methods.items() if k.endswith("mlp.experts.routed_experts")}
    assert len(experts) == config["num_hidden_layers"]
    assert set(experts.values()) == {MOE_METHOD[fmt] if scope != "dense" else "UnquantizedFusedMoEMethod"}
    for name, method in methods.items():
        if KEEP.search(name) or name == "lm_head":
            assert method.startswith("Unquantized"), (name, method)
        elif DENSE.search(name):
            assert method.startswith("Unquantized") == (scope == "experts"), (name, method)
    # Fused expert parameters in the format's shapes: [E, 2I, H/8] int32 codes, [E, 2I, H/g] scales.
    e, i, h = config["num_experts"], config["moe_intermediate_size"], config["hidden_size"]
    params = result["params"]
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    qc = json.loads((quant_checkpoints[case] / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    if fmt == "w4a16":
        g = weights["group_size"]
        assert params[f"{w13}_packed"] == ["torch.int32", [e, 2 * i, h // 8]]
        assert params[f"{w13}_scale"] == ["torch.bfloat16", [e, 2 * i, h // g]]
    else:
        b = weights["block_structure"][0]
        assert params[w13] == ["torch.float8_e4m3fn", [e, 2 * i, h]]
        assert params[f"{w13}_scale"] == ["torch.float32", [e, 2 * i // b, h // b]]
    assert set(params) <= set(result["loaded"]) | {p for p in params if p.endswith("_shape")}


# ---- broken checkpoints ----------------------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst, load_file(dst / "model.safetensors"), json.loads((dst / "config.json").read_text())


def _save(dst, tensors, config):
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _quantize_into(tensors, module: str, fmt="w4a16", group=64):
    packed, _ = quantize_weight(
        tensors.pop(f"{module}.weight"),
        Plan(fmt, "experts", group, "pow2"),
        scheme(Plan(fmt, "experts", group, "pow2")),
    )
    tensors.update({f"{module}.{k}": v for k, v in packed.items()})


def _broken_indexer(src, dst):
    dst, t, c = _copy(src, dst)
    _quantize_into(t, "model.layers.3.self_attn.indexer.index_qk_proj")
    qc = c["quantization_config"]
    qc["ignore"] = [p for p in qc["ignore"] if "indexer" not in p]
    qc["config_groups"]["group_0"]["targets"].append(
        r"re:^model\.layers\.\d+\.self_attn\.indexer\.index_qk_proj$"
    )
    return dst, t, c


def _broken_group(src, dst):
    dst, t, c = _copy(src, dst)
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32  # tensors: 64
    return dst, t, c


def _missing_scale(src, dst):
    dst, t, c = _copy(src, dst)
    del t["model.layers.1.mlp.experts.2.up_proj.weight_scale"]
    return dst, t, c


def _missing_expert(src, dst):
    dst, t, c = _copy(src, dst)
    for k in [k for k in t if ".layers.2.mlp.experts.3." in k]:
        del t[k]
    return dst, t, c


def _quantized_ple_projection(src, dst):
    dst, t, c = _copy(src, dst)
    _quantize_into(t, "model.layers.1.ple.key_proj")
    return dst, t, c


def _fp8_gate(src, dst):
    dst, t, c = _copy(src, dst)
    t["model.layers.0.mlp.gate.weight"] = t["model.layers.0.mlp.gate.weight"].to(torch.float8_e4m3fn)
    return dst, t, c


def _bf16_fp8_expert(src, dst):
    dst, t, c = _copy(src, dst)
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    t[name] = t[name].to(torch.bfloat16)
    return dst, t, c


BROKEN = {
    # name: (base case, edit, message pattern)
    "quantized_indexer": (
        "tiny-w4a16",
        _broken_indexer,
        r"model\.layers\.3\.self_attn\.indexer\.index_qk_proj is quantized .* must stay in bf16.*ignore list",
    ),
    "wrong_group_size": (
        "tiny-w4a16",
        _broken_group,
        r"checkpoint tensor model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight_scale has shape \[\d+, \d\], but "
        r"quantization_config \(compressed-tensors: group_size 32 over a \d+ x \d+ weight\) needs",
    ),
    "wrong_group_size_dense": (
        "tiny-w4a16-dense",
        _broken_group,
        r"loading checkpoint tensor model\.layers\.\d+\.\S+\.weight_\w+ \(torch\.\w+, \[[\d, ]+\]\) failed under "
        r"quantization_config \(compressed-tensors\): AssertionError",
    ),
    "missing_scale": (
        "tiny-w4a16",
        _missing_scale,
        r"checkpoint tensors model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight_scale are missing",
    ),
    "missing_expert": (
        "tiny-fp8",
        _missing_expert,
        r"no tensors for experts \[3\] of model\.layers\.2\.mlp\.experts",
    ),
    "quantized_ple_projection": (
        "tiny-w4a16",
        _quantized_ple_projection,
        r"checkpoint tensor model\.layers\.1\.ple\.key_proj\.weight_\w+ .* is quantized, but "
        r"model\.layers\.1\.ple\.key_proj is a plain bf16 tensor of our model",
    ),
    "fp8_router_gate": (
        "tiny-fp8",
        _fp8_gate,
        r"checkpoint tensor model\.layers\.0\.mlp\.gate\.weight \(torch\.float8_e4m3fn.*is quantized, but "
        r"model\.layers\.0\.mlp\.gate is unquantized here",
    ),
    "bf16_weight_in_fp8_expert": (
        "tiny-fp8",
        _bf16_fp8_expert,
        r"checkpoint tensor model\.layers\.0\.mlp\.experts\.1\.gate_proj\.weight is torch\.bfloat16, but "
        r"quantization_config \(compressed-tensors\) makes model\.layers\.0\.mlp\.experts\.routed_experts "
        r"store torch\.float8_e4m3fn",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_quantized_checkpoint_fails_at_start_up_naming_the_tensor(quant_checkpoints, tmp_path, name):
    base, edit, pattern = BROKEN[name]
    dst, tensors, config = edit(quant_checkpoints[base], tmp_path / name)
    _save(dst, tensors, config)
    result = probe(dst, *_flags(base, dst))
    assert "error" in result, f"{name}: start-up should have failed"
    kind, message = result["error"]
    assert "QuantConfigError" in kind or "QuantConfigError" in message, result["error"]
    assert re.search(pattern, message, re.S), message


# ---- what this host's CPU can run --------------------------------------------------------------


@pytest.mark.parametrize("case", DENSE_INT4_CASES)
def test_int4_linears_get_the_cpu_kernel_our_check_knows(quant_checkpoints, case):
    """Every int4 dense layer, whatever the layout, runs vLLM's ``CPUWNA16LinearKernel`` on the CPU
    build, and our start-up check finds it where each config keeps it (any x86 host: the probe stops
    before the kernel runs)."""
    result = probe(quant_checkpoints[case], "--skip-kernel-check")
    assert "error" not in result, result["error"]
    quantized = {
        n for n, m in result["methods"].items() if not m.startswith("Unquantized") and "linear" in m.lower()
    }
    assert quantized, result["methods"]
    assert {n: result["kernels"].get(n) for n in quantized} == dict.fromkeys(
        quantized, "CPUWNA16LinearKernel"
    )


@pytest.mark.parametrize("case", DENSE_INT4_CASES)
def test_int4_linears_without_the_cpu_op_are_refused_at_start_up(quant_checkpoints, case):
    if hasattr(torch.ops._C, "cpu_gemm_wna16") or cpu_library_has("cpu_gemm_wna16"):
        pytest.skip("this host's vLLM CPU library has cpu_gemm_wna16: the parity test runs instead")
    result = probe(quant_checkpoints[case])
    assert "error" in result
    assert re.search(
        r"model\.layers\.\d+\.\S+: vLLM chose CPUWNA16LinearKernel, but its op torch\.ops\._C\.cpu_gemm_wna16 "
        r"is not in the vLLM CPU library",
        result["error"][1],
    ), result["error"]


def _assert_refused(path, pattern: str) -> None:
    """Start-up (with our kernel checks on) fails with a message matching ``pattern``."""
    result = probe(path)
    assert "error" in result
    assert re.search(pattern, result["error"][1]), result["error"]


def test_fp8_experts_without_amx_are_refused_at_start_up(quant_checkpoints):
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("AMX host: vLLM's CPU FP8 MoE can run")
    _assert_refused(
        quant_checkpoints["tiny-fp8"], r"routed_experts: FP8 experts .* need AMX tiles .*cpu_moe\.py:456-460"
    )


def test_int4_experts_without_a_cpu_moe_kernel_are_refused_with_the_reason(quant_checkpoints):
    if _int4_moe_kernel_for(quant_checkpoints["tiny-w4a16"]):
        pytest.skip("AMX host: vLLM's CPU int4 MoE can run")
    _assert_refused(
        quant_checkpoints["tiny-w4a16"],
        r"routed experts are int4 \(compressed-tensors\).*only on x86 hosts with AMX tiles.*cpu_moe\.py:840-844",
    )


def test_int4_experts_in_groups_of_32_on_an_amx_host_are_refused_with_the_reason(quant_checkpoints):
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX: the no-kernel refusal above covers this host")
    _assert_refused(
        quant_checkpoints["wide-w4a16"],
        r"int4 \(compressed-tensors\) in groups of 32.*kInt4Static32GroupScale",
    )


def test_qwen_fp8_method_checkpoint_is_served_as_fp8_linears(quant_checkpoints, tmp_path):
    """A checkpoint in the ``fp8`` method (as Qwen publishes FP8), 64x64 blocks (the tiny preset's
    experts are 64 wide): vLLM's FP8 kernel selection for the first FP8 linear it builds refuses at
    start-up, with the reason: no kernel at all without AMX, and on an AMX host vLLM's CPU FP8 block
    kernel takes only 128-wide K blocks (seen on an Intel Xeon). The 128x128-block path on AMX is
    covered by ``test_cpu_parity``'s qsa512 FP8 experts."""
    from .test_converter import _qwen_fp8_checkpoint

    path, _ = _qwen_fp8_checkpoint(quant_checkpoints["tiny"], tmp_path / "qwen-fp8")
    result = probe(path, "--skip-kernel-check")
    assert "error" in result
    assert "Failed to find a kernel that can implement the ScaledMM linear layer" in result["error"][1]
    if torch.cpu._is_amx_tile_supported():
        assert "requires K-dimension block size of 128, got 64" in result["error"][1]


def test_quantized_ple_tables_and_int4_experts_load_together(quant_checkpoints, tmp_path):
    """The README's path: PLE tables to nvfp4 (model.tools.ple_quantize), then the experts to int4; the
    tables keep their own format and both load."""
    from model.tools.ple_quantize import convert_checkpoint as convert_ple
    from model.tools.quantize import convert_checkpoint

    ple = convert_ple(quant_checkpoints["tiny"], tmp_path / "ple", "nvfp4")
    both = convert_checkpoint(ple, tmp_path / "ple-w4a16", "w4a16", scales="pow2")
    assert json.loads((both / "config.json").read_text())["ple_embedding_dtype"] == "nvfp4"
    result = probe(both, *_flags("tiny-w4a16", both))
    assert "error" not in result, result["error"]
    assert set(m for k, m in result["methods"].items() if k.endswith("routed_experts")) == {
        "CompressedTensorsWNA16MoEMethod"
    }
