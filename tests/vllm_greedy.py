"""vLLM's engine as the engine-level tests start it: in the test's own process, and greedy generation.

vLLM's ``LLM`` class normally runs its engine core and its worker in two child processes, each of
which imports vLLM and torch again: on a 2-core host that is ~20 s of every engine start, for no
difference in what the model computes (the served path, ``python -m service``, keeps vLLM's
processes; only these model-level tests run in-process). :func:`in_process_engine` is the one
place that knows what an in-process engine leaves behind in the test's process and undoes it.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextmanager
def in_process_engine() -> Iterator[None]:
    """Engines built inside this block run in this process; leaving it restores the process.

    Start the ``LLM`` and shut it down inside the block. What an in-process engine changes, and
    what leaving the block puts back: vLLM caches every ``VLLM_*`` variable once an engine is up
    (the next engine would not see a test's new settings), freezes the garbage collector's heap
    (an engine's tensors would never be freed), replaces ``torch.set_num_threads`` with a no-op
    and binds the process's threads and CPU affinity to its cores (later tests would compute on
    one thread or see one CPU). Not for tests that read what a worker process writes: metrics in
    ``PROMETHEUS_MULTIPROC_DIR`` (an in-process engine writes them to this process's registry) or
    a calibration dump written when the worker exits. With several ranks only the engine core
    comes into this process; the workers stay vLLM's processes.
    """
    import torch
    import vllm.envs as envs

    affinity, threads, set_threads = os.sched_getaffinity(0), torch.get_num_threads(), torch.set_num_threads
    before = os.environ.get(MULTIPROCESSING)
    os.environ[MULTIPROCESSING] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(MULTIPROCESSING, None)
        else:
            os.environ[MULTIPROCESSING] = before
        envs.disable_envs_cache()
        gc.unfreeze()
        gc.collect()
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)


def shut_down(llm) -> None:
    """Stop an ``LLM``'s engine (inside :func:`in_process_engine` if it was built there); its model
    and KV cache go with the caller's last reference to it."""
    llm.llm_engine.engine_core.shutdown()


def start_and_stop(path, **engine_args) -> None:
    """Start an engine on ``path`` in this process and stop it: start-up checks as a test sees them,
    an error arriving as the exception it was raised as (no child process wraps it)."""
    from vllm import LLM

    args = dict(dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False, max_model_len=512)
    with in_process_engine():
        llm = LLM(model=str(path), **{**args, **engine_args})
        shut_down(llm)
        del llm


def greedy_vllm(
    path, prompts: dict[str, list[int]], max_new_tokens: int, *, in_process: bool = True, **engine_args
) -> dict[str, list[int]]:
    """Greedy tokens per prompt (never stopping at EOS); the engine is shut down before returning.

    ``in_process=False`` keeps vLLM's child processes (tests that read multiprocess metrics).
    """
    from vllm import LLM, SamplingParams

    args = dict(dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False, max_model_len=2048, seed=0)
    with in_process_engine() if in_process else nullcontext():
        llm = LLM(model=str(path), **{**args, **engine_args})
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
            outputs = llm.generate(
                [{"prompt_token_ids": ids} for ids in prompts.values()], params, use_tqdm=False
            )
            return {name: list(out.outputs[0].token_ids) for name, out in zip(prompts, outputs, strict=True)}
        finally:
            shut_down(llm)
