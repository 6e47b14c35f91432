#!/usr/bin/env bash
# On the lent GPU machine, after unpack.sh: the GPU judges that start engines, three streams at once
# (each engine reserves its KV cache by size, so vLLM's memory profiling is not confused by the
# others): engine parity (eager + chunked), the service on CUDA, quantized pairs through Marlin,
# and (named in STREAMS) the service's CUDA default (upstream) on qsa512, the kernel judges +
# batched QSA selection, prefix caching on CUDA, and upstream (vLLM's own Qwen4-Exp with our FP8 subclass, plus tests/upstream on the CUDA build).
# Logs and a summary go to $1. STREAMS picks the streams (default "parity service marlin");
# PARITY_K/PARITY_CORES, MARLIN_K, KERNELS_TESTS, UPSTREAM_K/UPSTREAM_CORES, UPSTREAM_QUANT_K,
# UPSTREAM_NATIVE_K and *_S (limits) narrow or move one.
set -uo pipefail
out=${1:?log dir}; mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD:/tmp/site" QWEN4EXP_CUDA_MODEL=ours VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export QWEN4EXP_GPU_TEST_MEM=0.2 GPU_TEST_KV_CACHE_BYTES=$((4 << 30))
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
pin() { if command -v taskset >/dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
stream() {  # name cores limit_s pytest-args...
  local name=$1 cores=$2 limit=$3; shift 3
  pin "$cores" timeout "$limit" python3 -m pytest -v -s -rA -p no:cacheprovider "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? $(tail -1 "$out/$name.log")" >> "$out/summary.txt"
}
: > "$out/summary.txt"
want() { [[ " ${STREAMS:-parity service marlin} " == *" $1 "* ]]; }
want parity && stream parity "${PARITY_CORES:-0-2}" "${PARITY_S:-600}" tests/gpu/test_engine_parity.py -k "${PARITY_K:-eager}" &
want service && stream service 3-5 "${SERVICE_S:-600}" tests/gpu/test_service_cuda.py &
# the product's CUDA default (upstream through our subclass, V2 chosen by the service) on qsa512.
want service_upstream && stream service_upstream 8-11 "${SERVICE_UPSTREAM_S:-900}" tests/gpu/test_service_upstream_cuda.py &
# marlin: the 3090's kernels on the H200 (the test sets them); tiny-w4a16 = experts, experts-g32 (the
# control for vLLM's Marlin-MoE scale-permutation bug) and all; ~110 s a pair.
want marlin && stream marlin 6-7,12-15 "${MARLIN_S:-720}" tests/gpu/test_quant_marlin.py -k "${MARLIN_K:-tiny-w4a16 or qsa512-fp8 or refuses_tiny or wide-w4a16-all}" &
kernel_tests="tests/gpu/test_ple_gather.py tests/gpu/test_qsa_clip.py tests/gpu/test_qsa_kernel.py
  tests/gpu/test_gdn_short_prefill.py tests/unit/test_qsa_batched_selection.py"
# shellcheck disable=SC2086  # KERNELS_TESTS: a space-separated list of test files
{ want kernels && stream kernels 3-4 "${KERNELS_S:-300}" ${KERNELS_TESTS:-$kernel_tests}
  # then, on the same cores: quantized weights and our PLE formats through upstream.
  want upstream_quant && stream upstream_quant 3-4 "${UPSTREAM_QUANT_S:-900}" tests/gpu/test_upstream_cuda.py \
  -k "${UPSTREAM_QUANT_K:-quantized or ple_table}"; } &
# the AutoGPTQ / AutoAWQ layouts through upstream (Marlin), and its refusal of a quantized indexer.
want upstream_native && stream upstream_native 12-15 "${UPSTREAM_NATIVE_S:-900}" tests/gpu/test_upstream_cuda.py \
  -k "${UPSTREAM_NATIVE_K:-gptq or awq or quantized_indexer}" &
want prefix && stream prefix 5 "${PREFIX_S:-420}" tests/gpu/test_prefix_cache_cuda.py &
# vLLM's own Qwen4-Exp through our subclass (its children set Model Runner V2 themselves).
want upstream && stream upstream "${UPSTREAM_CORES:-0-2}" "${UPSTREAM_S:-900}" tests/gpu/test_upstream_cuda.py tests/upstream \
  -k "${UPSTREAM_K:-not quantized and not ple_table}" &
wait
mkdir -p "$out/pytest-tmp"
find /tmp/pytest-of-* -name "*.log" -size -4M -exec cp --backup=numbered {} "$out/pytest-tmp/" \; 2>/dev/null
cat "$out/summary.txt"
