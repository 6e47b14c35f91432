#!/usr/bin/env bash
# Prints which CPU kind this host is, as vLLM's CPU build tells them apart: AVX512-BF16 (with or
# without AMX tiles) loads its full kernel library and keeps GDN states in float32; AVX-512 alone
# and AVX2 load reduced ones (int4/FP8 kernels missing, GDN states in bf16). Tests differ by kind.
set -euo pipefail
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]]; }
if has avx512_bf16; then kind=AVX512-BF16
elif has avx512f; then kind=AVX512
elif has avx2; then kind=AVX2
else kind="no AVX2"
fi
amx=no; has amx_tile && amx=yes
model=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//' || true)
echo "CPU kind: $kind (AMX tiles: $amx; $(nproc) cores; ${model:-unknown model})"
