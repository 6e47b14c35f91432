"""The deployment, decided once: one pure function from the facts to a frozen, typed object.

Why one function: the implementation choice, the PLE storage, the 3090 forcing and the engine
arguments that follow from them are needed by the service's start-up, its preflight and vLLM's
processes; decided in each from raw environment strings, a value could mean one thing to one of
them and another to the next. :func:`resolve` takes every fact it needs as an argument (the
model's environment variables, vLLM's cache dtype, config.json as a dict, the GPU, the vLLM build)
and returns a :class:`Deployment`. The service's start-up, the preflight and the engine command
line call it; vLLM's processes receive the result as data in ``additional_config``
(:meth:`Deployment.additional_config`, read back with :func:`of`), so no environment variable is
written for them except those vLLM itself reads (:meth:`Deployment.child_environment`).

Users' interface unchanged: each variable is parsed by its one parser in :mod:`model.runtime.envs`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from model.deployment import expert_layout, implementation, speculative
from model.qsa_kv.settings import QSAKVSettings
from model.runtime import additional_config, envs

V2_RUNNER = implementation.V2_RUNNER
FP8_MARLIN = "VLLM_TEST_FORCE_FP8_MARLIN"
CPU_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
# On vLLM's CPU build with several ranks and no size given: this share of the memory available
# at start-up goes to the KV caches of all ranks together (vLLM would give each rank nearly all of it).
CPU_TP_KV_SHARE = 0.5


class DeploymentError(ValueError):
    """The deployment cannot be resolved; one ``NAME=value: why; fix: how`` line per problem."""


@dataclass(frozen=True)
class GpuFacts:
    """What the choice needs to know of the GPU, read before CUDA kernels are imported.

    ``capability``: (major, minor), None if unknown. ``shared_memory_per_block``: opt-in bytes per
    block, None for the table value of the capability. ``has_cute_dsl``: vLLM's FlashInfer GDN
    prefill can import ``cutlass`` (without it the engine would fail at its first prefill)."""

    capability: tuple[int, int] | None
    shared_memory_per_block: int | None = None
    has_cute_dsl: bool = True


@dataclass(frozen=True)
class Deployment:
    """Everything decided about how this deployment runs; each field says where it comes from."""

    device: str  # "cpu" or "cuda": the installed vLLM build's platform
    requested_implementation: str  # QWEN4EXP_CUDA_MODEL as given: auto, ours or upstream
    implementation: str  # what serves: "ours" or "upstream"
    implementation_reasons: tuple[str, ...]  # why not upstream (ours), or what stops upstream
    kv_cache_dtype: str  # vLLM's --kv-cache-dtype
    qsa_kv: QSAKVSettings  # VLLM_QSA_KV_*: sidecar, strictness, calibration, clip counting
    ple_storage: str  # VLLM_PLE_CPU_OFFLOAD: "pinned" (host memory, UVA) or "device"
    ple_prefetch: bool  # VLLM_PLE_PREFETCH, default on with CUDA
    qsa_selection: str  # QWEN4EXP_QSA_SELECTION: "batched" (CUDA default) or "loop"
    force_sm86: bool  # QWEN4EXP_FORCE_SM86: a newer GPU takes every choice a 3090 takes
    gdn_prefill_backend: str | None  # "triton" when vLLM's own pick cannot run or is not a 3090's
    gdn_short_prefill: bool  # QWEN4EXP_GDN_SHORT_PREFILL (upstream)
    hc_reference_rounding: bool  # QWEN4EXP_HC_REFERENCE_ROUNDING (upstream)
    separate_indexer_projection: bool  # QWEN4EXP_SEPARATE_INDEXER_PROJECTION (upstream)
    v2_runner: bool | None  # VLLM_USE_V2_MODEL_RUNNER to set (None: the operator's or not CUDA)
    fp8_marlin: bool  # FP8 weights through Marlin, as on sm_86 (forced on a newer GPU)
    fault_tokens: tuple[tuple[int, bool], ...] = field(default=())  # tests only: (token id, fatal)
    tensor_parallel_size: int = 1  # QWEN4EXP_TENSOR_PARALLEL_SIZE
    cpu_threads_bind: str | None = None  # vLLM's CPU build, several ranks: the cores of each rank
    cpu_kv_cache_bytes: int | None = None  # vLLM's CPU build, several ranks: each rank's KV cache
    speculative: speculative.Speculative | None = None  # QWEN4EXP_SPECULATIVE and its companions
    speculative_note: str = ""  # why speculation runs as it does (or not), for the start-up log
    speculative_declined: bool = False  # a method asked for by name is not served (our implementation)
    expert_parallel: bool = False  # QWEN4EXP_EXPERT_PARALLEL: whole experts per rank
    expert_parallel_note: str = ""  # why (for the start-up log; empty when nothing to say)

    @property
    def upstream(self) -> bool:
        return self.implementation == "upstream"

    def require(self, implementation_name: str) -> None:
        """Refuse to build ``implementation_name`` where the deployment chose the other one: the
        class vLLM registered (from the environment) and the deployment it was given (from
        ``additional_config``) must agree, or a process would serve what nobody decided."""
        if self.implementation != implementation_name:
            raise ValueError(
                f"vLLM registered the {implementation_name} Qwen4-Exp implementation, but the deployment "
                f"it was given chose {self.implementation} ({envs.CUDA_MODEL}={self.requested_implementation}); "
                f"fix: start vLLM through the service (python -m service), or set {envs.CUDA_MODEL} the same "
                "in every process"
            )

    # ---- the channels to vLLM ------------------------------------------------------------------

    def additional_config(self) -> dict[str, Any]:
        """vLLM's ``--additional-config``: our section (the whole deployment, JSON) and vLLM's own
        GDN prefill key where we choose it. Deterministic: it enters vLLM's config hash, and with it
        the compile cache's key."""
        out: dict[str, Any] = {additional_config.KEY: _to_json(self)}
        if self.gdn_prefill_backend is not None:
            out["gdn_prefill_backend"] = self.gdn_prefill_backend
        return out

    def engine_args(self) -> list[str]:
        """The ``vllm serve`` flags the deployment adds to the service's own."""
        argv = ["--additional-config", json.dumps(self.additional_config(), sort_keys=True)]
        if self.device == "cuda" and self.upstream and self.ple_storage == "device":
            # Upstream's PLE tables follow vLLM's engram_config (default: pinned host memory).
            argv += ["--engram-config", json.dumps({"cpu_offload": False})]
        if self.cpu_kv_cache_bytes is not None:
            argv += ["--kv-cache-memory-bytes", str(self.cpu_kv_cache_bytes)]
        if self.speculative is not None:
            argv += ["--speculative-config", json.dumps(self.speculative.vllm_config(), sort_keys=True)]
        if self.expert_parallel:
            argv.append("--enable-expert-parallel")
        return argv

    def child_environment(self) -> dict[str, str]:
        """Variables for the processes vLLM starts, where only the environment reaches in time.

        vLLM reads ``VLLM_USE_V2_MODEL_RUNNER`` and ``VLLM_TEST_FORCE_FP8_MARLIN`` from the
        environment itself, and registers the model class in each process before any configuration
        exists, so the resolved ``QWEN4EXP_CUDA_MODEL`` goes there too (the model class then checks
        it against :meth:`additional_config`)."""
        env = {envs.CUDA_MODEL: self.implementation}
        if self.v2_runner is not None:
            env[V2_RUNNER] = "1" if self.v2_runner else "0"
        if self.fp8_marlin:
            env[FP8_MARLIN] = "1"
        if self.cpu_threads_bind is not None:
            env[CPU_THREADS_BIND] = self.cpu_threads_bind
        return env


