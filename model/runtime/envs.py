"""Every environment variable the model code reads: name, parser, default and documentation.

Why one module: the variables used to be parsed in three places with three boolean parsers that
disagreed (the service refused a missing ``VLLM_QSA_KV_COLLECT`` directory that the model would
have created). Now the model reads each variable through :func:`read`, the service validates the
same declarations at start-up through :func:`validate`, and the README's table is generated from
:data:`VARIABLES` (``python -m service.settings``), so parsing, checks and docs cannot drift.

Two stages, on purpose:

* ``parse``: the form of the value (a boolean, positive seconds, a token id, a path). Done every
  time the model reads a variable.
* ``check``: what the value points at (a readable file, a creatable directory). The service runs
  it at start-up so a typo fails in a second; the model runs the same check right before it uses
  the path (:func:`prepare_collect_dir`), so both refuse the same values with the same message.

``VLLM_QSA_KV_COLLECT``: a missing directory is created (by the worker; the service only checks
that it can be created: its nearest existing ancestor is a writable directory). An uncreatable
or unwritable one is refused by both with the message of :func:`collect_dir_problem`.

This module imports only the standard library: the service imports it before vLLM or torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A malformed model environment variable; the message starts with ``NAME=value``."""


@dataclass(frozen=True)
class EnvVar:
    """One variable: ``parse(name, raw)`` turns a non-empty raw string into a value or raises
    :class:`EnvError`; ``check(name, value)`` returns a problem text or None (service start-up)."""

    name: str
    parse: Callable[[str, str], Any]
    default: Any
    default_doc: str  # the README's "Default" cell
    doc: str  # the README's "Meaning" cell
    fix: str  # how to fix a bad value, shown after the problem
    check: Callable[[Any], str | None] | None = None


# ---- parsers ------------------------------------------------------------------------------------


def parse_flag(name: str, raw: str) -> bool:
    """1/0, true/false, yes/no, on/off (any case). Strict on purpose: ``VLLM_PLE_CPU_OFFLOAD=of``
    must stop start-up rather than silently pick a mode that needs tens of GiB more GPU memory."""
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise EnvError(
        f"{name}={raw!r} is not a valid value: use 1/0 (also true/false, yes/no, on/off), "
        "or leave it unset for the default"
    )


def parse_positive_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise EnvError(f"{name}={raw!r}: must be a number of seconds (e.g. 10 or 0.5)") from None
    if not math.isfinite(value) or value <= 0:
        raise EnvError(f"{name}={raw!r}: must be a finite number of seconds > 0")
    return value


def choice_parser(choices: tuple[str, ...], hint: str) -> Callable[[str, str], str]:
    """A parser for one of ``choices`` (any case, surrounding blanks ignored); ``hint`` ends the error."""

    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in choices:
            raise EnvError(f"{name}={raw!r} is not a valid value: {hint}")
        return v

    return parse


CUDA_MODEL_CHOICES = ("auto", "ours", "upstream")
parse_selection = choice_parser(("loop", "batched"), "use loop or batched, or leave it unset")
parse_cuda_model = choice_parser(
    CUDA_MODEL_CHOICES,
    "use auto (ours on vLLM's CPU build, upstream on CUDA), ours (this plugin's implementation) or "
    "upstream (vLLM's own CUDA qwen4_exp through our subclass), or leave it unset for auto",
)


SPECULATIVE_CHOICES = ("auto", "off", "ngram", "mtp")
parse_speculative = choice_parser(
    SPECULATIVE_CHOICES,
    "use auto (MTP where the checkpoint has MTP layers, else off), off, ngram or mtp, or leave it unset",
)
MAX_SPECULATIVE_TOKENS = 8


def parse_expert_parallel(name: str, raw: str) -> str:
    """``auto``, or a flag's spellings turned into ``on`` / ``off``."""
    v = raw.strip().lower()
    if v == "auto":
        return v
    if v in _TRUE or v in _FALSE:
        return "on" if v in _TRUE else "off"
    raise EnvError(f"{name}={raw!r} is not a valid value: use auto, on or off (true/false, 1/0)")


