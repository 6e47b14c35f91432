"""``python -m service`` with vLLM's GDN prefill pinned to Triton/FLA, the path an RTX 3090 takes.

On an sm_86 card vLLM picks Triton for the Gated DeltaNet prefill by itself; on the Hopper GPU that
stands in for it here it would pick FlashInfer's sm_90-only prefill. The service has no setting for
the GDN kernel where vLLM's own pick can run (a 3090 deployment never needs one), so the GPU tests
start it through this shim, which only adds ``"gdn_prefill_backend": "triton"`` to the
``--additional-config`` the service derives from its settings and deployment. Everything else is
``service.__main__.main``.

``GPU_TEST_KV_CACHE_BYTES`` (tests only) also appends ``--kv-cache-memory-bytes``: vLLM then skips
its memory profiling, whose free-memory snapshots go wrong when other test engines start or stop on
the same GPU at the same time (it raises "Error in memory profiling").
"""

from __future__ import annotations

import json
import os
import sys

from service import prometheus_dir

_create = prometheus_dir.create


def _create_then_patch():
    path = _create()  # the multiprocess directory must exist before vLLM is imported
    import service.engine as engine
    from tests.gpu.engine import CUDA_ADDITIONAL_CONFIG

    original = engine.cli_args

    def cli_args(settings, device, deployment=None):
        argv = original(settings, device, deployment)
        if "--additional-config" in argv:  # merged: vLLM's parser keeps only the last one given
            at = argv.index("--additional-config") + 1
            argv[at] = json.dumps({**json.loads(argv[at]), **CUDA_ADDITIONAL_CONFIG}, sort_keys=True)
        else:
            argv += ["--additional-config", json.dumps(CUDA_ADDITIONAL_CONFIG)]
        if kv_bytes := os.environ.get("GPU_TEST_KV_CACHE_BYTES"):
            argv += ["--kv-cache-memory-bytes", kv_bytes]
        return argv

    engine.cli_args = cli_args
    return path


prometheus_dir.create = _create_then_patch

if __name__ == "__main__":
    from service.__main__ import main

    sys.exit(main())
