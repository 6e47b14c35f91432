"""The deployment preflight's checks beyond the driver: GPUs, checkpoint, memory plan, memlock, topology.

Everything here answers in seconds and before any weight is read: it reads ``nvidia-smi`` (or
torch's device properties when torch already sees the GPUs), ``config.json``, the fit planner's
arithmetic, resource limits and cgroup files. Each check returns a :class:`Check` with a verdict:

- ``ok``, ``warn`` (serves, but a setting is worse than it could be), ``fail`` (the service would
  stop later, minutes into loading: the preflight stops now, with the fix), ``skip`` (nothing to
  check here, with the reason, e.g. no GPU on a CPU machine).

The pure functions (parsers, the verdicts) take their inputs as arguments so they are tested on
CPU with ``nvidia-smi`` output in its formats; :mod:`service.cuda_preflight` gathers the real inputs and
prints the table.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.deployment.implementation import SHARED_MEMORY_OPTIN  # one table of the GPUs' opt-in shared memory
from model.deployment.resolve import Deployment, DeploymentError, GpuFacts, resolve
from model.runtime import envs

from .settings import SettingsError, field_value

GIB = 1 << 30
MIB = 1 << 20
MIN_CAPABILITY = (8, 0)  # bf16 tensor cores and the Triton kernels' instructions (Ampere)


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str  # ok | warn | fail | skip
    detail: str


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int] | None
    memory_mib: int | None
    shared_memory_per_block: int | None


# GPUs to evaluate a checkpoint for on a machine without them (--assume-gpu).
KNOWN_GPUS = {
    "rtx3090": Gpu(0, "NVIDIA GeForce RTX 3090", (8, 6), 24576, SHARED_MEMORY_OPTIN[(8, 6)]),
    "rtx4090": Gpu(0, "NVIDIA GeForce RTX 4090", (8, 9), 24564, SHARED_MEMORY_OPTIN[(8, 9)]),
    "a100-80gb": Gpu(0, "NVIDIA A100-SXM4-80GB", (8, 0), 81920, SHARED_MEMORY_OPTIN[(8, 0)]),
    "h200": Gpu(0, "NVIDIA H200", (9, 0), 143771, SHARED_MEMORY_OPTIN[(9, 0)]),
}

# ------------------------------------------------------------------------------------------------
# GPUs
# ------------------------------------------------------------------------------------------------

GPU_QUERY = "index,name,compute_cap,memory.total,driver_version"


def parse_gpu_query(output: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version
    --format=csv,noheader,nounits`` -> one :class:`Gpu` per line (driver column ignored)."""
    gpus = []
    for line in output.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 4 or not cols[0].isdigit():
            continue
        cap = None
        if re.fullmatch(r"\d+\.\d+", cols[2]):
            major, minor = cols[2].split(".")
            cap = (int(major), int(minor))
        memory = int(float(cols[3])) if re.fullmatch(r"\d+(\.\d+)?", cols[3]) else None
        gpus.append(Gpu(int(cols[0]), cols[1], cap, memory, SHARED_MEMORY_OPTIN.get(cap) if cap else None))
    return gpus


