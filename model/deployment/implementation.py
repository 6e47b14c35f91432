"""Which Qwen4-Exp implementation serves on CUDA, and every reason vLLM's own one cannot serve here.

vLLM 0.32 ships a CUDA-only ``qwen4_exp`` (``vllm.models.qwen4_exp.nvidia``). Measured on an H200 it
matches transformers as closely as ours and runs 9-16x faster, so on CUDA it is the target; but it
lacks features ours has, and needs settings ours does not. ``QWEN4EXP_CUDA_MODEL=upstream``
(:mod:`model.runtime.envs`) opts into it through thin subclasses (:mod:`model.upstream.model`)
that stop start-up with :func:`problems_for_upstream`'s list instead of serving without them. Since
the subclasses carry the 3090's parts and passed on an H200 (docs/validation.md), the default ``auto``
serves upstream on CUDA and ours on vLLM's CPU build.

Everything here is a pure function of injected facts (config.json as a dict, the environment, the
platform), so the decision is tested on a CPU box where upstream cannot even be imported. Only the
standard library and this package's standard-library modules are imported at module level; vLLM
only inside :func:`vllm_is_cpu_build` and :func:`refuse_unless_upstream_can_serve`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from model.ple import format as ple_format
from model.runtime import envs, sm86

ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
OURS_MODULE = "model.ours.model"
UPSTREAM_MODULE = "model.upstream.model"
UPSTREAM_STAND_IN_MODULE = "model.ours.upstream_stand_ins"
# On vLLM's CPU build ``upstream`` is served by these (subclasses of ours whose construction raises):
# own names, so vLLM's model-info cache (keyed by module and class name) never hands the CUDA
# build the CPU build's inspection of the same module.
REFUSED_ON_CPU_SUFFIX = "RefusedOnCpuBuild"

# Upstream's QSA top-k kernels take only these block counts (indexer_budget / indexer_compress_ratio).
UPSTREAM_TOPK_BLOCKS = (512, 1024, 2048)
# Upstream's QSA layers accept these cache dtypes and raise NotImplementedError for any other.
UPSTREAM_KV_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
# Native FP8 (E4M3) starts at sm_89 (Ada). Our subclass (model.upstream.qsa) writes and
# reads the QSA *main* cache's E4M3 codes itself, on any GPU; upstream's optional FP8 *indexer* cache
# multiplies FP8 by FP8 in Triton, which needs native FP8, so it is refused below this.
FP8_MIN_CAPABILITY = (8, 9)
# Upstream's indexer prefill kernel keeps a tile of query rows x index heads x head dim in shared
# memory; our subclass sizes that tile for the GPU (model.upstream.indexer_tiles), so
# only a shape no tile fits is a problem. The index heads are replicated, not split by TP.

# vLLM's GDN layer accepts these; null is read as hidden_act, as transformers reads it (our subclass
# writes it into the config upstream reads).
OUTPUT_GATE_TYPES = ("silu", "swish", "sigmoid")
V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
USE_OURS = f"set {envs.CUDA_MODEL}=ours"


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of config.json holding the language model's fields (a multimodal config nests it)."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _has_qsa_layers(text: Mapping[str, Any]) -> bool:
    layer_types = text.get("layer_types")
    return not isinstance(layer_types, list) or "indexed_attention" in layer_types


def problems_for_upstream(
    config: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    cuda: bool,
    capability: tuple[int, int] | None,
    kv_cache_dtype: str,
    v2_runner: bool,
    indexer_kv_dtype: str | None = None,
    ple_cpu_offload: bool | None = None,
    shared_memory_per_block: int | None = None,
) -> list[str]:
    """Every reason vLLM's own CUDA Qwen4-Exp cannot serve this deployment (empty: it can).

    ``config``: config.json as a dict (a multimodal config's ``text_config`` is read for the model
    fields); ``env``: the environment; ``cuda``: vLLM runs on its CUDA platform (False on its CPU
    build); ``capability``: the GPU's compute capability, None if unknown; ``kv_cache_dtype``:
    vLLM's ``cache_config.cache_dtype``; ``v2_runner``: vLLM picked Model Runner V2;
    ``indexer_kv_dtype``: vLLM's ``attention_config.indexer_kv_dtype``; ``ple_cpu_offload``: vLLM's
    ``engram_config.cpu_offload``, where upstream keeps its PLE tables (None: no engram config);
    ``shared_memory_per_block``: the GPU's opt-in shared memory per block in bytes (None: unknown).
    The FP8 main cache and the ``VLLM_QSA_KV_*`` features are not problems: our subclass carries them
    (``model.upstream.qsa``).
    Each problem names the variable or field and its fix; all are reported at once.
    """
    problems: list[str] = []
    if not cuda:
        problems.append(
            f"{envs.CUDA_MODEL}=upstream needs vLLM's CUDA build; this vLLM is not on CUDA (its CPU "
            f"build, where only ours runs); fix: {USE_OURS}, or install vLLM's CUDA build"
        )
    if not v2_runner:
        raw = env.get(V2_RUNNER, "")
        why = (
            f"{V2_RUNNER}={raw!r}"
            if raw.strip()
            else f"{V2_RUNNER} unset, so vLLM chose V1 itself: no Triton, or a feature V2 lacks (its log says)"
        )
        problems.append(
            f"vLLM picked its V1 model runner ({why}); upstream's model needs Model Runner V2 "
            f'(under V1 it stops with "PLE inputs were not prepared"); fix: set {V2_RUNNER}=1, '
            f"or {USE_OURS}"
        )
    text = _text_config(config)
    gate = text.get("output_gate_type") or text.get("hidden_act", "silu")
    if str(gate).strip().lower() not in OUTPUT_GATE_TYPES:
        problems.append(
            f"config.json output_gate_type={text.get('output_gate_type')!r} (hidden_act="
            f"{text.get('hidden_act')!r}): upstream's GDN layers take only {', '.join(OUTPUT_GATE_TYPES)}; "
            f"fix: {USE_OURS}"
        )
    if _has_qsa_layers(text):
        budget, ratio = text.get("indexer_budget"), text.get("indexer_compress_ratio")
        try:
            k, rest = divmod(int(budget), int(ratio))
        except (TypeError, ValueError, ZeroDivisionError):
            k, rest = None, 0
        if k is None or rest or k not in UPSTREAM_TOPK_BLOCKS:
            got = f"k = {k} blocks" if k is not None and not rest else "no whole number of blocks"
            problems.append(
                f"config.json indexer_budget={budget!r} / indexer_compress_ratio={ratio!r} gives a QSA "
                f"top-k of {got}; upstream's top-k kernels take only k = "
                f"{', '.join(map(str, UPSTREAM_TOPK_BLOCKS))}; fix: {USE_OURS}"
            )
        heads, head_dim = text.get("indexer_n_heads"), text.get("indexer_head_dim")
        indexer_fp8 = (indexer_kv_dtype or "auto").strip().lower() == "fp8"
        if shared_memory_per_block and heads and head_dim:
            from model.deployment.indexer_tile_fit import refusal

            cap = 86 if capability is None else capability[0] * 10 + capability[1]
            why = refusal(
                int(heads),
                int(head_dim),
                fp8=indexer_fp8,
                shared_limit=shared_memory_per_block,
                capability=cap,
            )
            if why:
                problems.append(f"config.json {why}; fix: {USE_OURS}")
    dtype = (kv_cache_dtype or "auto").strip().lower()
    if dtype not in UPSTREAM_KV_DTYPES:
        problems.append(
            f"--kv-cache-dtype {kv_cache_dtype}: upstream's QSA takes only "
            f"{', '.join(UPSTREAM_KV_DTYPES)}; fix: use one of those, or {USE_OURS}"
        )
    indexer_dtype = (indexer_kv_dtype or "auto").strip().lower()
    if indexer_dtype == "fp8" and cuda and (capability is None or tuple(capability) < FP8_MIN_CAPABILITY):
        gpu = "unknown" if capability is None else f"sm_{capability[0]}{capability[1]}"
        problems.append(
            f"--attention-config indexer_kv_dtype=fp8 on a GPU of compute capability {gpu}: upstream's FP8 "
            f"indexer cache needs native FP8 (sm_{FP8_MIN_CAPABILITY[0]}{FP8_MIN_CAPABILITY[1]}+); fix: leave "
            f"indexer_kv_dtype at auto/bf16 (the main K/V cache may still be fp8), or {USE_OURS}"
        )
    if text.get("ple_layer_ids"):
        eos = text.get("eos_token_id", config.get("eos_token_id"))
        if not isinstance(eos, int) or isinstance(eos, bool):
            problems.append(
                f"config.json eos_token_id={eos!r}: upstream's PLE n-gram hashing reads one end-of-document "
                "id (int(config.eos_token_id), qwen4_exp/nvidia/model_state.py:46); fix: write a single "
                f"integer id, or {USE_OURS}"
            )
    if text.get("ple_layer_ids") and ple_cpu_offload is not None:
        try:
            wanted = envs.ple_storage_mode(env)
        except envs.EnvError:
            wanted = None  # a malformed value is reported by the settings check already
        got = "pinned" if ple_cpu_offload else "device"
        if wanted is not None and wanted != got:
            problems.append(
                f"{envs.PLE_CPU_OFFLOAD}={env.get(envs.PLE_CPU_OFFLOAD, '')!r} asks for PLE tables in "
                f"{'pinned host' if wanted == 'pinned' else 'GPU'} memory, but vLLM's engram_config.cpu_offload="
                f"{ple_cpu_offload} is where upstream puts them; fix: pass --engram-config "
                f"'{{\"cpu_offload\": {str(wanted == 'pinned').lower()}}}' (the service does this itself), "
                f"or set {envs.PLE_CPU_OFFLOAD} to match"
            )
    # Every format ours reads, upstream reads through our subclass (model.upstream.ple serves
    # model.ple.format.FORMATS); only a malformed declaration is a problem.
    try:
        ple_format.table_format_of(text)
    except ValueError as exc:
        problems.append(f"{exc}; fix: correct config.json, or {USE_OURS}")
    return problems


def refusal_message(problems: list[str]) -> str:
    """The start-up error for ``QWEN4EXP_CUDA_MODEL=upstream``: one line per problem."""
    lines = "\n".join(f"  - {p}" for p in problems)
    return (
        f"{envs.CUDA_MODEL}=upstream (vLLM's own CUDA Qwen4-Exp) cannot serve this deployment, "
        f"{len(problems)} problem(s):\n{lines}"
    )


# Opt-in shared memory per block by compute capability (CUDA programming guide, "Technical
# specifications per compute capability"), for decisions taken before CUDA is initialised.
SHARED_MEMORY_OPTIN = {(7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912,
                       (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}  # fmt: skip


def choose_implementation(
    config: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    cuda: bool,
    capability: tuple[int, int] | None,
    shared_memory_per_block: int | None = None,
    kv_cache_dtype: str = "auto",
    indexer_kv_dtype: str | None = None,
    v2_runner: bool = True,
    ple_cpu_offload: bool | None = None,
) -> tuple[str, list[str]]:
    """``("upstream" | "ours", reasons)``: what ``QWEN4EXP_CUDA_MODEL`` (in ``env``) serves here.

    ``auto``: upstream on CUDA when nothing stops it (it is 7-15x faster), else ours, with upstream's
    problems as the reasons; ours on vLLM's CPU build. ``ours``: ours. ``upstream``: upstream, with
    its problems as reasons (the caller refuses to start on any). ``shared_memory_per_block`` None:
    from :data:`SHARED_MEMORY_OPTIN` by ``capability`` (a 3090's under ``QWEN4EXP_FORCE_SM86``).
    ``v2_runner``: whether vLLM will use Model Runner V2 (the service selects it for upstream unless
    the operator set ``VLLM_USE_V2_MODEL_RUNNER``)."""
    choice = envs.cuda_model(env)
    if choice == "ours":
        return "ours", [f"{envs.CUDA_MODEL}=ours"]
    if sm86.forced(env):
        capability, shared_memory_per_block = sm86.CAPABILITY, sm86.SHARED_MEMORY_PER_BLOCK
    if shared_memory_per_block is None and capability is not None:
        shared_memory_per_block = SHARED_MEMORY_OPTIN.get(tuple(capability))
    problems = problems_for_upstream(
        config, env, cuda=cuda, capability=capability, kv_cache_dtype=kv_cache_dtype, v2_runner=v2_runner,
        indexer_kv_dtype=indexer_kv_dtype, ple_cpu_offload=ple_cpu_offload,
        shared_memory_per_block=shared_memory_per_block,
    )  # fmt: skip
    if choice == "upstream" or not problems:
        return "upstream", problems
    return "ours", problems


def registered(choice: str, *, cpu_build: bool) -> str:
    """What registration serves for a choice, before any configuration exists: ``auto`` -> ``ours``
    on vLLM's CPU build, ``upstream`` on CUDA; other choices as they are. The service then hands
    each process the choice :func:`model.deployment.resolve.resolve` made, already resolved."""
    if choice == "auto":
        return "ours" if cpu_build else "upstream"
    return choice


def registration_targets(choice: str, *, cpu_build: bool) -> dict[str, str]:
    """The ``module:Class`` vLLM registers for each architecture name.

    ``auto`` -> :func:`registered`. ``ours`` -> ours, on either build. ``upstream`` on CUDA -> the upstream subclasses. ``upstream``
    on vLLM's CPU build -> subclasses of ours that raise :func:`refusal_message` when constructed,
    so the deployment neither imports upstream there (it cannot) nor silently serves ours.
    """
    if choice not in envs.CUDA_MODEL_CHOICES:
        raise ValueError(f"unknown {envs.CUDA_MODEL} choice {choice!r}; use one of {envs.CUDA_MODEL_CHOICES}")
    choice = registered(choice, cpu_build=cpu_build)
    if choice == "ours":
        return {arch: f"{OURS_MODULE}:{arch}" for arch in ARCHITECTURES}
    if cpu_build:
        return {arch: f"{UPSTREAM_STAND_IN_MODULE}:{arch}{REFUSED_ON_CPU_SUFFIX}" for arch in ARCHITECTURES}
    return {arch: f"{UPSTREAM_MODULE}:{arch}" for arch in ARCHITECTURES}


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build, by vLLM's own rule (touches no GPU). The one
    place this is decided: ``service.cuda_preflight.installed_vllm_build`` calls it too."""
    from vllm.platforms import vllm_version_matches_substr

    return vllm_version_matches_substr("cpu")


def _capability(platform: Any) -> tuple[int, int] | None:
    try:
        cap = platform.get_device_capability()
    except Exception:  # noqa: BLE001 - unknown counts as "not known to have FP8", fail closed
        return None
    return None if cap is None else (int(cap.major), int(cap.minor))


def _shared_memory_per_block() -> int | None:
    """The current GPU's opt-in shared memory per block (what a Triton kernel may ask for); a 3090's
    under ``QWEN4EXP_FORCE_SM86=1``."""
    if sm86.forced():
        return sm86.SHARED_MEMORY_PER_BLOCK
    try:
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.shared_memory_per_block_optin)
    except Exception:  # noqa: BLE001 - unknown: no refusal from it; Triton still refuses at launch
        return None


