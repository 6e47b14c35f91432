"""vLLM's async engine, in-process, configured from our settings through vLLM's own CLI parser.

Going through ``make_arg_parser`` gives vLLM's serving classes exactly the ``args`` namespace they
expect (``init_app_state`` reads dozens of fields) and keeps vLLM's defaults and checks; we only
choose the few flags our settings control. The engine is built in a worker thread so the HTTP
server keeps answering (503 while starting, probes) during the tens of seconds loading takes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import uuid
from argparse import Namespace

from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.inputs import TokensPrompt
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from .lifecycle import Lifecycle
from .settings import ServiceSettings, SettingsError

log = logging.getLogger("service.engine")


def platform_device() -> str:
    """The device type of the installed vLLM build/host: ``cpu`` or ``cuda`` (or another platform)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def resolve_device(settings: ServiceSettings) -> str:
    device = platform_device()
    if settings.device != "auto" and settings.device != device:
        raise SettingsError(
            f"QWEN4EXP_DEVICE={settings.device!r}: this vLLM build/host runs on {device!r}; "
            f"fix: unset QWEN4EXP_DEVICE (auto) or run the {settings.device} image on a host that has one"
        )
    return device


def cli_args(settings: ServiceSettings, device: str) -> list[str]:
    """The ``vllm serve`` flags equivalent to our settings."""
    argv = [
        "--model", str(settings.model),
        "--served-model-name", settings.model_name,
        "--tensor-parallel-size", str(settings.tensor_parallel_size),
        "--dtype", settings.dtype,
        "--kv-cache-dtype", settings.kv_cache_dtype,
        "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
        # Hybrid align mode (GDN and PLE states saved per block, QSA pages hashed like any attention cache).
        "--enable-prefix-caching" if settings.prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if settings.max_model_len is not None:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if settings.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(settings.max_num_seqs)]
    if settings.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(settings.kv_cache_memory_bytes)]
    if settings.chat_template is not None:
        argv += ["--chat-template", str(settings.chat_template)]
    if settings.enforce_eager or device == "cpu":  # no CUDA graphs on CPU; compiling only costs start time
        argv.append("--enforce-eager")
    argv += upstream_ple_storage_args(device)
    argv += gdn_prefill_args(device)
    return argv


def gdn_prefill_args(device: str) -> list[str]:
    """On CUDA, the Gated DeltaNet prefill kernel when vLLM's own pick cannot run or is not a 3090's.

    vLLM picks FlashInfer's GDN prefill on Hopper, which imports the CuTe DSL (``cutlass``); where
    that package is missing the engine would fail at its first prefill, so Triton/FLA (what vLLM
    picks on an RTX 3090, and on every GPU without FlashInfer's kernel) is passed instead, as it is
    under ``QWEN4EXP_FORCE_SM86=1``. Elsewhere vLLM decides."""
    import importlib.util

    from model.runtime import sm86

    if device != "cuda":
        return []
    if not sm86.forced() and importlib.util.find_spec("cutlass") is not None:
        return []
    return ["--additional-config", json.dumps({"gdn_prefill_backend": "triton"})]


def sm86_forced() -> bool:
    """``QWEN4EXP_FORCE_SM86`` (:mod:`model.runtime.sm86`): an H100/H200 takes the RTX 3090's paths."""
    from model.runtime import sm86

    return sm86.forced()


def resolve_auto_implementation(settings: ServiceSettings, device: str) -> list[str]:
    """``QWEN4EXP_CUDA_MODEL=auto`` on CUDA, decided once here from config.json and the GPU.

    vLLM registers the model class in every engine process before any config exists, so the choice
    is made in this process, from the same facts the subclass checks again in the worker, and
    exported as ``QWEN4EXP_CUDA_MODEL=upstream|ours`` for the processes vLLM starts. Returns the
    reasons upstream was not chosen (logged; empty when upstream serves)."""
    from model.runtime import cuda_model_choice, envs

    if device != "cuda" or envs.cuda_model() != "auto":
        return []
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    try:
        config = AutoConfig.from_pretrained(str(settings.model)).to_dict()
    except Exception as exc:  # vLLM's own config check reports an unreadable model with its reason
        log.warning("QWEN4EXP_CUDA_MODEL=auto: config.json of %s not readable here (%s)", settings.model, exc)
        return []
    cap = current_platform.get_device_capability()
    v2_raw = os.environ.get(cuda_model_choice.V2_RUNNER, "").strip()
    impl, reasons = cuda_model_choice.choose_implementation(
        config,
        os.environ,
        cuda=True,
        capability=None if cap is None else (int(cap.major), int(cap.minor)),
        kv_cache_dtype=settings.kv_cache_dtype,
        v2_runner=v2_raw in ("", "1", "true", "True"),
    )
    os.environ[envs.CUDA_MODEL] = impl
    if reasons:
        log.warning(
            "QWEN4EXP_CUDA_MODEL=auto serves ours (vLLM's own CUDA Qwen4-Exp cannot serve this deployment): %s",
            "; ".join(reasons),
        )
    else:
        log.info("QWEN4EXP_CUDA_MODEL=auto serves vLLM's own CUDA Qwen4-Exp through our subclass")
    return reasons


