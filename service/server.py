"""The process's run loop: listen, start the engine, serve, and on SIGTERM drain and exit 0.

Order matters: the socket is bound first (a busy port is reported before a long model load), the
HTTP server answers 503 while the engine loads in a thread, and only after a 1-token generation
succeeds does the phase become ``serving``. On SIGTERM/SIGINT: phase ``draining`` (new requests
503, ``/ready`` 503), wait up to QWEN4EXP_DRAIN_SECONDS for in-flight requests, stop HTTP, stop
the engine, exit 0. A dead engine exits non-zero so the orchestrator restarts the container.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path

import uvicorn
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.launcher import NoSignalServer
from vllm.version import __version__ as vllm_version

from model.runtime import envs

from . import http_metrics, logs
from .app import build_app
from .child_environment import export
from .engine import build_engine, configure_engine, generate_one_token
from .lifecycle import Lifecycle, Phase
from .settings import ServiceSettings, SettingsError

log = logging.getLogger("service")

FIRST_GENERATION_TIMEOUT_S = 300.0  # the first step can include lazy initialisation
ENGINE_WATCH_INTERVAL_S = 0.5
STOP_WHILE_LOADING_WAIT_S = 30.0


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run a blocking call in a daemon thread: unlike the default executor's threads, it does not
    hold up interpreter exit if we stop while it is still running (SIGTERM during the load)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: object, exc: BaseException | None) -> None:
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(result)

    def target() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: we stopped meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=f"service-{fn.__name__}", daemon=True).start()
    return future


async def start_engine(app, vllm_config, args, lifecycle: Lifecycle) -> None:
    engine = await in_daemon_thread(build_engine, vllm_config, args, lifecycle)
    app.state.engine_client = engine
    supported_tasks = await engine.get_supported_tasks()
    await init_app_state(engine, app.state, args, supported_tasks)
    await generate_one_token(engine, FIRST_GENERATION_TIMEOUT_S)
    lifecycle.generation_succeeded()
    if lifecycle.phase is Phase.STARTING:  # not if SIGTERM came while loading
        http_metrics.SERVICE_READY.set(1)
        lifecycle.phase = Phase.SERVING


async def watch_engine(app) -> None:
    while True:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        engine = app.state.engine_client
        if engine is not None and engine.errored:
            return


def engine_death_reason() -> str:
    """What the engine core wrote before it died (``model.runtime.engine_guard``), else a pointer to the log."""
    path = envs.read(envs.ENGINE_FATAL_FILE)
    try:
        reason = Path(path).read_text().strip() if path else ""
    except OSError:
        reason = ""
    return reason or "no reason recorded; the engine core's traceback above has it"


async def serve(settings: ServiceSettings, sock: socket.socket) -> int:
    device, vllm_config, args, deployment = configure_engine(settings)
    # The engine core (a child process) writes its fatal reason here. Through the environment, not
    # additional_config: a per-start path there would change vLLM's config hash, the compile cache's key.
    fatal_fd, fatal_path = tempfile.mkstemp(prefix="qwen4exp-engine-fatal-")
    os.close(fatal_fd)
    export({envs.ENGINE_FATAL_FILE: fatal_path})
    lifecycle = Lifecycle()
    app, asgi = build_app(settings, args, lifecycle, device)
    http_metrics.SERVICE_INFO.labels(
        settings.model_name,
        device,
        str(settings.tensor_parallel_size),
        vllm_version,
        deployment.implementation,
    ).set(1)
    config = uvicorn.Config(
        asgi,
        log_level=settings.log_level,
        # Our access log (service.logs.AccessLog) instead of uvicorn's, which writes at the response's
        # start (a stream's end unseen) and with the query string; uvicorn's own lines go through the
        # root handler (logs.configure), in the service's format.
        access_log=False,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=2,  # after our own drain, streams still open are cut
        # h11 bounds the request line and headers it buffers (uvicorn's httptools parser does not:
        # one connection could grow the server by whatever headers it sends).
        http="h11",
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
    server = NoSignalServer(config)  # signals are ours (below), not uvicorn's
    app.state.server = server  # vLLM's engine-error handler stops it through this

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    server_task = asyncio.create_task(server.serve(sockets=[sock]))
    engine_task = asyncio.create_task(start_engine(app, vllm_config, args, lifecycle))
    stop_task = asyncio.create_task(stop.wait())
    log.info(
        "listening on http://%s:%d (device %s, model %s as %r); loading the engine",
        settings.host, settings.port, device, settings.model, settings.model_name,
    )  # fmt: skip

    exit_code = 0
    done, _ = await asyncio.wait({engine_task, stop_task, server_task}, return_when=asyncio.FIRST_COMPLETED)
    if engine_task in done and engine_task.exception() is not None:
        exc = engine_task.exception()
        log.error("engine failed to start: %s: %s", type(exc).__name__, exc)
        exit_code = 1
    elif engine_task in done:
        log.info("ready: serving %r on %s", settings.model_name, device)
        watch_task = asyncio.create_task(watch_engine(app))
        done, _ = await asyncio.wait(
            {stop_task, watch_task, server_task}, return_when=asyncio.FIRST_COMPLETED
        )
        watch_task.cancel()
        if watch_task in done:
            log.error("the engine died (%s); exiting with code 1 for a restart", engine_death_reason())
            exit_code = 1
    if stop_task in done:
        exit_code = await drain(settings, lifecycle)
    if server_task in done and exit_code == 0 and not stop.is_set():
        engine = app.state.engine_client
        # vLLM's engine-error handler stops the HTTP server when a request finds the engine dead.
        if engine is not None and engine.errored:
            log.error("the engine died (%s); exiting with code 1 for a restart", engine_death_reason())
        else:
            log.error("HTTP server stopped")
        exit_code = 1

    lifecycle.phase = Phase.STOPPED
    http_metrics.SERVICE_READY.set(0)
    server.should_exit = True
    with contextlib.suppress(BaseException):
        await server_task
    if not engine_task.done():
        # Stopped while loading: end the engine processes so the load fails fast, then go.
        log.info("stopped while loading: terminating the engine processes")
        for child in multiprocessing.active_children():
            child.terminate()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(engine_task, STOP_WHILE_LOADING_WAIT_S)
    stop_task.cancel()
    engine = app.state.engine_client
    if engine is not None:
        if engine.output_handler is not None:  # stop reading first: the core's exit is expected here
            engine.output_handler.cancel()
        await loop.run_in_executor(None, engine.shutdown)
    sock.close()
    with contextlib.suppress(OSError):
        os.unlink(fatal_path)
    log.info("stopped (exit code %d)", exit_code)
    return exit_code


async def drain(settings: ServiceSettings, lifecycle: Lifecycle) -> int:
    if lifecycle.phase is not Phase.SERVING:
        lifecycle.phase = Phase.DRAINING
        return 0
    lifecycle.phase = Phase.DRAINING
    http_metrics.SERVICE_READY.set(0)
    log.info(
        "SIGTERM: draining %d in-flight request(s) for up to %.0f s",
        lifecycle.inflight,
        settings.drain_seconds,
    )
    if await lifecycle.wait_idle(settings.drain_seconds):
        log.info("drained")
    else:
        log.warning("drain period over with %d request(s) still running; stopping them", lifecycle.inflight)
    return 0


def run(settings: ServiceSettings, sock: socket.socket) -> int:
    """Serve until SIGTERM/SIGINT; the return value is the process's exit code."""
    logs.configure(settings.log_level, settings.log_format)
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()  # spawn workers, as `vllm serve` does
    from .cuda_preflight import PREFLIGHT_EXIT_CODE, preflight_failure

    if (failure := preflight_failure(settings.device, settings.tensor_parallel_size)) is not None:
        sys.stderr.write(f"service: {failure}\n")  # driver too old / no GPUs: say so, before vLLM does
        return PREFLIGHT_EXIT_CODE
    try:
        import uvloop  # vLLM's own server runs on uvloop too; it is a vLLM dependency

        return uvloop.run(serve(settings, sock))
    except SettingsError as exc:
        sys.stderr.write(f"service: invalid configuration:\n{exc}\n")
        return 2
