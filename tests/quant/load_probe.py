"""Build our model in a vLLM CPU engine from a checkpoint, load its weights, and report what vLLM built.

Stops right after ``load_weights`` (and our start-up checks in it), before vLLM post-processes the
weights for a kernel, so it also works where this host has no kernel for the format: that is the
point, it checks that vLLM's own loaders accept the converter's tensors under our model's
quantization config (names, shapes, dtypes) and which quantization method every module got.

``--force-int4-moe-backend``: vLLM picks the int4 MoE kernel already in the layer's constructor and
refuses on hosts without one (x86 without AMX). With the flag the selection returns the CPU int4
experts class anyway; the on-disk layout vLLM loads does not depend on the backend (compressed-
tensors checkpoints load N-first whatever the kernel) and the kernel never runs here.

Prints one line ``PROBE_JSON={...}``: ``methods`` (module -> quant method class), ``kernels``
(module -> the mixed-precision linear kernel vLLM chose, where it chose one), ``params``
(parameter -> [dtype, shape]) and ``loaded``, or ``error`` (type and message) if start-up failed.

``--skip-kernel-check``: skip our start-up check that this host's CPU kernels exist for the format
(tested on its own), so that loading can be checked anyway.

Usage: python -m tests.quant.load_probe CHECKPOINT [--force-int4-moe-backend] [--skip-kernel-check]

``--serve``: import vLLM and our model once, then read one JSON argument list per line from stdin
and run each probe in a forked child (its patches and its half-built engine die with it), printing
``PROBE_DONE`` after each. Importing vLLM is most of a probe's time on a CPU host (seconds per
process); the tests' probes share one server.
"""

from __future__ import annotations

import json
import os
import sys


class _Done(Exception):
    pass


def main(argv: list[str]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # model built in this process
    checkpoint = argv[0]
    result: dict = {}
    from model.ours import model as adapter
    from model.runtime.quant_checks import linear_kernel_name

    original = adapter.Qwen4ExpForCausalLM.load_weights

    def load_weights(self, weights):
        loaded = original(self, weights)
        result["loaded"] = sorted(loaded)
        result["methods"] = {
            name: type(m.quant_method).__name__
            for name, m in self.named_modules()
            if getattr(m, "quant_method", None) is not None
        }
        result["kernels"] = {
            name: kernel for name, m in self.named_modules() if (kernel := linear_kernel_name(m)) is not None
        }
        result["params"] = {n: [str(p.dtype), list(p.shape)] for n, p in self.named_parameters()}
        raise _Done

    adapter.Qwen4ExpForCausalLM.load_weights = load_weights
    if "--skip-kernel-check" in argv:  # load-only: this host may have no kernel for the format
        adapter.check_cpu_kernels = lambda quantized: None
    if "--force-int4-moe-backend" in argv:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
            compressed_tensors_moe_wna16 as wna16,
        )

        wna16.select_wna16_moe_backend = lambda **_: (WNA16MoEBackend.CPU, CPUExpertsInt4)

    from vllm import LLM

    try:
        LLM(
            model=checkpoint,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=512,
            enable_prefix_caching=False,
        )
    except _Done:
        pass
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        cause = exc
        while cause.__cause__ is not None and not isinstance(cause, _Done):
            cause = cause.__cause__
        if "loaded" not in result:
            result["error"] = [type(exc).__name__, str(exc)]
    print("PROBE_JSON=" + json.dumps(result), flush=True)
    os._exit(0)  # skip vLLM's shutdown of a half-built engine


def serve() -> None:
    """Probes on request, each in a child forked from this process after the imports."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm  # noqa: F401 - imported once, before any fork
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe  # noqa: F401
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: F401
        compressed_tensors_moe_wna16,
    )

    from model.ours import model  # noqa: F401
    from model.runtime import quant_checks  # noqa: F401

    print("PROBE_READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        pid = os.fork()
        if pid == 0:
            try:
                main(json.loads(line))
            finally:
                os._exit(1)  # main() exits 0 itself; only an escaped exception gets here
        _, status = os.waitpid(pid, 0)
        print(f"PROBE_DONE {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1:])
