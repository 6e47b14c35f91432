"""``scripts/as-avx2.sh`` makes vLLM's CPU build take the AVX2 kind's paths on any x86 host: its
AVX2 kernel library, bf16 GDN states and the plain vector attention kernel, in child processes too."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

CHILD = """
import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
current_platform.import_kernels()
libraries = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps") if "vllm/_C" in line})
print(libraries, torch.backends.cpu.get_cpu_capability(), _get_attn_isa(torch.bfloat16, 128, 64))
"""


def test_as_avx2_loads_vllms_avx2_library_and_paths():
    run = subprocess.run(
        ["bash", "scripts/as-avx2.sh", sys.executable, "-c", CHILD],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last == "['_C_AVX2.abi3.so'] AVX2 vec", last
