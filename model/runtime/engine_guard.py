"""Keep vLLM's engine core alive when one model step fails; die loudly when it cannot recover.

vLLM 0.32 treats any exception from a model step as fatal: the engine core exits and every
in-flight request of every client is lost, so one request that trips a bug in a kernel or in our
model takes the whole service down. This guard, installed by our plugin in the engine-core
process, changes that one policy:

* A step whose model execution raised fails the requests *of that step* (their clients get
  vLLM's own request error, finish reason ``error``, an HTTP 500 or a streamed error) and the
  engine goes on with the rest. The co-batched requests of the failing step fail too: the step
  ran part of the forward, so their recurrent (GDN/PLE) and KV state can no longer be trusted.
* Failures that leave the process or the device in an unknown state are re-raised, so vLLM
  shuts the engine down as before: CUDA/NCCL errors (a corrupted CUDA context stays corrupted),
  a dead or unreachable worker, and :data:`MAX_CONSECUTIVE_FAILURES` failed steps in a row (a
  broken engine, not a bad request; a failing step of a single request does not count, so a
  client sending bad requests one after another cannot trip it). Before it dies the guard writes the reason to
  ``QWEN4EXP_ENGINE_FATAL_FILE`` (set by the service) so the service can say why it exits.

Only exceptions raised inside vLLM's ``log_error_detail`` block (the model execution and
sampling of one step) are handled; scheduler or output-processing errors still end the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import contextmanager

from model.runtime import envs

log = logging.getLogger("qwen4exp.engine_guard")

MAX_CONSECUTIVE_FAILURES = 3

# Text of failures after which the process or device must not be trusted again.
FATAL_MARKERS = (
    "CUDA error",
    "CUDA-capable device",
    "cudaError",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "NCCL",
    "ECC error",
    "Executor failed",
    "Worker proc",
    "died unexpectedly",
    "timed out",
)

_STEP_OUTPUT_ATTR = "_qwen4exp_failed_step"


def is_fatal(exc: BaseException) -> bool:
    """True for failures after which the engine must be restarted rather than continued."""
    if not isinstance(exc, Exception) or isinstance(exc, (TimeoutError, MemoryError)):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in FATAL_MARKERS)


def step_request_ids(scheduler_output) -> list[str]:
    """The requests a step scheduled (new, running and resumed ones alike)."""
    return list(scheduler_output.num_scheduled_tokens)


def write_fatal_reason(reason: str) -> None:
    path = envs.read(envs.ENGINE_FATAL_FILE)
    if path is None:
        return
    try:
        with open(path, "w") as f:
            f.write(reason[:4000])
    except OSError as exc:  # the reason still goes to the log
        log.warning("could not write the engine's fatal reason to %s: %s", path, exc)


def stop_reason(exc: BaseException, failed_step, shared_failures: int) -> str | None:
    """None if the failed step's requests can be failed and the engine go on; else why not."""
    if failed_step is None:
        return "a failure outside a model step"
    if is_fatal(exc):
        return "an unrecoverable failure"
    if shared_failures >= MAX_CONSECUTIVE_FAILURES:
        return f"{shared_failures} model steps of several requests failed in a row"
    return None


def _guarded(step):
    def guarded_step(self):
        try:
            result = step(self)
        except Exception as exc:
            failed = getattr(exc, _STEP_OUTPUT_ATTR, None)
            # A failing step of one request has found its culprit; only steps of several count
            # towards "the engine is broken".
            if failed is None or len(step_request_ids(failed)) > 1:
                self._qwen4exp_failures = getattr(self, "_qwen4exp_failures", 0) + 1
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            why = stop_reason(exc, failed, getattr(self, "_qwen4exp_failures", 0))
            if why is not None:
                write_fatal_reason(f"engine core stopped after {why}: {reason}")
                raise
            fail_requests(self, step_request_ids(failed), reason)
            return {}, False
        self._qwen4exp_failures = 0
        return result

    guarded_step.__wrapped__ = step
    return guarded_step


def fail_requests(core, request_ids: list[str], reason: str) -> None:
    """Finish ``request_ids`` with an error for their clients; the engine continues."""
    from vllm.v1.request import RequestStatus

    requests = [core.scheduler.requests[r] for r in request_ids if r in core.scheduler.requests]
    log.error(
        "a model step failed (%s); failing its %d request(s) %s, the engine continues",
        reason,
        len(requests),
        [r.request_id for r in requests],
    )
    core.scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ERROR)
    by_client: dict[int, list[str]] = {}
    for r in requests:
        by_client.setdefault(r.client_index, []).append(r.request_id)
    for client, ids in by_client.items():
        core._send_error_outputs_to_client(ids, client)


def install() -> None:
    """Patch vLLM's ``EngineCore`` (idempotent); called by the plugin in every vLLM process."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore.step, "__wrapped__", None) is not None:
        return
    original_detail = EngineCore.log_error_detail

    @contextmanager
    def log_error_detail(self, scheduler_output):
        try:
            with original_detail(self, scheduler_output):
                yield
        except Exception as exc:
            setattr(exc, _STEP_OUTPUT_ATTR, scheduler_output)
            raise

    EngineCore.log_error_detail = log_error_detail
    EngineCore.step = _guarded(EngineCore.step)
    EngineCore.step_with_batch_queue = _guarded(EngineCore.step_with_batch_queue)


def fault_injector(tokens: Iterable[tuple[int, bool]]):
    """Fault injection for the resilience tests, set up once at model construction from the
    deployment's ``(token id, fatal)`` pairs.

    ``QWEN4EXP_FAULT_INJECT_TOKEN=<id>``: a model step whose input contains that token id raises,
    as a bug in a layer would (recoverable). ``QWEN4EXP_FAULT_INJECT_FATAL_TOKEN=<id>``: such a
    step raises a simulated CUDA error (unrecoverable). Without them (always, in deployments) this
    returns None and costs nothing.
    """
    faults = dict(tokens)
    for token_id, fatal in faults.items():
        name = envs.FAULT_INJECT_FATAL_TOKEN if fatal else envs.FAULT_INJECT_TOKEN
        log.warning("%s=%s: steps containing this token fail on purpose (tests only)", name, token_id)
    if not faults:
        return None

    def check(input_ids) -> None:
        if input_ids is None:
            return
        for token_id, fatal in faults.items():
            if bool((input_ids == token_id).any()):
                if fatal:
                    raise RuntimeError(f"CUDA error: injected fatal fault (token {token_id})")
                raise ValueError(f"injected fault: token {token_id} in the step ({envs.FAULT_INJECT_TOKEN})")

    return check
