"""The engine guard's verdicts: which failed steps fail their requests, which stop the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from model.runtime.engine_guard import MAX_CONSECUTIVE_FAILURES, is_fatal, stop_reason

STEP = SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 1})


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("Worker failed with error 'CUDA error: an illegal memory access was encountered'"),
        RuntimeError("NCCL error in: ProcessGroupNCCL.cpp"),
        RuntimeError("device-side assert triggered"),
        RuntimeError("Executor failed."),
        TimeoutError("RPC call to execute_model timed out."),
        MemoryError(),
        KeyboardInterrupt(),
    ],
)
def test_device_and_process_failures_are_fatal(exc):
    assert is_fatal(exc)
    assert stop_reason(exc, STEP, 0) == "an unrecoverable failure"


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("Worker failed with error 'index 9 is out of bounds for dimension 0 with size 4'"),
        ValueError("injected fault: token 509 in the step"),
        AssertionError("CPU GDN attention requires BF16."),
    ],
)
def test_a_failed_model_step_fails_its_requests_only(exc):
    assert not is_fatal(exc)
    assert stop_reason(exc, STEP, MAX_CONSECUTIVE_FAILURES - 1) is None


def test_failures_outside_a_step_or_repeated_shared_failures_stop_the_engine():
    exc = ValueError("boom")
    assert stop_reason(exc, None, 0) == "a failure outside a model step"
    assert "in a row" in stop_reason(exc, STEP, MAX_CONSECUTIVE_FAILURES)