def parse_draft_tokens(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SPECULATIVE_TOKENS:
        raise EnvError(
            f"{name}={raw!r}: must be a whole number of draft tokens from 1 to {MAX_SPECULATIVE_TOKENS}"
        )
    return value


def parse_ngram_window(name: str, raw: str) -> tuple[int, int]:
    """``MIN-MAX``: the shortest and longest n-gram a prompt-lookup draft matches (1 <= MIN <= MAX <= 16)."""
    lo, sep, hi = raw.strip().partition("-")
    try:
        window = (int(lo), int(hi)) if sep else (0, 0)
    except ValueError:
        window = (0, 0)
    if not 1 <= window[0] <= window[1] <= 16:
        raise EnvError(f"{name}={raw!r}: must be MIN-MAX with 1 <= MIN <= MAX <= 16, e.g. 2-4")
    return window


def parse_path(name: str, raw: str) -> Path:
    return Path(raw.strip())


def parse_token_id(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise EnvError(f"{name}={raw!r}: must be a token id (an integer >= 0)") from None
    if value < 0:
        raise EnvError(f"{name}={raw!r}: must be a token id (an integer >= 0)")
    return value


# ---- checks (what a path points at) -------------------------------------------------------------


def readable_file_problem(path: Path) -> str | None:
    if not path.is_file():
        return f"{path} is not an existing file"
    if not os.access(path, os.R_OK):
        return f"{path} is not readable"
    return None


def collect_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be the calibration directory, or None (it exists writable, or can be
    created: its nearest existing ancestor is a writable directory). Creates nothing."""
    if path.exists():
        if not path.is_dir():
            return f"cannot create directory: {path} exists and is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"directory {path} is not writable"
        return None
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot create directory: {ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create directory: {ancestor} is not writable"
    return None


# ---- the variables -------------------------------------------------------------------------------

QSA_KV_SCALES = "VLLM_QSA_KV_SCALES"
QSA_KV_SCALES_STRICT = "VLLM_QSA_KV_SCALES_STRICT"
QSA_KV_COLLECT = "VLLM_QSA_KV_COLLECT"
QSA_KV_COLLECT_INTERVAL = "VLLM_QSA_KV_COLLECT_INTERVAL"
QSA_KV_CLIP_COUNT = "VLLM_QSA_KV_CLIP_COUNT"
PLE_CPU_OFFLOAD = "VLLM_PLE_CPU_OFFLOAD"
PLE_PREFETCH = "VLLM_PLE_PREFETCH"
ENGINE_FATAL_FILE = "QWEN4EXP_ENGINE_FATAL_FILE"
FAULT_INJECT_TOKEN = "QWEN4EXP_FAULT_INJECT_TOKEN"
FAULT_INJECT_FATAL_TOKEN = "QWEN4EXP_FAULT_INJECT_FATAL_TOKEN"
QSA_SELECTION = "QWEN4EXP_QSA_SELECTION"
CUDA_MODEL = "QWEN4EXP_CUDA_MODEL"
GDN_SHORT_PREFILL = "QWEN4EXP_GDN_SHORT_PREFILL"
HC_REFERENCE_ROUNDING = "QWEN4EXP_HC_REFERENCE_ROUNDING"
SEPARATE_INDEXER_PROJECTION = "QWEN4EXP_SEPARATE_INDEXER_PROJECTION"
SPECULATIVE = "QWEN4EXP_SPECULATIVE"
SPECULATIVE_TOKENS = "QWEN4EXP_SPECULATIVE_TOKENS"
NGRAM_WINDOW = "QWEN4EXP_NGRAM_WINDOW"
FORCE_SM86 = "QWEN4EXP_FORCE_SM86"
EXPERT_PARALLEL = "QWEN4EXP_EXPERT_PARALLEL"

DEFAULT_COLLECT_INTERVAL_S = 30.0

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        QSA_KV_SCALES,
        parse_path,
        None,
        "unset",
        "JSON sidecar of static per-layer FP8 K/V scales; FP8 cache only (with a BF16 cache start-up "
        "fails). Invalid content stops start-up naming the file, layer and field. An FP8 cache without "
        'it runs at scale 1.0 with an "UNCALIBRATED FP8 KV CACHE" warning per layer.',
        "point it at a readable KV-scales file, or unset it",
        readable_file_problem,
    ),
    EnvVar(
        QSA_KV_SCALES_STRICT,
        parse_flag,
        True,
        "`1`",
        "`1`: every QSA layer of the whole model must be in the sidecar (also layers another pipeline "
        "stage owns). `0`: missing layers run at 1.0 with a warning. Unknown layers are always an error.",
        "use 1 or 0 (true/false, yes/no, on/off), or unset it",
    ),
    EnvVar(
        QSA_KV_COLLECT,
        parse_path,
        None,
        "unset",
        "Calibration directory (created if missing): running absmax of pre-quantisation K and V per "
        "layer on the device, dumped as `qsa_kv_absmax_dp<d>_pp<p>_tp<t>.json` periodically and at "
        "exit (atomic). Needs eager mode, else start-up fails.",
        "point it at a writable directory (or one that can be created), or unset it",
        collect_dir_problem,
    ),
    EnvVar(
        QSA_KV_COLLECT_INTERVAL,
        parse_positive_seconds,
        DEFAULT_COLLECT_INTERVAL_S,
        "`30`",
        "Seconds between calibration dumps (> 0).",
        "use a positive number of seconds, or unset it",
    ),
    EnvVar(
        QSA_KV_CLIP_COUNT,
        parse_positive_seconds,
        None,
        "unset",
        "Seconds between reads of the device-side FP8 clip counters (FP8 cache only); warns on new "
        "clips, heartbeat at most once a minute, feeds `qwen4exp_qsa_kv_clipped_total`.",
        "use a positive number of seconds, or unset it",
    ),
    EnvVar(
        PLE_CPU_OFFLOAD,
        parse_flag,
        True,
        "`1`",
        "`1`: each rank's PLE rows sit in page-locked host memory and the GPU gathers them through "
        "unified addressing with the Triton kernel; start-up fails (naming `VLLM_PLE_CPU_OFFLOAD=0` and "
        "the GPU memory needed) if the GPU cannot read pinned memory. `0`: tables in GPU memory. On "
        "vLLM's CPU build both keep the tables in RAM with the torch path (only the `mode` metric label "
        "changes). Accepts 1/0, true/false, yes/no, on/off.",
        "use 1 or 0 (true/false, yes/no, on/off), or unset it",
    ),
    EnvVar(
        PLE_PREFETCH,
        parse_flag,
        None,
        "`1` with CUDA, `0` on CPU",
        "`1`: every PLE layer's rows are hashed at the start of the forward and each layer's gather "
        "starts on a side stream just before the preceding decoder layer; buffers are reserved at model "
        "construction, before graph capture.",
        "use 1 or 0 (true/false, yes/no, on/off), or unset it",
    ),
    EnvVar(
        QSA_SELECTION,
        parse_selection,
        None,
        "`batched` with CUDA, `loop` on CPU",
        "How the QSA indexer picks key blocks. `batched`: one masked score matmul and one top-k per "
        "chunk of queries, no host sync. `loop`: one query at a time in transformers' operation order "
        "(exact tie-breaking; the CPU parity reference). Same selection on tie-free scores; for "
        "benchmarks and diagnosis.",
        "use loop or batched, or unset it",
    ),
    EnvVar(
        CUDA_MODEL,
        parse_cuda_model,
        "auto",
        "`auto`",
        "Which Qwen4-Exp implementation serves. `auto`: ours on vLLM's CPU build (the only one there); "
        "on CUDA `upstream` (measured 7-16x faster on an H200) unless it cannot serve this checkpoint "
        "on these GPUs (a QSA top-k other than 512/1024/2048 blocks, an index-head shape no indexer "
        "tile fits, an unsupported cache dtype), then ours; the service decides at start-up from "
        "config.json and the GPU, logs why, and labels `qwen4exp_service_info{model_impl}`. "
        "`upstream`: vLLM's own CUDA `qwen4_exp` through our subclass, which adds the 3090's parts (FP8 "
        "E4M3 KV read and written by our code, the scale sidecar, calibration, clip counters, our "
        "FP8/NVFP4 PLE tables, an indexer prefill tile sized for the GPU, a null `output_gate_type` "
        "read as `hidden_act`) and stops start-up, listing every reason, where upstream cannot serve. "
        "`ours`: this plugin's model on CUDA too (V1 runner, no CUDA graphs; any checkpoint shape). "
        "The service sets `VLLM_USE_V2_MODEL_RUNNER` to match on CUDA unless you set it.",
        "use auto, ours or upstream, or unset it (auto)",
    ),
    EnvVar(
        GDN_SHORT_PREFILL,
        parse_flag,
        True,
        "`1`",
        "With upstream on CUDA and Triton GDN prefill (the RTX 3090's path), GDN prefills shorter "
        "than one FLA chunk (63 tokens, e.g. what a prefix-cache hit leaves to compute) run FLA's "
        "fused recurrent kernel, one launch a layer instead of about eight "
        "(`model/upstream/gdn.py`); on the H200 a cache hit's step fell from 71-81 ms to "
        "33-50 ms, with upstream's prefix-cache parity unchanged. `0`: every prefill on upstream's chunked kernel.",
        "use 1 or 0 (true/false, yes/no, on/off), or unset it (1)",
    ),
    EnvVar(
        HC_REFERENCE_ROUNDING,
        parse_flag,
        True,
        "`1`",
        "With upstream on CUDA: the hyper-connection gate mix rounds where transformers and our "
        "implementation round (`sigmoid` and each product to bf16 before the mean; "
        "`model/upstream/hc_mix.py`), one kernel launch as upstream's. Upstream's own kernel rounds "
        "once at the end, which flips MoE routing near-ties the reference does not flip; on text "
        "that repeats the flip repeats, and a served checkpoint sat twice as far from float32 as "
        "transformers-bf16 (docs/fidelity.md). `0`: upstream's kernel.",
        "use 1 or 0 (true/false, yes/no, on/off), or unset it (1)",
    ),
    EnvVar(
        SEPARATE_INDEXER_PROJECTION,
        parse_flag,
        False,
        "`0`",
        "With upstream on CUDA: `1` keeps each QSA layer's indexer Q/K projection its own GEMM, as every "
        "quantized checkpoint has it, instead of a fourth shard of the QKV GEMM. For comparing a "
        "quantized checkpoint with its bf16 twin on the same layer structure (the GPU twin tests); "
        "the same weights, another GEMM split, so bf16 rounding may differ.",
        "use 1 or 0 (true/false, yes/no, on/off), or unset it (0)",
    ),
    EnvVar(
        SPECULATIVE,
        parse_speculative,
        "auto",
        "`auto`",
        "Speculative decoding with vLLM's own machinery. `mtp`: the checkpoint's multi-token-prediction "
        "layers draft (start-up fails naming the fix where config.json has no `mtp_num_hidden_layers` "
        "or the weights no `mtp.*` tensors); `ngram`: prompt lookup drafts from text already in the "
        "sequence, for any checkpoint, useful where answers copy their prompt; `off`. `auto`: `mtp` "
        "where the checkpoint has MTP layers, else off. Served by upstream on CUDA; our "
        "implementation (vLLM's CPU build, `QWEN4EXP_CUDA_MODEL=ours`) cannot roll its PLE state back "
        "over rejected drafts, so there the service logs why and serves without it.",
        "use auto, off, ngram or mtp, or unset it (auto)",
    ),
    EnvVar(
        SPECULATIVE_TOKENS,
        parse_draft_tokens,
        3,
        "`3`",
        "Draft tokens proposed per step when speculating (1 to 8): each verify step costs about one "
        "decode step and gains the accepted drafts.",
        f"use a whole number from 1 to {MAX_SPECULATIVE_TOKENS}, or unset it (3)",
    ),
    EnvVar(
        NGRAM_WINDOW,
        parse_ngram_window,
        (2, 4),
        "`2-4`",
        "With `QWEN4EXP_SPECULATIVE=ngram`: the shortest and longest n-gram (`MIN-MAX`) matched against "
        "earlier text to draft the continuation (vLLM's `prompt_lookup_min`/`prompt_lookup_max`).",
        "use MIN-MAX with 1 <= MIN <= MAX <= 16 (e.g. 2-4), or unset it (2-4)",
    ),
    EnvVar(
        EXPERT_PARALLEL,
        parse_expert_parallel,
        "auto",
        "`auto`",
        "With several GPUs: `on` gives each rank `num_experts / TP` whole routed experts (vLLM's "
        "`--enable-expert-parallel`) instead of a `1/TP` slice of every expert; the same bytes, other "
        "kernel shapes, the same all-reduce. `auto` takes it where Marlin (int4/FP8 experts on a 3090) "
        "cannot run the slices, e.g. 640-wide experts at TP=4 (160 per rank, no multiple of the int4 "
        "group 128), and logs why; elsewhere it keeps the slices (at batch 1 the rank holding most of a "
        "token's experts sets the pace). `off` where only whole experts fit stops start-up naming the fix. "
        "vLLM's CPU build keeps the slices and logs why (its fused-MoE kernel crashes on a share of the "
        "experts).",
        "use auto, on or off, or unset it (auto)",
    ),
    EnvVar(
        FORCE_SM86,
        parse_flag,
        False,
        "`0`",
        "`1` makes a newer NVIDIA GPU (an H100/H200) take every choice an RTX 3090 takes: Triton/FLA "
        "GDN prefill, Marlin for FP8 weights, kernel tiles sized for 101,376 bytes of shared memory per "
        "block, no CuTe-DSL hyper-connection kernel (`model/runtime/sm86.py`). For testing the 3090's "
        "paths where no 3090 is at hand.",
        "use 1 or 0 (true/false, yes/no, on/off), or unset it (0)",
    ),
    EnvVar(
        ENGINE_FATAL_FILE,
        parse_path,
        None,
        "set by the service",
        "Internal: the file where the engine guard writes why the engine core stopped; the service "
        "sets it for its engine and names the reason when it exits.",
        "leave it unset: the service sets it",
    ),
    EnvVar(
        FAULT_INJECT_TOKEN,
        parse_token_id,
        None,
        "unset",
        "Tests only: a model step whose input contains this token id fails (recoverable); read at "
        "model construction.",
        "use a token id (an integer >= 0), or unset it (always, in deployments)",
    ),
    EnvVar(
        FAULT_INJECT_FATAL_TOKEN,
        parse_token_id,
        None,
        "unset",
        "Tests only: a model step whose input contains this token id raises a simulated CUDA error "
        "(unrecoverable, the engine stops).",
        "use a token id (an integer >= 0), or unset it (always, in deployments)",
    ),
)

BY_NAME: dict[str, EnvVar] = {v.name: v for v in VARIABLES}


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The parsed value of ``name`` (its default if unset or empty); :class:`EnvError` if malformed."""
    var = BY_NAME[name]
    raw = (os.environ if env is None else env).get(name)
    if raw is None or not raw.strip():
        return var.default
    return var.parse(name, raw)


def validate(env: Mapping[str, str] | None = None) -> tuple[SimpleNamespace, list[str]]:
    """Parse and check every variable: the values by name, and one ``NAME=...: why; fix: how``
    line per problem (all of them, so an operator fixes everything in one go)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    problems: list[str] = []
    for var in VARIABLES:
        try:
            values[var.name] = value = read(var.name, env)
        except EnvError as exc:
            problems.append(f"{exc}; fix: {var.fix}")
            continue
        if value is not None and var.check is not None and (why := var.check(value)) is not None:
            problems.append(f"{var.name}={env.get(var.name)!r}: {why}; fix: {var.fix}")
    return SimpleNamespace(**values), problems


def prepare_collect_dir(path: Path) -> None:
    """Create the calibration directory, refusing exactly what :func:`validate` refuses."""
    if (why := collect_dir_problem(path)) is not None:
        raise EnvError(f"{QSA_KV_COLLECT}={str(path)!r}: {why}; fix: {BY_NAME[QSA_KV_COLLECT].fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a race or a filesystem the access check cannot see (read-only mount)
        raise EnvError(f"{QSA_KV_COLLECT}={str(path)!r}: cannot create directory: {exc}") from None


def ple_storage_mode(env: Mapping[str, str] | None = None) -> str:
    """``VLLM_PLE_CPU_OFFLOAD`` as a PLE storage mode: ``"pinned"`` (default) or ``"device"``.

    On CUDA, ``"pinned"`` keeps tables in page-locked host memory read through UVA (start-up
    fails if the GPU cannot); ``"device"`` puts them in GPU memory. On vLLM's CPU build both
    keep them in ordinary RAM and look rows up with torch; only the storage class differs.
    """
    return "pinned" if read(PLE_CPU_OFFLOAD, env) else "device"


def ple_prefetch(cuda: bool, env: Mapping[str, str] | None = None) -> bool:
    """``VLLM_PLE_PREFETCH``: whether PLE lookups start early (default: only with CUDA).

    On CPU a "prefetch" runs synchronously at the earlier point (there is no side stream); it is
    off by default there and can be switched on to exercise the same code path in tests.
    """
    flag = read(PLE_PREFETCH, env)
    return cuda if flag is None else flag


def qsa_selection(cuda: bool, env: Mapping[str, str] | None = None) -> str:
    """``QWEN4EXP_QSA_SELECTION``: ``"batched"`` or ``"loop"`` (default: batched only with CUDA).

    The CPU default is the loop because the parity tests compare against transformers bit for bit,
    and only the loop breaks exact relu-zero ties the way the reference does.
    """
    choice = read(QSA_SELECTION, env)
    return ("batched" if cuda else "loop") if choice is None else choice


def cuda_model(env: Mapping[str, str] | None = None) -> str:
    """``QWEN4EXP_CUDA_MODEL``: ``"auto"`` (default), ``"ours"`` or ``"upstream"``; :class:`EnvError` if
    malformed. :func:`model.deployment.implementation.resolve` turns ``auto`` into the implementation.

    Only the choice: whether upstream can serve a deployment is decided by
    :func:`model.deployment.implementation.problems_for_upstream` (on vLLM's CPU build only ours runs, so
    ``upstream`` is refused there).
    """
    return read(CUDA_MODEL, env)


def markdown_rows() -> list[str]:
    """README table rows for these variables (the service prepends its own)."""
    return [f"| `{v.name}` | {v.default_doc} | {v.doc} |" for v in VARIABLES]