def _to_json(deployment: Deployment) -> dict[str, Any]:
    data = asdict(deployment)
    data["qsa_kv"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in data["qsa_kv"].items()}
    data["implementation_reasons"] = list(deployment.implementation_reasons)
    data["fault_tokens"] = [list(t) for t in deployment.fault_tokens]
    return data


def from_json(data: Mapping[str, Any]) -> Deployment:
    """The :class:`Deployment` that :meth:`Deployment.additional_config` wrote."""
    kv = dict(data["qsa_kv"])
    for key in ("scales_path", "collect_dir"):
        kv[key] = None if kv.get(key) is None else Path(kv[key])
    fields = dict(data)
    fields["qsa_kv"] = QSAKVSettings(**kv)
    fields["implementation_reasons"] = tuple(data.get("implementation_reasons", ()))
    fields["fault_tokens"] = tuple((int(t), bool(f)) for t, f in data.get("fault_tokens", ()))
    if fields.get("speculative") is not None:
        fields["speculative"] = speculative.Speculative(**fields["speculative"])
    return Deployment(**fields)


def _flag_or_none(raw: str | None) -> bool | None:
    if raw is None or not raw.strip():
        return None
    return raw.strip().lower() in ("1", "true", "yes", "on")


def resolve(
    env: Mapping[str, str],
    *,
    cpu_build: bool,
    kv_cache_dtype: str = "auto",
    config: Mapping[str, Any] | None = None,
    gpu: GpuFacts | None = None,
    indexer_kv_dtype: str | None = None,
    tensor_parallel_size: int = 1,
    cpus: tuple[int, ...] = (),
    memory_available: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    has_mtp_weights: bool | None = None,
) -> Deployment:
    """The deployment for these facts; :class:`DeploymentError` lists every malformed variable.

    ``env``: the environment (only the model's variables and ``VLLM_USE_V2_MODEL_RUNNER`` are read);
    ``cpu_build``: vLLM's CPU build is installed; ``config``: config.json as a dict (None: not
    readable here, then ``auto`` takes the build's default and the model class checks in the worker);
    ``gpu``: the GPU's facts (None on the CPU build or when unknown); ``cpus``, ``memory_available``
    (bytes) and ``kv_cache_memory_bytes`` (the operator's size, None: unset) place several ranks on
    vLLM's CPU build, which otherwise asks for one NUMA node per rank and sizes each rank's KV cache
    from the whole machine's memory; ``has_mtp_weights``: the checkpoint's tensors include ``mtp.*``
    (None: unknown here)."""
    problems: list[str] = []

    def read(name: str) -> Any:
        try:
            return envs.read(name, env)
        except envs.EnvError as exc:
            problems.append(f"{exc}; fix: {envs.BY_NAME[name].fix}")
            return envs.BY_NAME[name].default

    device = "cpu" if cpu_build else "cuda"
    cuda = device == "cuda"
    requested = read(envs.CUDA_MODEL)
    force_sm86 = bool(read(envs.FORCE_SM86))
    qsa_kv = QSAKVSettings(
        scales_path=read(envs.QSA_KV_SCALES),
        strict=read(envs.QSA_KV_SCALES_STRICT),
        collect_dir=read(envs.QSA_KV_COLLECT),
        collect_interval_s=read(envs.QSA_KV_COLLECT_INTERVAL),
        clip_interval_s=read(envs.QSA_KV_CLIP_COUNT),
    )
    ple_storage = "pinned" if read(envs.PLE_CPU_OFFLOAD) else "device"
    prefetch = read(envs.PLE_PREFETCH)
    selection = read(envs.QSA_SELECTION)
    faults = tuple(
        (token, fatal)
        for name, fatal in ((envs.FAULT_INJECT_TOKEN, False), (envs.FAULT_INJECT_FATAL_TOKEN, True))
        if (token := read(name)) is not None
    )
    operator_v2 = _flag_or_none(env.get(V2_RUNNER))
    threads_bind, kv_bytes = None, None
    if cpu_build and tensor_parallel_size > 1:
        threads_bind, kv_bytes = _cpu_ranks(
            env, tensor_parallel_size, cpus, memory_available, kv_cache_memory_bytes, problems
        )
    speculative_request = (read(envs.SPECULATIVE), read(envs.SPECULATIVE_TOKENS), read(envs.NGRAM_WINDOW))
    expert_parallel, expert_parallel_note, layout_problems = expert_layout.choose(
        read(envs.EXPERT_PARALLEL), config, tp=tensor_parallel_size, cuda=cuda
    )
    problems += layout_problems
    if problems:
        raise DeploymentError("\n".join(problems))

    impl, reasons = _choose(requested, config, env, cuda=cuda, gpu=gpu, kv_cache_dtype=kv_cache_dtype,
                            indexer_kv_dtype=indexer_kv_dtype, v2_runner=operator_v2)  # fmt: skip
    has_cute_dsl = True if gpu is None else gpu.has_cute_dsl
    try:
        drafting, drafting_note = speculative.choose(
            *speculative_request, implementation=impl, config=config, has_mtp_weights=has_mtp_weights
        )
    except speculative.SpeculativeError as exc:
        raise DeploymentError(str(exc)) from None
    return Deployment(
        device=device,
        requested_implementation=requested,
        implementation=impl,
        implementation_reasons=tuple(reasons),
        kv_cache_dtype=kv_cache_dtype,
        qsa_kv=qsa_kv,
        ple_storage=ple_storage,
        ple_prefetch=cuda if prefetch is None else bool(prefetch),
        qsa_selection=("batched" if cuda else "loop") if selection is None else selection,
        force_sm86=force_sm86,
        gdn_prefill_backend="triton" if cuda and (force_sm86 or not has_cute_dsl) else None,
        gdn_short_prefill=bool(read(envs.GDN_SHORT_PREFILL)),
        hc_reference_rounding=bool(read(envs.HC_REFERENCE_ROUNDING)),
        separate_indexer_projection=bool(read(envs.SEPARATE_INDEXER_PROJECTION)),
        v2_runner=(impl == "upstream") if cuda and operator_v2 is None else None,
        fp8_marlin=cuda and force_sm86,
        fault_tokens=faults,
        tensor_parallel_size=tensor_parallel_size,
        cpu_threads_bind=threads_bind,
        cpu_kv_cache_bytes=kv_bytes,
        speculative=drafting,
        speculative_note=drafting_note,
        speculative_declined=speculative.declined(speculative_request[0], drafting),
        expert_parallel=expert_parallel,
        expert_parallel_note=expert_parallel_note,
    )