def run_nvidia_smi(*args: str) -> tuple[str | None, str | None]:
    """(stdout, None) or (None, why not)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found"
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi: {exc}"
    if proc.returncode != 0:
        return None, f"nvidia-smi {' '.join(args)}: {(proc.stdout + proc.stderr).strip()[:300]}"
    return proc.stdout, None


def gpus_from_torch() -> list[Gpu] | None:
    """torch's view, exact shared memory included; None when torch sees no GPU (CPU build, no driver).
    Creates a CUDA context on each GPU: fine in the one-shot preflight container, not in the service."""
    try:
        import torch

        if torch.version.cuda is None or not torch.cuda.is_available():
            return None
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            smem = getattr(p, "shared_memory_per_block_optin", None)
            out.append(Gpu(i, p.name, (p.major, p.minor), p.total_memory // MIB, smem))
        return out
    except Exception:  # noqa: BLE001 - torch's failure is the driver check's business
        return None


def check_gpus(gpus: list[Gpu] | None, needed: int, why_none: str | None) -> list[Check]:
    if gpus is None:
        reason = why_none or "no GPU information"
        return [Check("GPU count", "skip", reason), Check("compute capability", "skip", reason)]
    checks = []
    if len(gpus) < needed:
        checks.append(
            Check(
                "GPU count",
                "fail",
                f"{len(gpus)} visible, TP {needed} needs {needed}; fix: give the container {needed} GPUs "
                "(compose: deploy.resources.reservations.devices count)",
            )
        )
    else:
        checks.append(
            Check("GPU count", "ok", f"{len(gpus)} visible: " + ", ".join(sorted({g.name for g in gpus})))
        )
    caps = sorted({g.capability for g in gpus if g.capability is not None})
    if not caps:
        checks.append(Check("compute capability", "warn", "unknown (nvidia-smi too old for compute_cap)"))
    elif len(caps) > 1:
        checks.append(
            Check(
                "compute capability",
                "fail",
                f"mixed GPUs {[f'sm_{a}{b}' for a, b in caps]}: tensor parallelism needs identical cards; "
                "fix: CUDA_VISIBLE_DEVICES to the identical ones",
            )
        )
    elif caps[0] < MIN_CAPABILITY:
        checks.append(
            Check(
                "compute capability",
                "fail",
                f"sm_{caps[0][0]}{caps[0][1]}: the bf16 Triton kernels need sm_80 or newer (Ampere)",
            )
        )
    else:
        smem = gpus[0].shared_memory_per_block
        checks.append(
            Check(
                "compute capability",
                "ok",
                f"sm_{caps[0][0]}{caps[0][1]}, {smem or '?'} B shared memory per block (opt-in), "
                f"{min(g.memory_mib or 0 for g in gpus) / 1024:.1f} GiB per GPU",
            )
        )
    return checks


# ------------------------------------------------------------------------------------------------
# Checkpoint and implementation
# ------------------------------------------------------------------------------------------------


def read_config(checkpoint: Path) -> dict[str, Any]:
    """config.json as the service's choice reads it (transformers' ``to_dict()``, defaults filled);
    the raw JSON when transformers cannot build it (then the engine's own check reports why)."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(checkpoint)).to_dict()
    except Exception:  # noqa: BLE001
        return json.loads((checkpoint / "config.json").read_text())


def deployment_for(config: Mapping[str, Any] | None, env: Mapping[str, str], gpu: Gpu | None) -> Deployment:
    """The deployment the service resolves at start-up for these facts, so the preflight judges the
    same implementation, PLE storage and KV settings; ``DeploymentError`` or ``SettingsError`` (one
    line per malformed variable, with its fix)."""
    return resolve(
        env,
        cpu_build=False,
        kv_cache_dtype=field_value("kv_cache_dtype", env),
        config=config,
        gpu=None if gpu is None else GpuFacts(gpu.capability, gpu.shared_memory_per_block),
    )


def problem_text(exc: Exception) -> str:
    """A configuration error as one table cell."""
    return "; ".join(str(exc).splitlines())


def check_implementation(config: Mapping[str, Any], env: Mapping[str, str], gpu: Gpu | None) -> Check:
    """Which Qwen4-Exp implementation ``QWEN4EXP_CUDA_MODEL`` serves on this GPU, and why.

    A choice, not a refusal: with ``auto`` the service serves ours wherever upstream cannot, and the
    reasons say what upstream lacks; only an explicit ``upstream`` that upstream cannot serve fails.
    A malformed variable fails here even without a GPU: the service would not start either.
    """
    try:
        deployment = deployment_for(config, env, gpu)
    except (DeploymentError, SettingsError) as exc:
        return Check("implementation", "fail", problem_text(exc))
    if gpu is None:
        return Check(
            "implementation", "skip", "no GPU to decide for (use --assume-gpu rtx3090 on a CPU machine)"
        )
    reasons = deployment.implementation_reasons
    where = f"{gpu.name} (sm_{gpu.capability[0]}{gpu.capability[1]})" if gpu.capability else gpu.name
    if deployment.upstream and reasons:
        return Check(
            "implementation",
            "fail",
            f"{envs.CUDA_MODEL}=upstream cannot serve on {where}: " + "; ".join(reasons),
        )
    if deployment.upstream:
        return Check("implementation", "ok", f"upstream (vLLM's CUDA qwen4_exp + our subclass) on {where}")
    asked = deployment.requested_implementation
    return Check("implementation", "ok", f"ours on {where} ({envs.CUDA_MODEL}={asked}): {'; '.join(reasons)}")


# ------------------------------------------------------------------------------------------------
# Memory plan, memlock, cgroup, /dev/shm
# ------------------------------------------------------------------------------------------------


def host_ram_gib(meminfo: str) -> float:
    match = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M)
    return int(match.group(1)) * 1024 / GIB if match else 0.0


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's memory limit in bytes (cgroup v2 ``memory.max`` or v1), None if unlimited."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= 1 << 60:
            return None
        return int(raw)
    return None