def upstream_ple_storage_args(device: str) -> list[str]:
    """``VLLM_PLE_CPU_OFFLOAD=0`` for upstream's model: its PLE tables follow vLLM's
    ``engram_config.cpu_offload`` (default true, pinned host memory), not our variable, so the
    device mode is passed on as ``--engram-config``. Ours reads the variable itself. A malformed
    value or choice is reported by the settings and model-choice checks, not here."""
    from model.runtime import cuda_model_choice, envs

    if device != "cuda":
        return []
    try:
        choice = cuda_model_choice.chosen()
        mode = envs.ple_storage_mode()
    except envs.EnvError:
        return []
    if choice != "upstream" or mode == "pinned":
        return []
    return ["--engram-config", json.dumps({"cpu_offload": False})]


def kv_cache_size_problem(settings: ServiceSettings, device: str) -> str | None:
    """vLLM's CPU platform lets a set ``VLLM_CPU_KVCACHE_SPACE`` replace ``--kv-cache-memory-bytes``
    without a word; refuse the pair instead of serving a cache of the other size."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if device != "cpu" or settings.kv_cache_memory_bytes is None or not space:
        return None
    return (
        f"QWEN4EXP_KV_CACHE_MEMORY_BYTES={settings.kv_cache_memory_bytes} and "
        f"VLLM_CPU_KVCACHE_SPACE={space!r} both size the CPU KV cache (vLLM would use the latter); "
        "fix: unset one of them"
    )


def parse_args(argv: list[str]) -> Namespace:
    parser = make_arg_parser(FlexibleArgumentParser(prog="service"))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    return args


# vLLM parameter names -> our variables, to name the variable when vLLM rejects a value.
VLLM_PARAMS = {
    "max_model_len": "QWEN4EXP_MAX_MODEL_LEN",
    "tensor_parallel_size": "QWEN4EXP_TENSOR_PARALLEL_SIZE",
    "cache_dtype": "QWEN4EXP_KV_CACHE_DTYPE",
    "kv_cache_dtype": "QWEN4EXP_KV_CACHE_DTYPE",
    "dtype": "QWEN4EXP_DTYPE",
    "gpu_memory_utilization": "QWEN4EXP_GPU_MEMORY_UTILIZATION",
    "max_num_seqs": "QWEN4EXP_MAX_NUM_SEQS",
    "chat_template": "QWEN4EXP_CHAT_TEMPLATE",
    "engram_config": "VLLM_PLE_CPU_OFFLOAD",
}


def _reason(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):  # a pydantic ValidationError from vLLM's config classes
        try:
            return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in errors())
        except Exception:
            pass
    return str(exc) or type(exc).__name__


def engine_config(args: Namespace) -> VllmConfig:
    """vLLM's own validation of the engine configuration (fast: no weights are read), turned into
    a configuration error naming our variables, before the server starts."""
    try:
        return AsyncEngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER
        )
    except Exception as exc:
        reason = _reason(exc)
        names = sorted({var for param, var in VLLM_PARAMS.items() if re.search(rf"\b{param}\b", reason)})
        names = names or ["QWEN4EXP_MODEL"]
        raise SettingsError(
            f"{', '.join(names)}: vLLM rejected the engine configuration: {reason}; "
            f"fix: change {' or '.join(names)} (see the message)"
        ) from None


class ProgressStatLogger(StatLoggerBase):
    """A vLLM stat logger that tells the lifecycle whenever an engine step processed tokens.

    vLLM calls ``record`` in this process for every batch of engine outputs, so this is the
    cheapest faithful signal that the engine is making progress (``/ready`` uses it).
    """

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0, *, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if iteration_stats is not None and (
            iteration_stats.num_generation_tokens or iteration_stats.num_prompt_tokens
        ):
            self.lifecycle.engine_progressed()

    def log_engine_initialized(self) -> None:
        pass


def build_engine(vllm_config: VllmConfig, args: Namespace, lifecycle: Lifecycle) -> AsyncLLM:
    """Blocking (loads weights, starts EngineCore and workers); run it in a thread.

    Mirrors ``build_async_engine_client_from_engine_args``, which constructs the engine inside
    the event loop and would block it for the whole load.
    """

    def progress_logger(config: VllmConfig, engine_index: int) -> StatLoggerBase:
        return ProgressStatLogger(config, engine_index, lifecycle=lifecycle)

    return AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=args.enable_log_requests,
        disable_log_stats=args.disable_log_stats,
        stat_loggers=[progress_logger],
    )


def upstream_choice_problems(vllm_config: VllmConfig) -> list[str]:
    """When vLLM's own CUDA Qwen4-Exp is to serve (``QWEN4EXP_CUDA_MODEL`` ``upstream``, or ``auto``
    on CUDA): why it cannot serve this deployment, one line per reason (none otherwise). Checked here
    so that start-up stops in a second instead of at model construction in the worker (which checks
    again)."""
    from model.runtime import cuda_model_choice, envs

    choice = envs.cuda_model()
    cpu_build = cuda_model_choice.vllm_is_cpu_build()
    if cuda_model_choice.resolve(choice, cpu_build=cpu_build) != "upstream":
        return []
    found = cuda_model_choice.upstream_problems(vllm_config, cpu_build=cpu_build)
    label = f"{envs.CUDA_MODEL}={choice}" + (" (upstream on CUDA)" if choice == "auto" else "")
    return [f"{label}: {problem}" for problem in found]


def default_model_runner() -> None:
    """On CUDA, pick the vLLM model runner the chosen implementation needs, unless the operator set
    ``VLLM_USE_V2_MODEL_RUNNER``: upstream's model needs V2 (its PLE inputs come from V2's model
    state), ours runs on V1 (under V2 it fails at start-up on the PLE conv state). Set before vLLM
    builds its config; the engine core and workers inherit it. vLLM's CPU build needs no setting."""
    from model.runtime import cuda_model_choice

    if cuda_model_choice.vllm_is_cpu_build() or os.environ.get(cuda_model_choice.V2_RUNNER, "").strip():
        return
    os.environ[cuda_model_choice.V2_RUNNER] = "1" if cuda_model_choice.chosen() == "upstream" else "0"


PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "qwen4exp"  # pyproject.toml, [project.entry-points."vllm.general_plugins"]


def plugin_problem() -> str | None:
    """Why vLLM would start without this project's plugin, or None.

    vLLM loads general plugins from installed entry points, filtered by ``VLLM_PLUGINS``, and only
    logs a plugin that fails to import: the engine would then serve vLLM's own Qwen4-Exp without
    the RTX 3090's parts (or fail later, far from the cause). A stale install is the usual reason
    (an entry point naming a module this checkout no longer has). ``VLLM_PLUGINS`` is read by
    vLLM's own parser, so the check and the engine agree on it."""
    from importlib.metadata import entry_points

    from vllm import envs as vllm_envs

    allowed = vllm_envs.environment_variables["VLLM_PLUGINS"]()  # uncached: the environment as it is now
    if allowed is not None and PLUGIN_NAME not in allowed:
        return (
            f"VLLM_PLUGINS={os.environ['VLLM_PLUGINS']!r} leaves out this project's vLLM plugin {PLUGIN_NAME!r} "
            f"(vLLM splits it at commas and matches each name exactly); fix: unset VLLM_PLUGINS or add "
            f"{PLUGIN_NAME} to it"
        )
    found = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if not found:
        return (
            f"no vLLM plugin named {PLUGIN_NAME!r} is installed ({PLUGIN_GROUP} entry points); fix: install "
            "this project (pip install -e . in a checkout, or use the image)"
        )
    for ep in found:
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            return (
                f"this project's vLLM plugin entry point '{PLUGIN_NAME} = {ep.value}' cannot be loaded "
                f"({type(exc).__name__}: {exc}); fix: reinstall this project (pip install -e ., or rebuild "
                "the offline bundle) so that its entry point matches the code"
            )
    return None


def configure_engine(settings: ServiceSettings) -> tuple[str, VllmConfig, Namespace]:
    """Device, vLLM config and vLLM args; every problem found is reported together."""
    problems = []
    try:
        device = resolve_device(settings)
    except SettingsError as exc:
        problems.append(str(exc))
        device = platform_device()  # still check the rest against the platform we have
    if (kv_problem := kv_cache_size_problem(settings, device)) is not None:
        problems.append(kv_problem)
    if (missing_plugin := plugin_problem()) is not None:
        problems.append(missing_plugin)
    args = parse_args(cli_args(settings, device))
    from model.runtime.envs import EnvError

    try:
        if device == "cuda" and sm86_forced():
            os.environ.setdefault(
                "VLLM_TEST_FORCE_FP8_MARLIN", "1"
            )  # FP8 weights through Marlin, as on sm_86
        resolve_auto_implementation(settings, device)
        default_model_runner()
    except EnvError as exc:  # a malformed QWEN4EXP_CUDA_MODEL, reported with the rest
        problems.append(str(exc))
    try:
        vllm_config = engine_config(args)
    except SettingsError as exc:
        problems.append(str(exc))
    else:
        problems += upstream_choice_problems(vllm_config)
    if problems:
        raise SettingsError("\n".join(problems))
    return device, vllm_config, args


async def generate_one_token(engine: AsyncLLM, timeout: float) -> None:
    """The readiness probe: a 1-token greedy generation through the whole engine."""
    tokenizer = engine.get_tokenizer()
    ids = tokenizer.encode("Hello", add_special_tokens=False) or [0]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    request_id = f"qwen4exp-ready-{uuid.uuid4().hex}"

    async def run() -> None:
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=ids[:1]), params, request_id):
            pass

    await asyncio.wait_for(run(), timeout)
