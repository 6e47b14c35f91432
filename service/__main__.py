"""``python -m service``: the only entry point (also the container's). Configured by environment.

The Prometheus multiprocess directory is created and exported before anything imports vLLM or
prometheus_client (see ``prometheus_dir``), and removed when the process ends. Settings are
validated next, before vLLM is imported, so a bad value fails within a second with one line per
problem, naming the variable and the fix (exit code 2, no traceback).

Nothing runs at import: vLLM's spawned workers import this module as ``__mp_main__``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from service import prometheus_dir


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(0)  # stopped while importing: nothing to drain, but clean up in `finally`


def main() -> int:
    signal.signal(signal.SIGTERM, _terminated)  # the run loop installs its own once it starts
    path = prometheus_dir.create()
    vllm_logging_file = None
    try:
        from service.settings import SettingsError, load, unknown_prefixed_variables

        try:
            settings, model_env = load()
        except SettingsError as exc:
            sys.stderr.write(f"service: invalid configuration:\n{exc}\n")
            return 2
        from service import logs

        logs.configure(settings.log_level, settings.log_format)  # before vLLM's first import logs
        for name in unknown_prefixed_variables():
            sys.stderr.write(f"service: warning: {name} is not a setting of this service (typo?); ignored\n")
        # vLLM sizes its request models' stop lists when they are imported: before vLLM is.
        from service.child_environment import export
        from service.request_caps import vllm_environment

        export(vllm_environment(settings))
        if settings.log_format == "json":
            # vLLM applies its logging configuration (carried in its config) in each process it starts.
            if os.environ.get("VLLM_LOGGING_CONFIG_PATH", "").strip():
                logs.logging.getLogger("service").warning(
                    "VLLM_LOGGING_CONFIG_PATH is set: vLLM's lines keep the format that file gives them"
                )
            else:
                vllm_logging_file = logs.write_vllm_logging_config(settings.log_level)
                export({"VLLM_LOGGING_CONFIG_PATH": vllm_logging_file})

        from service.listen import bind

        try:
            sock = bind(settings)
        except SettingsError as exc:
            sys.stderr.write(f"service: invalid configuration:\n{exc}\n")
            return 2
        del model_env  # validated only; the workers read these variables from their environment

        from service.server import run

        return run(settings, sock)
    finally:
        prometheus_dir.remove(path)
        if vllm_logging_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(vllm_logging_file)


if __name__ == "__main__":
    sys.exit(main())
