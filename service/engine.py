"""vLLM's async engine, in-process, configured from our settings through vLLM's own CLI parser.

Going through ``make_arg_parser`` gives vLLM's serving classes exactly the ``args`` namespace they
expect (``init_app_state`` reads dozens of fields) and keeps vLLM's defaults and checks; we only
choose the few flags our settings control. The engine is built in a worker thread so the HTTP
server keeps answering (503 while starting, probes) during the tens of seconds loading takes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
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

from model.deployment import implementation, speculative
from model.deployment.resolve import (
    CPU_THREADS_BIND,
    FP8_MARLIN,
    V2_RUNNER,
    Deployment,
    DeploymentError,
    GpuFacts,
    resolve,
)
from model.runtime import envs

from .chat_features import ChatFeatures
from .chat_features import resolve as resolve_chat_features
from .child_environment import export
from .lifecycle import Lifecycle
from .settings import FIXES, ServiceSettings, SettingsError

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


def cli_args(
    settings: ServiceSettings,
    device: str,
    deployment: Deployment | None = None,
    features: ChatFeatures | None = None,
) -> list[str]:
    """The ``vllm serve`` flags equivalent to our settings, the resolved deployment, the chat
    features and the operator's extra engine flags (``QWEN4EXP_ENGINE_ARGS``, last)."""
    argv = [
        "--model", str(settings.model),
        "--served-model-name", settings.model_name,
        "--tensor-parallel-size", str(settings.tensor_parallel_size),
        "--dtype", settings.dtype,
        "--kv-cache-dtype", settings.kv_cache_dtype,
        "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
        # Hybrid align mode (GDN and PLE states saved per block, QSA pages hashed like any attention cache).
        "--enable-prefix-caching" if settings.prefix_caching else "--no-enable-prefix-caching",
        "--max-logprobs", str(settings.max_logprobs),
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
    ]  # fmt: skip
    if settings.max_model_len is not None:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if settings.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(settings.max_num_seqs)]
    if settings.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(settings.kv_cache_memory_bytes)]
    if settings.chat_template is not None:
        argv += ["--chat-template", str(settings.chat_template)]
    if settings.media_domains:
        argv += ["--allowed-media-domains", *settings.media_domains]
    if settings.otlp_traces_endpoint is not None:
        argv += ["--otlp-traces-endpoint", settings.otlp_traces_endpoint]
    if settings.log_format == "json":  # progress bars are not log lines
        argv.append("--no-use-tqdm-on-load")
    if settings.enforce_eager or device == "cpu":  # no CUDA graphs on CPU; compiling only costs start time
        argv.append("--enforce-eager")
    if deployment is not None:
        argv += deployment.engine_args()
    if features is not None:
        argv += features.cli_args()
    return argv + extra_engine_args(settings)


# vLLM parameters the service sets itself -> the variable to use instead. Also names the variable
# when vLLM rejects a value.
OWNED_PARAMS = {
    "model": "QWEN4EXP_MODEL",
    "model_tag": "QWEN4EXP_MODEL",
    "served_model_name": "QWEN4EXP_SERVED_MODEL_NAME",
    "tensor_parallel_size": "QWEN4EXP_TENSOR_PARALLEL_SIZE",
    "dtype": "QWEN4EXP_DTYPE",
    "kv_cache_dtype": "QWEN4EXP_KV_CACHE_DTYPE",
    "gpu_memory_utilization": "QWEN4EXP_GPU_MEMORY_UTILIZATION",
    "enable_prefix_caching": "QWEN4EXP_PREFIX_CACHING",
    "max_logprobs": "QWEN4EXP_MAX_LOGPROBS",
    "max_model_len": "QWEN4EXP_MAX_MODEL_LEN",
    "max_num_seqs": "QWEN4EXP_MAX_NUM_SEQS",
    "kv_cache_memory_bytes": "QWEN4EXP_KV_CACHE_MEMORY_BYTES",
    "speculative_config": "QWEN4EXP_SPECULATIVE",
    "enable_expert_parallel": "QWEN4EXP_EXPERT_PARALLEL",
    "chat_template": "QWEN4EXP_CHAT_TEMPLATE",
    "enforce_eager": "QWEN4EXP_ENFORCE_EAGER",
    "allowed_media_domains": "QWEN4EXP_ALLOWED_MEDIA_DOMAINS",
    "otlp_traces_endpoint": "QWEN4EXP_OTLP_TRACES_ENDPOINT",
    "additional_config": "the model's variables (the service writes vLLM's additional_config)",
    "engram_config": "VLLM_PLE_CPU_OFFLOAD",
    "enable_auto_tool_choice": "QWEN4EXP_TOOL_CALL_PARSER",
    "tool_call_parser": "QWEN4EXP_TOOL_CALL_PARSER",
    "reasoning_parser": "QWEN4EXP_REASONING_PARSER",
    "host": "QWEN4EXP_HOST",
    "port": "QWEN4EXP_PORT",
    "uds": "QWEN4EXP_HOST",
    "api_key": "QWEN4EXP_API_KEYS",
}


