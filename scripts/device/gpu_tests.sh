#!/usr/bin/env bash
# On the lent GPU machine, after unpack.sh: the GPU judges that start engines, three streams at once
# (each engine reserves its KV cache by size, so vLLM's memory profiling is not confused by the
# others): engine parity (eager + chunked), the service on CUDA, quantized pairs through Marlin.
# Logs and a summary go to $1.
set -uo pipefail
out=${1:?log dir}; mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD:/tmp/site" VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export QWEN4EXP_GPU_TEST_MEM=0.2 GPU_TEST_KV_CACHE_BYTES=$((4 << 30))
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
pin() { if command -v taskset >/dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
stream() {  # name cores limit_s pytest-args...
  local name=$1 cores=$2 limit=$3; shift 3
  pin "$cores" timeout "$limit" python3 -m pytest -v -s -rA -p no:cacheprovider "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? $(tail -1 "$out/$name.log")" >> "$out/summary.txt"
}
: > "$out/summary.txt"
stream parity 0-2 "${PARITY_S:-420}" tests/gpu/test_engine_parity.py -k "${PARITY_K:-eager}" &
stream service 3-5 "${SERVICE_S:-420}" tests/gpu/test_service_cuda.py &
stream marlin 6-7 "${MARLIN_S:-420}" tests/gpu/test_quant_marlin.py -k "${MARLIN_K:-tiny-w4a16-all or tiny-fp8-experts or wide-w4a16-all}" &
wait
mkdir -p "$out/pytest-tmp"
find /tmp/pytest-of-* -name "*.log" -size -4M -exec cp --backup=numbered {} "$out/pytest-tmp/" \; 2>/dev/null
cat "$out/summary.txt"