def split_cores(cpus: list[int] | tuple[int, ...], ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks: the cores in as many equal, contiguous
    groups (a remainder stays unused), e.g. ``0,1|2,3``."""
    ordered = sorted(cpus)
    per = len(ordered) // ranks
    return "|".join(",".join(map(str, ordered[i * per : (i + 1) * per])) for i in range(ranks))


def _cpu_ranks(
    env: Mapping[str, str],
    tp: int,
    cpus: tuple[int, ...],
    memory_available: int | None,
    kv_cache_memory_bytes: int | None,
    problems: list[str],
) -> tuple[str | None, int | None]:
    """Cores and KV-cache bytes of each rank on vLLM's CPU build: the allowed cores split into ``tp``
    contiguous groups (vLLM's own binding wants a NUMA node per rank, which a one-socket host lacks),
    unless ``VLLM_CPU_OMP_THREADS_BIND`` is set; and, unless a size is given, a share of the
    available memory divided among the ranks (vLLM would size each rank from all of it, and the
    ranks together would not fit)."""
    bind = None
    if not env.get(CPU_THREADS_BIND, "").strip():
        ordered = sorted(cpus)
        if len(ordered) < tp:
            problems.append(
                f"QWEN4EXP_TENSOR_PARALLEL_SIZE={tp} on vLLM's CPU build needs a core per rank, and this "
                f"process may use {len(ordered)}; fix: lower QWEN4EXP_TENSOR_PARALLEL_SIZE, or set "
                f"{CPU_THREADS_BIND} (vLLM's syntax: cores per rank separated by |)"
            )
        else:
            bind = split_cores(ordered, tp)
    kv_bytes = None
    if (
        kv_cache_memory_bytes is None
        and not env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        and memory_available
    ):
        kv_bytes = int(memory_available * CPU_TP_KV_SHARE) // tp
    return bind, kv_bytes


def _choose(
    requested: str,
    config: Mapping[str, Any] | None,
    env: Mapping[str, str],
    *,
    cuda: bool,
    gpu: GpuFacts | None,
    kv_cache_dtype: str,
    indexer_kv_dtype: str | None,
    v2_runner: bool | None,
) -> tuple[str, list[str]]:
    """Which implementation serves, and why (the only caller of the choice's rules)."""
    if not cuda:
        # The CPU build runs only ours; an explicit ``upstream`` is refused by the model class,
        # listing why, rather than served by ours under that name.
        return ("upstream" if requested == "upstream" else "ours"), []
    if config is None:
        return ("ours" if requested == "ours" else "upstream"), []
    return implementation.choose_implementation(
        config,
        env,
        cuda=True,
        capability=None if gpu is None else gpu.capability,
        shared_memory_per_block=None if gpu is None else gpu.shared_memory_per_block,
        kv_cache_dtype=kv_cache_dtype,
        indexer_kv_dtype=indexer_kv_dtype,
        # The service selects V2 for upstream unless the operator set the variable.
        v2_runner=True if v2_runner is None else v2_runner,
    )


def of(vllm_config: Any, env: Mapping[str, str] | None = None) -> Deployment:
    """The deployment a vLLM process runs: the service's, from ``additional_config``; else (vLLM
    started without the service) resolved here from the environment and ``vllm_config``, with the
    implementation this process registered, and written into ``additional_config``: later readers
    in this process then see the same deployment, and vLLM's compile-cache key (which hashes
    ``additional_config`` when the model is first compiled, after it is built, and no ``QWEN4EXP_*``
    variable) changes with it. Without that, two runs that differ only in a variable that changes
    the traced graph (``QWEN4EXP_HC_REFERENCE_ROUNDING``) would share compiled code."""
    section = additional_config.section(vllm_config)
    if section is not None:
        return from_json(section)
    from vllm.platforms import current_platform

    env = os.environ if env is None else env
    cpu_build = not current_platform.is_cuda()
    deployment = resolve(
        env,
        cpu_build=cpu_build,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        config=None,
    )
    registered = implementation.registered(deployment.requested_implementation, cpu_build=cpu_build)
    deployment = replace(deployment, implementation=registered)
    if isinstance(getattr(vllm_config, "additional_config", None), dict):
        vllm_config.additional_config[additional_config.KEY] = _to_json(deployment)
    return deployment
