"""Service configuration: environment variables only, validated before anything heavy is imported.

Two groups: ``QWEN4EXP_*`` configures this front end and the engine it starts (pydantic-settings
below); the model's own variables (``VLLM_QSA_*``, ``VLLM_PLE_*`` and the engine guard's) are
declared in ``model.runtime.envs`` and read by the model code in the worker processes (which inherit the
environment). Here they are validated with that module's own parsers and checks, early, so a bad
value fails in a second with the same message the worker would give, instead of minutes later.
This module must not import vLLM or prometheus_client: the entry point validates first and exits
fast on a bad value.

``python -m service.settings`` prints the variable table (markdown) for the README.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from model.runtime import envs

from .media_urls import parse_domains

PREFIX = "QWEN4EXP_"

# How to fix a bad value, by field; shown next to pydantic's description of what is wrong.
FIXES: dict[str, str] = {
    "model": "point it at a checkpoint directory that contains config.json",
    "served_model_name": "use a non-empty name without whitespace",
    "device": "use auto, cpu or cuda (cuda needs the CUDA image and a visible GPU)",
    "tensor_parallel_size": "use a positive integer (the number of GPUs), e.g. 4",
    "dtype": "use auto, bfloat16, float16 or float32",
    "kv_cache_dtype": "use auto, the model dtype (bfloat16/float16), fp8 or fp8_e4m3",
    "max_model_len": "use a positive integer number of tokens, or leave it unset for the model's maximum",
    "gpu_memory_utilization": "use a fraction in (0, 1], e.g. 0.9",
    "enforce_eager": "use true or false",
    "max_num_seqs": "use a positive integer, or leave it unset for vLLM's default",
    "kv_cache_memory_bytes": "use a positive integer number of bytes, or leave it unset for vLLM's sizing",
    "prefix_caching": "use true or false",
    "host": "use an address to bind, e.g. 0.0.0.0 or 127.0.0.1",
    "port": "use an integer port in 1..65535",
    "auth": "use on or off (true/false)",
    "api_keys": "use a comma-separated list of keys without whitespace",
    "api_keys_file": "mount a readable file with one key per line",
    "metrics_open": "use true or false",
    "max_concurrent_requests": "use a positive integer",
    "max_queued_requests": "use an integer >= 0",
    "retry_after_seconds": "use a positive integer number of seconds",
    "max_body_bytes": "use an integer >= 1024",
    "max_header_bytes": "use an integer >= 4096",
    "drain_seconds": "use a number of seconds >= 0",
    "ready_max_age_seconds": "use a positive number of seconds",
    "ready_timeout_seconds": "use a positive number of seconds",
    "body_timeout_seconds": "use a positive number of seconds",
    "request_timeout_seconds": "use a positive number of seconds",
    "chat_template": "point it at a readable Jinja template file, or leave it unset",
    "tool_call_parser": "use auto, none or a vLLM tool-call parser name (e.g. hermes, qwen3_coder, qwen3_xml)",
    "reasoning_parser": "use auto, none or a vLLM reasoning parser name (e.g. qwen3)",
    "max_logprobs": "use an integer >= 0",
    "responses_store": "use true or false",
    "engine_args": "use vLLM flags, shell-quoted, that the service does not set itself",
    "max_n": "use a positive integer",
    "max_prompts_per_request": "use a positive integer",
    "max_stop_sequences": "use an integer >= 0",
    "max_logit_bias_entries": "use an integer >= 0",
    "max_tools": "use an integer >= 0",
    "max_tool_schema_bytes": "use an integer >= 256",
    "allowed_media_domains": "use comma-separated host names (e.g. images.example.com), or leave it unset",
    "log_level": "use debug, info, warning or error",
    "log_format": "use text or json",
    "access_log": "use true or false",
    "otlp_traces_endpoint": "use the collector's URL, http(s)://host:port (gRPC, the default) or "
    "http(s)://host:port/v1/traces (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), credentials in "
    "OTEL_EXPORTER_OTLP_HEADERS, not the URL; or leave it unset for no traces",
}


class ServiceSettings(BaseSettings):
    """The front end's settings (``QWEN4EXP_<FIELD>``)."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, extra="ignore", case_sensitive=False, env_ignore_empty=True
    )

    model: Path = Field(description="Checkpoint directory to serve (required).")
    served_model_name: str | None = Field(
        None, description="Model name clients send and `/v1/models` lists; default: the directory name."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="`auto` uses the platform of the installed vLLM build; `cpu` or `cuda` must match it.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks (GPUs), e.g. 4. On vLLM's CPU build one worker process per rank, "
        "each on its own cores, with half the available memory for the KV caches unless sized.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weight/activation dtype; `auto` takes it from config.json."
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="KV-cache dtype: `auto`/the model dtype, or `fp8` (= `fp8_e4m3`) for the QSA layers.",
    )
    max_model_len: int | None = Field(None, ge=1, description="Context length limit; default: the model's.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may use (ignored on CPU)."
    )
    enforce_eager: bool = Field(
        False, description="Disable CUDA graphs/compilation (always on for CPU; needed for KV calibration)."
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="Engine batch size (sequences per step); default: vLLM's."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="KV-cache size in bytes (vLLM's `--kv-cache-memory-bytes`); default: vLLM's sizing "
        "(GPU: `QWEN4EXP_GPU_MEMORY_UTILIZATION`). On CPU it cannot be combined with `VLLM_CPU_KVCACHE_SPACE`.",
    )
    prefix_caching: bool = Field(
        True,
        description="Reuse the cache of a repeated prompt prefix (vLLM prefix caching, hybrid `align` "
        "mode; vLLM's own default). Cache hits give a cold engine's tokens: tested on vLLM's CPU build "
        "and on CUDA, eager and with CUDA graphs. false saves the per-block GDN/PLE states it keeps.",
    )
    host: str = Field(
        "0.0.0.0", min_length=1, description="Address to listen on (`scripts/serve.sh` uses 127.0.0.1)."
    )
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")
    auth: bool = Field(
        True,
        description="Require a bearer key on the API. On (the default), start-up fails unless "
        "`QWEN4EXP_API_KEYS` or `QWEN4EXP_API_KEYS_FILE` holds a key (an empty value counts as unset). "
        "`off` serves without keys (warned at start-up): only on loopback or a network you trust; "
        "`scripts/serve.sh` sets it for the local quick start.",
    )
    api_keys: str | None = Field(
        None,
        description="Comma-separated bearer keys (or the file below; both may be set).",
    )
    api_keys_file: Path | None = Field(
        None,
        description="File with one key per line (`#` comments), e.g. a mounted secret; re-read when it "
        "changes (no restart). Set but holding no key (and no `QWEN4EXP_API_KEYS`): start-up fails.",
    )
    metrics_open: bool = Field(False, description="Serve `/metrics` without a key.")
    max_concurrent_requests: int = Field(
        32,
        ge=1,
        description="Sequences handed to the engine at once (a request counts `n` x its prompts, "
        "at most this many).",
    )
    max_queued_requests: int = Field(
        64, ge=0, description="Sequences waiting for a slot; beyond running + queued: 429."
    )
    retry_after_seconds: int = Field(1, ge=1, description="`Retry-After` sent with 429 and 503.")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body; larger: 413.")
    max_header_bytes: int = Field(
        64 * 1024,
        ge=4096,
        description="Largest request line and headers together; larger: 400 and the connection closed. "
        "Bounds what one connection can make the server hold before a request starts (the HTTP parser "
        "is h11 for this; slow senders are the TLS proxy's to cut, see docs/deployment.md).",
    )
    drain_seconds: float = Field(
        30.0, ge=0, description="After SIGTERM, how long in-flight requests may run before exit (0)."
    )
    ready_max_age_seconds: float = Field(
        30.0,
        gt=0,
        description="`/ready` needs engine progress (a finished generation or a step that processed "
        "tokens) within this age; when idle it runs a 1-token probe generation.",
    )
    ready_timeout_seconds: float = Field(10.0, gt=0, description="Time limit of `/ready`'s probe generation.")
    body_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="Time a client has to send its whole request body; slower (a trickled body): 408.",
    )
    request_timeout_seconds: float = Field(
        1800.0,
        gt=0,
        description="Longest a generation request may run once admitted (a stream read slowly included); "
        "then its engine request is aborted and it ends with a `request_timeout` error (408, or a "
        "last SSE event when streaming).",
    )
    chat_template: Path | None = Field(None, description="Jinja chat template overriding the checkpoint's.")
    tool_call_parser: str = Field(
        "auto",
        min_length=1,
        description="vLLM tool-call parser for `tools` in chat requests: `auto` picks it from the chat "
        "template (`<tool_call>` JSON: `hermes`; `<function=...>` XML: `qwen3_coder`), `none` turns "
        "tool calls off (requests with `tools` get a 400), or any parser name vLLM lists.",
    )
    reasoning_parser: str = Field(
        "auto",
        min_length=1,
        description="vLLM reasoning parser splitting the thinking block into `reasoning_content`: "
        "`auto` takes `qwen3` where the chat template has a `<think>` block, `none` leaves it in "
        "`content`, or any parser name vLLM lists.",
    )
    max_logprobs: int = Field(20, ge=0, description="Most `logprobs`/`top_logprobs` a request may ask for.")
    responses_store: bool = Field(
        False,
        description="Keep Responses API answers so that `GET /v1/responses/{id}`, cancel and `background` "
        "requests work. vLLM keeps every stored response in the service's memory until it stops (no "
        "eviction): leave off on a long-running shared server, where a retrieve then answers 404.",
    )
    engine_args: str | None = Field(
        None,
        description="Extra vLLM engine flags, shell-quoted, e.g. `--max-num-batched-tokens 4096 "
        "--scheduling-policy priority`; parsed by vLLM's own parser at start-up. Flags the service sets "
        "from its own settings are refused (use those settings).",
    )
    # Per-request caps, checked before the engine sees a request (400 naming the limit).
    max_n: int = Field(16, ge=1, description="Most completions one request may ask for (`n`, `best_of`).")
    max_prompts_per_request: int = Field(64, ge=1, description="Most prompts in one `/v1/completions` list.")
    max_stop_sequences: int = Field(16, ge=0, description="Most `stop` strings in one request.")
    max_logit_bias_entries: int = Field(300, ge=0, description="Most `logit_bias` entries in one request.")
    max_tools: int = Field(128, ge=0, description="Most `tools` in one chat request.")
    max_tool_schema_bytes: int = Field(
        65536, ge=256, description="Largest JSON size of one request's `tools` and `response_format` schemas."
    )
    allowed_media_domains: str | None = Field(
        None,
        description="Hosts the engine may fetch media URLs from (image, video, audio parts), comma-separated; "
        "also passed to vLLM as `--allowed-media-domains`. Unset: every remote media URL gets a 400 "
        "before the engine sees it (inline `data:` URLs pass), so no client can make the server "
        "request an internal address.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="`text`: `time LEVEL logger: message` lines; `json`: one JSON object per line (`time`, "
        "`level`, `logger`, `message`, `pid`, the access fields), for the service's lines and vLLM's in "
        "every process it starts (through `VLLM_LOGGING_CONFIG_PATH` unless that is set already).",
    )
    access_log: bool = Field(
        True,
        description="One info line (logger `service.access`, stderr) per HTTP request once its response has "
        "ended (streams when they end): method, path (query: parameter names only), status, `duration_ms`, "
        "body `bytes`, `client`, `request_id` (the client's `X-Request-Id`); never a header or key. "
        "Successful `/health`, `/ready`, `/get_load`, `/metrics` polls are logged at debug. Written "
        "whatever the log level.",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector vLLM sends traces to (vLLM's `--otlp-traces-endpoint`): a "
        "span per finished generation request (`llm_request`, with a client's `traceparent` as parent) "
        "and the engine's start-up spans. gRPC by default (`http://collector:4317`; `https://` for TLS); "
        "with `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` the full URL "
        "(`http://collector:4318/v1/traces`). The other `OTEL_*` variables (`OTEL_SERVICE_NAME`, "
        "`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_TRACES_SAMPLER`, ...) are read by the OpenTelemetry SDK. "
        "Unset: no traces.",
    )

    @field_validator(
        "device",
        "dtype",
        "kv_cache_dtype",
        "log_level",
        "log_format",
        "tool_call_parser",
        "reasoning_parser",
        mode="before",
    )
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("model")
    @classmethod
    def _checkpoint_dir(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(f"{value} is not a directory")
        if not (value / "config.json").is_file():
            raise ValueError(f"{value} has no config.json")
        return value.resolve()

    @field_validator("served_model_name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or any(c.isspace() for c in value)):
            raise ValueError(f"{value!r} is empty or contains whitespace")
        return value

    @field_validator("allowed_media_domains")
    @classmethod
    def _media_domains(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return ",".join(parse_domains(value)) or None

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        return None if value is None else check_otlp_url(value)

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, value: str | None) -> str | None:
        if value is not None and any(any(c.isspace() for c in k.strip()) for k in value.split(",")):
            raise ValueError("a key contains whitespace")
        return value

    @field_validator("api_keys_file", "chat_template")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None:
            require_readable_file(value)
        return value

    @property
    def media_domains(self) -> tuple[str, ...]:
        """The hosts of ``QWEN4EXP_ALLOWED_MEDIA_DOMAINS`` (validated and normalised above)."""
        return tuple(self.allowed_media_domains.split(",")) if self.allowed_media_domains else ()

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name

    def variable_keys(self) -> list[str]:
        """The keys of ``QWEN4EXP_API_KEYS`` (fixed for the life of the process)."""
        return [k.strip() for k in (self.api_keys or "").split(",") if k.strip()]

    def keys(self) -> list[str]:
        """Every configured API key: the variable's and the file's (as the file is now)."""
        file_keys = read_keys_file(self.api_keys_file) if self.api_keys_file is not None else []
        return self.variable_keys() + file_keys

    @property
    def auth_configured(self) -> bool:
        """A key source is configured: from then on auth never turns itself off (fail closed)."""
        return self.api_keys is not None or self.api_keys_file is not None


OTLP_TRACES_PROTOCOLS = ("grpc", "http/protobuf")  # what vLLM's tracing module accepts (vllm/tracing/otel.py)


def check_otlp_url(value: str) -> str:
    """``value`` if it is an OTLP collector URL the exporters take; ``ValueError`` saying why not.
    Credentials and query strings are refused: the URL is logged with the engine flags."""
    url = value.strip()
    if not url or any(c.isspace() or ord(c) < 0x20 for c in url):
        raise ValueError("empty or contains whitespace")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"scheme {parts.scheme or '(none)'!r} is not http or https")
    if not parts.hostname:
        raise ValueError("no host")
    try:
        port = parts.port  # None without one; raises for one that is not a number in 0..65535
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError("the port is not a number in 1..65535")
    if parts.username is not None or parts.password is not None:
        raise ValueError("credentials in the URL (they would be logged)")
    if parts.query or parts.fragment:
        raise ValueError("a query string or fragment")
    return url


def otlp_protocol_problem(endpoint: str | None, env: Mapping[str, str]) -> str | None:
    """vLLM picks its span exporter by ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (default grpc) and raises
    while the engine starts on any other value; say so at start-up instead."""
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    if endpoint is None or protocol is None or protocol in OTLP_TRACES_PROTOCOLS:
        return None
    return (
        f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: vLLM exports traces over grpc or http/protobuf only; "
        "fix: set grpc or http/protobuf, or unset it (grpc)"
    )


def read_keys_file(path: Path) -> list[str]:
    """One key per line; blank lines and ``#`` comments skipped; ``OSError`` if unreadable."""
    keys = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


def require_readable_file(path: Path) -> None:
    if (why := envs.readable_file_problem(path)) is not None:
        raise ValueError(why)


class SettingsError(Exception):
    """A configuration problem; ``str()`` is the operator-facing message, one line per problem."""


def _env_name(field: str) -> str:
    return PREFIX + field.upper()


def _describe(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        name = _env_name(field)
        raw = _lookup_ci(name)
        got = f"={raw!r}" if raw is not None else " (not set)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "is required"
        fix = FIXES.get(field, "see the README's configuration table")
        lines.append(f"{name}{got}: {msg}; fix: {fix}")
    return lines


def _lookup_ci(name: str) -> str | None:
    for key, value in os.environ.items():
        if key.upper() == name:
            return value
    return None


def field_value(field: str, env: Mapping[str, str]) -> Any:
    """``QWEN4EXP_<FIELD>`` in ``env``, validated exactly as :class:`ServiceSettings` validates that
    field (type, constraints, its validators); unset or empty: the field's default. For code that
    needs a few values without the whole configuration (the preflight), so that a value cannot mean
    one thing there and another to the service. ``SettingsError`` names the variable and the fix."""
    info = ServiceSettings.model_fields[field]
    name = _env_name(field)
    raw = next((v for k, v in env.items() if k.upper() == name), None)
    if raw is None or raw == "":
        if info.is_required():
            raise SettingsError(f"{name} (not set): is required; fix: {FIXES[field]}")
        return info.get_default(call_default_factory=True)
    try:
        # The model's validator on one field of an unvalidated instance: no other field is read.
        checked = ServiceSettings.__pydantic_validator__.validate_assignment(
            ServiceSettings.model_construct(), field, raw
        )
    except ValidationError as exc:
        why = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise SettingsError(f"{name}={raw!r}: {why}; fix: {FIXES[field]}") from None
    return getattr(checked, field)


def unknown_prefixed_variables() -> list[str]:
    """``QWEN4EXP_*`` variables that configure nothing (typos); reported as a warning."""
    known = {PREFIX + f.upper() for f in ServiceSettings.model_fields} | set(envs.BY_NAME)
    ignored = {"QWEN4EXP_TEST_CHECKPOINTS"}  # read by the test suite, not by the service
    return sorted(k for k in os.environ if k.upper().startswith(PREFIX) and k.upper() not in known | ignored)


def load() -> tuple[ServiceSettings, SimpleNamespace]:
    """Read and validate every variable; raise ``SettingsError`` listing all problems at once.

    The second value holds the model's variables by name, parsed by ``model.runtime.envs`` (defaults
    filled in), exactly as the worker processes will read them.
    """
    problems: list[str] = []
    service = None
    try:
        service = ServiceSettings()  # type: ignore[call-arg]
    except ValidationError as exc:
        problems += _describe(exc)
    model_env, model_problems = envs.validate()
    problems += model_problems
    if service is not None:
        problems += _auth_problems(service)
        if (protocol_problem := otlp_protocol_problem(service.otlp_traces_endpoint, os.environ)) is not None:
            problems.append(protocol_problem)
        try:
            if service.auth_configured and not service.keys():
                # Fail closed: an empty secret (a failed mount, a truncated write) must not open the API.
                sources = [
                    f"{_env_name(f)}={str(v)!r}"
                    for f, v in (("api_keys_file", service.api_keys_file), ("api_keys", service.api_keys))
                    if v is not None
                ]
                problems.append(
                    f"{' and '.join(sources)}: no API key (an empty file or only comments); auth is "
                    "configured, so it does not turn itself off; fix: write one key per line (bash "
                    f"deploy/init-secrets.sh), or unset {PREFIX}API_KEYS_FILE and {PREFIX}API_KEYS and set "
                    f"{PREFIX}AUTH=off to run without auth"
                )
        except OSError as exc:
            problems.append(f"{PREFIX}API_KEYS_FILE: cannot read it ({exc}); fix: {FIXES['api_keys_file']}")
        except UnicodeDecodeError as exc:
            problems.append(
                f"{PREFIX}API_KEYS_FILE={str(service.api_keys_file)!r}: not UTF-8 text ({exc.reason} at byte "
                f"{exc.start}); fix: write the keys as plain text, one per line"
            )
    if problems:
        raise SettingsError("\n".join(problems))
    assert service is not None
    return service, model_env


def _auth_problems(service: ServiceSettings) -> list[str]:
    """Auth is on unless switched off by name: a deployment that forgot its keys (or mounted an
    empty variable) must not open the API on every interface."""
    if service.auth and not service.auth_configured:
        return [
            f"{PREFIX}API_KEYS and {PREFIX}API_KEYS_FILE are unset or empty, and {PREFIX}AUTH is on: "
            f"no API key to check; fix: set one of them (bash deploy/init-secrets.sh writes a keys file), "
            f"or set {PREFIX}AUTH=off to serve without keys on a network you trust"
        ]
    if not service.auth and service.auth_configured:
        return [
            f"{PREFIX}AUTH=off, but API keys are configured ({PREFIX}API_KEYS / {PREFIX}API_KEYS_FILE); "
            f"fix: unset {PREFIX}AUTH to check the keys, or unset the keys to serve without them"
        ]
    return []


def markdown_table() -> str:
    """The README table: one row per variable, generated from the fields so it cannot drift."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for name, field in ServiceSettings.model_fields.items():
        if field.is_required():
            default = "required"
        elif field.default is None:
            default = "unset"
        else:
            default = f"`{str(field.default).lower() if isinstance(field.default, bool) else field.default}`"
        rows.append(f"| `{_env_name(name)}` | {default} | {field.description} |")
    return "\n".join(rows + envs.markdown_rows())


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