def extra_engine_args(settings: ServiceSettings) -> list[str]:
    """``QWEN4EXP_ENGINE_ARGS`` split as a shell would; :class:`SettingsError` for a flag the service
    sets itself (two sources for one value would leave one of them silently ignored) or one vLLM's
    parser does not know."""
    if not settings.engine_args:
        return []
    try:
        extra = shlex.split(settings.engine_args)
    except ValueError as exc:
        raise SettingsError(
            f"QWEN4EXP_ENGINE_ARGS={settings.engine_args!r}: {exc}; fix: quote it as a shell would"
        ) from None
    actions = make_arg_parser(FlexibleArgumentParser(prog="service"))._option_string_actions
    problems = []
    for token in extra:
        if not token.startswith("-"):
            continue
        flag = token.split("=", 1)[0]
        action = actions.get(flag) or actions.get(flag.replace("_", "-"))
        if action is None:
            problems.append(f"{flag} is not a vLLM engine flag")
        elif action.dest in OWNED_PARAMS:
            problems.append(f"{flag} is set by the service: use {OWNED_PARAMS[action.dest]}")
    if problems:
        raise SettingsError(
            f"QWEN4EXP_ENGINE_ARGS={settings.engine_args!r}: {'; '.join(problems)}; fix: {FIXES['engine_args']}"
        )
    return extra


def read_config(settings: ServiceSettings) -> dict | None:
    """config.json as transformers reads it, or None where it cannot be read here (vLLM's own
    config check then reports the model with its reason)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(settings.model)).to_dict()
    except Exception as exc:  # noqa: BLE001 - reported by vLLM's check with its own words
        log.warning("config.json of %s not readable here (%s)", settings.model, exc)
        return None


def gpu_facts(device: str) -> GpuFacts | None:
    """The GPU facts the deployment is resolved with, read before any CUDA kernel is imported."""
    import importlib.util

    if device != "cuda":
        return None
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    return GpuFacts(
        capability=None if cap is None else (int(cap.major), int(cap.minor)),
        has_cute_dsl=importlib.util.find_spec("cutlass") is not None,
    )


def memory_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is no such file)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resolve_deployment(settings: ServiceSettings, device: str) -> Deployment:
    """:func:`model.deployment.resolve.resolve` with this process's facts; logs the choice."""
    deployment = resolve(
        os.environ,
        cpu_build=implementation.vllm_is_cpu_build(),
        kv_cache_dtype=settings.kv_cache_dtype,
        config=read_config(settings) if device == "cuda" else None,
        gpu=gpu_facts(device),
        tensor_parallel_size=settings.tensor_parallel_size,
        cpus=tuple(sorted(os.sched_getaffinity(0))),
        memory_available=memory_available(),
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        has_mtp_weights=speculative.mtp_tensors_present(settings.model) if device == "cuda" else None,
    )
    log.log(
        logging.WARNING if deployment.speculative_declined else logging.INFO,
        "%s",
        deployment.speculative_note,
    )
    if deployment.expert_parallel_note:
        log.info("%s", deployment.expert_parallel_note)
    if deployment.cpu_threads_bind is not None or deployment.cpu_kv_cache_bytes is not None:
        log.info(
            "%d ranks on vLLM's CPU build: cores %s, %s bytes of KV cache each",
            deployment.tensor_parallel_size,
            deployment.cpu_threads_bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            deployment.cpu_kv_cache_bytes or "the given",
        )
    if device == "cuda" and deployment.requested_implementation == "auto":
        if deployment.upstream:
            log.info("QWEN4EXP_CUDA_MODEL=auto serves vLLM's own CUDA Qwen4-Exp through our subclass")
        else:
            log.warning(
                "QWEN4EXP_CUDA_MODEL=auto serves ours (vLLM's own CUDA Qwen4-Exp cannot serve this "
                "deployment): %s",
                "; ".join(deployment.implementation_reasons),
            )
    return deployment


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
    """vLLM's own parser and checks over the whole command line; what it refuses (it prints why)
    can only come from ``QWEN4EXP_ENGINE_ARGS``, since the service's own flags are well-formed."""
    parser = make_arg_parser(FlexibleArgumentParser(prog="service"))
    try:
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
    except SystemExit:
        raise SettingsError(
            "QWEN4EXP_ENGINE_ARGS: vLLM's parser refused the engine flags (its message is above); "
            f"fix: {FIXES['engine_args']}"
        ) from None
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
    "max_logprobs": "QWEN4EXP_MAX_LOGPROBS",
    "tool_call_parser": "QWEN4EXP_TOOL_CALL_PARSER",
    "reasoning_parser": "QWEN4EXP_REASONING_PARSER",
    "speculative_config": "QWEN4EXP_SPECULATIVE",
    # "collect_detailed_traces requires `--otlp-traces-endpoint` to be set" (QWEN4EXP_ENGINE_ARGS'
    # --collect-detailed-traces without an endpoint).
    "collect_detailed_traces": "QWEN4EXP_OTLP_TRACES_ENDPOINT",
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


