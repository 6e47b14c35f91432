#!/usr/bin/env bash
# Runs a command as it would run on an AVX2-only CPU, on an AVX-512 host: vLLM's CPU build loads
# its AVX2 library and takes every AVX2 path (scripts/avx2-emulation/sitecustomize.py says which),
# torch dispatches AVX2 kernels, oneDNN and MKL stop at AVX2. For checking the AVX2 kind's code
# paths where no such host is at hand; floating-point results, and so checkpoints generated with
# training, still differ from a real AVX2 machine's (another vendor's math libraries and FMA order).
# Usage: bash scripts/as-avx2.sh .venv/bin/python -m pytest tests/pressure/test_preemption_parity.py
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export EMULATE_CPU_KIND_AVX2=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export PYTHONPATH="$here/avx2-emulation${PYTHONPATH:+:$PYTHONPATH}"
# The switch is no QWEN4EXP_ variable: the service tests pass those to the service only when set
# on purpose. Checkpoints generated under emulation are kept apart from the host's own.
export QWEN4EXP_TEST_CHECKPOINTS=${QWEN4EXP_TEST_CHECKPOINTS:-$here/../checkpoints/avx2-emulated}
exec "$@"