def plan_for(
    checkpoint: Path,
    gpus: list[Gpu],
    tp: int,
    env: Mapping[str, str],
    host_gib: float,
    deployment: Deployment,
):
    """The fit planner's plan for the service's settings (``SettingsError`` on a malformed one) and
    the resolved deployment (cache dtype, PLE storage)."""
    from model.tools.planner import Machine, Options, make_plan

    gpu_gib = min(g.memory_mib or 0 for g in gpus) / 1024 * (23.7 / 24.0)  # what torch reports
    options = Options(
        tp=tp,
        kv_cache_dtype="fp8" if deployment.kv_cache_dtype.startswith("fp8") else "bf16",
        expert_weights="auto",
        seq_len=field_value("max_model_len", env),
        gpu_memory_utilization=field_value("gpu_memory_utilization", env),
        prefix_caching=field_value("prefix_caching", env),
        ple_on_device=deployment.ple_storage == "device",
    )
    return make_plan(checkpoint, Machine(gpus=len(gpus), gpu_mem_gib=gpu_gib, host_ram_gib=host_gib), options)


def check_plan(plan, env: Mapping[str, str]) -> Check:
    try:
        seqs = field_value("max_num_seqs", env)
    except SettingsError as exc:
        return Check("memory plan", "fail", problem_text(exc))
    cap = plan.capacity
    weights = plan.weights_bytes_per_rank / GIB
    head = (
        f"TP {plan.tp}: weights {weights:.1f} GiB/GPU ({plan.expert_format}), KV cache "
        f"{cap.kv_cache_bytes / GIB:.1f} GiB/GPU = {cap.sequences_fit} sequences of {plan.seq_len} tokens"
    )
    if cap.kv_cache_bytes <= 0 or cap.sequences_fit == 0:
        notes = "; ".join(plan.notes)
        return Check("memory plan", "fail", f"{head}: does not fit. {notes}")
    host_need = plan.host_needed_gib[plan.ple_format]
    if host_need > plan.machine.host_ram_gib:
        better = plan.recommended_ple_format
        return Check(
            "memory plan",
            "fail",
            f"{head}; host RAM {plan.machine.host_ram_gib:.0f} GiB < {host_need:.0f} GiB needed with "
            f"{plan.ple_format} PLE tables; fix: "
            + (f"convert the tables to {better} (the convert profile)" if better else "more host RAM"),
        )
    if seqs is not None and seqs > cap.sequences_fit:
        return Check(
            "memory plan",
            "warn",
            f"{head}; QWEN4EXP_MAX_NUM_SEQS={seqs} exceeds it (vLLM preempts); fix: {cap.sequences_fit} or fewer",
        )
    return Check("memory plan", "ok", head + (f"; max_num_seqs {seqs}" if seqs else ""))