def upstream_choice_problems(vllm_config: VllmConfig, deployment: Deployment) -> list[str]:
    """When vLLM's own CUDA Qwen4-Exp is to serve: why it cannot serve this deployment, one line
    per reason (none otherwise). Checked here with vLLM's resolved configuration, so that start-up
    stops in a second instead of at model construction in the worker (which checks again)."""
    if not deployment.upstream:
        return []
    found = implementation.upstream_problems(vllm_config, cpu_build=deployment.device == "cpu")
    label = f"{envs.CUDA_MODEL}={deployment.requested_implementation}"
    if deployment.requested_implementation == "auto":
        label += " (upstream on CUDA)"
    return [f"{label}: {problem}" for problem in found]


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


def tracing_problem(settings: ServiceSettings) -> str | None:
    """With ``QWEN4EXP_OTLP_TRACES_ENDPOINT`` set, the OpenTelemetry packages vLLM's tracing module
    imports (API, SDK, the gRPC and HTTP OTLP exporters) must import here; vLLM would otherwise
    refuse the flag with a traceback, or (in a worker) trace nothing without a word. Fail closed."""
    if settings.otlp_traces_endpoint is None:
        return None
    from vllm.tracing import otel

    if otel.is_otel_available():
        return None
    lines = (otel.otel_import_error_traceback or "").strip().splitlines()
    reason = lines[-1] if lines else "not importable"
    return (
        f"QWEN4EXP_OTLP_TRACES_ENDPOINT={settings.otlp_traces_endpoint!r}: the OpenTelemetry packages vLLM "
        f"exports traces with are missing ({reason}); fix: install opentelemetry-sdk and "
        "opentelemetry-exporter-otlp (vLLM's own dependencies, in the image), or unset "
        "QWEN4EXP_OTLP_TRACES_ENDPOINT"
    )


def configure_engine(settings: ServiceSettings) -> tuple[str, VllmConfig, Namespace, Deployment]:
    """Device, vLLM config, vLLM args and the resolved deployment; every problem found is
    reported together. The variables vLLM's processes need from the environment are exported
    (:mod:`service.child_environment`) before vLLM builds its configuration, which reads some of them."""
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
    if (missing_tracing := tracing_problem(settings)) is not None:
        # Now: vLLM's own check of the flag would add its traceback as a second, vaguer message.
        raise SettingsError("\n".join([*problems, missing_tracing]))
    try:
        deployment = resolve_deployment(settings, device)
    except DeploymentError as exc:
        raise SettingsError("\n".join([*problems, str(exc)])) from None
    features, feature_problems = resolve_chat_features(settings)
    problems += feature_problems
    try:
        argv = cli_args(settings, device, deployment, features)
    except SettingsError as exc:
        raise SettingsError("\n".join([*problems, str(exc)])) from None
    export(deployment.child_environment(), keep_operator_values=(V2_RUNNER, FP8_MARLIN, CPU_THREADS_BIND))
    for note in features.notes:
        log.info("%s", note)
    log.info("vLLM engine flags: %s", shlex.join(argv))
    args = parse_args(argv)
    try:
        vllm_config = engine_config(args)
    except SettingsError as exc:
        problems.append(str(exc))
    else:
        problems += upstream_choice_problems(vllm_config, deployment)
    if problems:
        raise SettingsError("\n".join(problems))
    return device, vllm_config, args, deployment


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