def refuse_unless_upstream_can_serve(
    vllm_config: Any, *, cpu_build: bool = False, env: Mapping[str, str] | None = None
) -> None:
    """Gather the facts from vLLM and raise ``ValueError`` (:func:`refusal_message`) on any problem.

    Called at the top of the upstream subclasses' ``__init__``, before anything is built.
    ``cpu_build``: the caller is the CPU build's stand-in, which must refuse whatever the platform
    says (the "not CUDA" problem is then always in the list).
    """
    problems = upstream_problems(vllm_config, cpu_build=cpu_build, env=env)
    if problems:
        raise ValueError(refusal_message(problems))


def captures_cuda_graphs(vllm_config: Any) -> bool:
    """Whether vLLM will capture CUDA graphs (its resolved ``cudagraph_mode`` is not NONE)."""
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def upstream_problems(
    vllm_config: Any, *, cpu_build: bool = False, env: Mapping[str, str] | None = None
) -> list[str]:
    """:func:`problems_for_upstream` with the facts read from a ``VllmConfig`` and vLLM's platform.

    The service calls it right after vLLM validated the engine configuration (exit 2 in a second,
    with its other configuration problems); the subclasses call it again in the worker, where the
    GPU's facts are certain.
    """
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    cuda = not cpu_build and bool(current_platform.is_cuda())
    problems = problems_for_upstream(
        config,
        os.environ if env is None else env,
        cuda=cuda,
        capability=_capability(current_platform) if cuda else None,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        # The property vLLM's workers and scheduler read: VLLM_USE_V2_MODEL_RUNNER if set, else V2
        # unless Triton or a feature V2 lacks forces V1.
        v2_runner=bool(vllm_config.use_v2_model_runner),
        indexer_kv_dtype=str(
            getattr(getattr(vllm_config, "attention_config", None), "indexer_kv_dtype", "auto")
        ),
        ple_cpu_offload=getattr(getattr(vllm_config, "engram_config", None), "cpu_offload", None),
        shared_memory_per_block=_shared_memory_per_block() if cuda else None,
    )
    return problems