def check_pinned_memory(
    plan, memlock_soft: int, cgroup_limit: int | None, shm_bytes: int | None, offload: bool
) -> list[Check]:
    """memlock (cudaHostRegister of each rank's PLE rows), the cgroup limit (the pinned tables are
    charged to it and cannot be reclaimed) and /dev/shm (NCCL's SHM transport)."""
    checks = []
    per_rank = plan.ple.bytes_per_rank[plan.ple_format]
    if not offload:
        checks.append(
            Check("memlock", "skip", "VLLM_PLE_CPU_OFFLOAD=0: PLE tables in GPU memory, nothing pinned")
        )
    elif memlock_soft != resource.RLIM_INFINITY and memlock_soft < per_rank:
        checks.append(
            Check(
                "memlock",
                "fail",
                f"ulimit -l is {memlock_soft // 1024} KiB, each rank pins {per_rank / GIB:.1f} GiB of "
                f"{plan.ple_format} PLE rows; fix: compose ulimits.memlock -1 (docker run --ulimit memlock=-1)",
            )
        )
    else:
        limit = "unlimited" if memlock_soft == resource.RLIM_INFINITY else f"{memlock_soft / GIB:.1f} GiB"
        checks.append(Check("memlock", "ok", f"{limit} >= {per_rank / GIB:.1f} GiB pinned per rank"))
    need = plan.host_needed_gib[plan.ple_format]
    if cgroup_limit is None:
        checks.append(
            Check("memory limit", "ok", f"no cgroup limit; the plan needs ~{need:.0f} GiB of host RAM")
        )
    elif cgroup_limit / GIB < need - plan.options.os_reserve_gib:
        checks.append(
            Check(
                "memory limit",
                "fail",
                f"cgroup limit {cgroup_limit / GIB:.0f} GiB < {need - plan.options.os_reserve_gib:.0f} GiB "
                "(pinned PLE tables + workers + /dev/shm); fix: raise the container's memory limit",
            )
        )
    else:
        checks.append(Check("memory limit", "ok", f"cgroup limit {cgroup_limit / GIB:.0f} GiB >= plan"))
    if shm_bytes is None:
        checks.append(Check("/dev/shm", "skip", "not mounted"))
    elif shm_bytes < plan.options.shm_gib * GIB * 0.9:
        checks.append(
            Check(
                "/dev/shm",
                "warn",
                f"{shm_bytes / GIB:.1f} GiB; NCCL's SHM transport and vLLM's queues want "
                f"{plan.options.shm_gib:.0f} GiB; fix: compose shm_size: 8gb",
            )
        )
    else:
        checks.append(Check("/dev/shm", "ok", f"{shm_bytes / GIB:.1f} GiB"))
    return checks


# ------------------------------------------------------------------------------------------------
# Topology and NCCL
# ------------------------------------------------------------------------------------------------


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """The GPU-to-GPU cells of ``nvidia-smi topo -m`` (or ``topo -p2p r``): {(i, j): "NV4"|"PIX"|"OK"...}."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next((ln.split() for ln in lines if ln.split() and ln.split()[0].startswith("GPU")), None)
    if header is None:
        return {}
    columns = [int(c[3:]) for c in header if re.fullmatch(r"GPU\d+", c)]
    cells = {}
    for ln in lines:
        parts = ln.split()
        if not parts or not re.fullmatch(r"GPU\d+", parts[0]) or parts == header:
            continue
        row = int(parts[0][3:])
        for col, value in zip(columns, parts[1 : 1 + len(columns)], strict=False):
            if col != row:
                cells[(row, col)] = value
    return cells


def check_topology(
    links: dict[tuple[int, int], str], p2p: dict[tuple[int, int], str], env: Mapping[str, str]
) -> Check:
    """The NCCL setting the GPU links imply, against the one configured.

    RTX 3090 NVLink bridges join pairs of cards; GeForce drivers expose no PCIe peer-to-peer. So:
    no NVLink -> SHM through host RAM (NCCL_P2P_DISABLE=1); bridged pairs -> P2P over the bridges
    only (NCCL_P2P_DISABLE=0 + NCCL_P2P_LEVEL=NVL), SHM for the other pairs.
    """
    if not links:
        return Check("NCCL topology", "skip", "no `nvidia-smi topo -m` (no GPU here)")
    disabled = (env.get("NCCL_P2P_DISABLE") or "0").strip() == "1"
    level = (env.get("NCCL_P2P_LEVEL") or "").strip().upper()
    nvlinked = sorted({tuple(sorted(k)) for k, v in links.items() if v.upper().startswith("NV")})
    pcie_pairs = sorted({tuple(sorted(k)) for k, v in links.items() if not v.upper().startswith("NV")})
    no_p2p = sorted({tuple(sorted(k)) for k, v in p2p.items() if v.upper() != "OK"})
    bridges = ", ".join(f"GPU{a}-GPU{b}" for a, b in nvlinked)
    if not nvlinked:
        if disabled:
            return Check(
                "NCCL topology", "ok", "PCIe only, no NVLink: SHM transport (NCCL_P2P_DISABLE=1) fits"
            )
        unsafe = [p for p in pcie_pairs if p in no_p2p] if p2p else pcie_pairs
        return Check(
            "NCCL topology",
            "fail" if unsafe else "warn",
            "PCIe only and NCCL_P2P_DISABLE is not 1: "
            + (f"the driver reports no P2P for {len(unsafe)} pair(s); " if unsafe else "")
            + "fix: NCCL_P2P_DISABLE=1 (SHM through host RAM)",
        )
    if len(nvlinked) == len(pcie_pairs) + len(nvlinked) and not pcie_pairs:
        hint = "NVLink between every pair: NCCL_P2P_DISABLE=0 uses it"
    else:
        hint = f"NVLink bridges {bridges}; other pairs over PCIe: NCCL_P2P_DISABLE=0 with NCCL_P2P_LEVEL=NVL uses the bridges and SHM for the rest"
    if disabled:
        return Check("NCCL topology", "warn", f"{hint}; now NCCL_P2P_DISABLE=1 leaves the bridges unused")
    if pcie_pairs and level != "NVL":
        return Check(
            "NCCL topology",
            "warn",
            f"{hint}; NCCL_P2P_LEVEL={level or 'unset'} may route P2P over PCIe, where GeForce has none; fix: NCCL_P2P_LEVEL=NVL",
        )
    return Check("NCCL topology", "ok", hint)


# ------------------------------------------------------------------------------------------------
# The KV-scale sidecar
# ------------------------------------------------------------------------------------------------


def qsa_layer_names(config: Mapping[str, Any]) -> list[str]:
    """The QSA layers' names, as the model registers them (every layer not ``linear_attention``)."""
    text = config.get("text_config") or config
    return [
        f"model.layers.{i}.self_attn" for i, t in enumerate(text["layer_types"]) if t != "linear_attention"
    ]


def sidecar_problem(sidecar: Path, checkpoint: Path, strict: bool = True) -> str | None:
    """Why the serving start-up would refuse ``sidecar`` for ``checkpoint``, or None."""
    from model.qsa_kv.settings import QSAKVConfigError
    from model.qsa_kv.sidecar import load_sidecar

    try:
        config = json.loads((checkpoint / "config.json").read_text())
        load_sidecar(sidecar, qsa_layer_names(config), strict=strict)
    except (OSError, KeyError, ValueError, QSAKVConfigError) as exc:
        return str(exc)
    return None


def check_sidecar(checkpoint: Path, deployment: Deployment) -> Check:
    """The resolved deployment's sidecar (``VLLM_QSA_KV_SCALES``, ``VLLM_QSA_KV_SCALES_STRICT``)
    against the checkpoint and the cache dtype."""
    kv = deployment.kv_cache_dtype
    path = deployment.qsa_kv.scales_path
    if not kv.startswith("fp8"):
        if path is not None:
            return Check(
                "KV scales",
                "fail",
                f"{envs.QSA_KV_SCALES}={path} with a {kv} cache; fix: unset it or use fp8",
            )
        return Check("KV scales", "skip", f"QWEN4EXP_KV_CACHE_DTYPE={kv}: no FP8 cache")
    if path is None:
        return Check(
            "KV scales",
            "warn",
            f"FP8 cache without {envs.QSA_KV_SCALES} runs uncalibrated (scale 1.0); fix: the calibrate profile",
        )
    problem = sidecar_problem(path, checkpoint, deployment.qsa_kv.strict)
    if problem:
        return Check("KV scales", "fail", problem + "; fix: run the calibrate profile for this checkpoint")
    return Check("KV scales", "ok", f"{path} covers the checkpoint's QSA layers")


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def render(checks: list[Check], seconds: float) -> str:
    lines = ["| check | verdict | detail |", "|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {c.verdict} | {c.detail.replace('|', '/')} |")
    counts = {v: sum(c.verdict == v for c in checks) for v in ("ok", "warn", "fail", "skip")}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    lines.append("")
    lines.append(f"preflight: {len(checks)} checks ({summary}) in {seconds:.2f} s")
    return "\n".join(lines)


def shm_size(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize
