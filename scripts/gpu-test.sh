#!/usr/bin/env bash
# The GPU suite (tests/gpu) on any CUDA host with vLLM's CUDA build and this project installed
# (pip install -e . beside vllm==0.32.*, or scripts/offline-bundle.sh's wheelhouse on an air-gapped
# host). Independent groups of judges run side by side, each with its own engine(s): every engine
# reserves its KV cache by size, so vLLM's memory profiling is not confused by the others.
#
# Usage: bash scripts/gpu-test.sh [--logs DIR] [--streams "NAME ..."] [--bench] [-k EXPR]
#   streams (default: all): kernels parity service service_upstream upstream upstream_quant
#     marlin prefix fidelity preemption real_shape speculative; and, asked for alone on a multi-GPU host
#     (it uses every GPU): tp (tensor parallelism 2 and 4 against one GPU and float32)
#   --bench   after the judges, the GPU benchmarks (timing only) into DIR/bench-*.log
#   -k EXPR   passed to every stream's pytest
# Environment: EXTRA_PYTHONPATH (e.g. a --target install of the CUDA stack), GPU_TEST_KV_CACHE_BYTES.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=gpu-test-logs streams="kernels parity service service_upstream upstream upstream_quant marlin prefix fidelity preemption real_shape speculative"
bench=0 kexpr=()
while [ $# -gt 0 ]; do
  case "$1" in
    --logs) logs=$2; shift 2 ;;
    --streams) streams=$2; shift 2 ;;
    --bench) bench=1; shift ;;
    -k) kexpr=(-k "$2"); shift 2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this is not a CUDA host" >&2; exit 2; }
mkdir -p "$logs"
export PYTHONPATH="$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
export QWEN4EXP_GPU_TEST_MEM=${QWEN4EXP_GPU_TEST_MEM:-0.2} GPU_TEST_KV_CACHE_BYTES=${GPU_TEST_KV_CACHE_BYTES:-$((4 << 30))}
python3 -c "from vllm.platforms import current_platform as p; assert p.is_cuda(), 'vLLM here is not its CUDA build'" \
  || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv > "$logs/gpu.txt" 2>&1
: > "$logs/summary.txt"
stream() {  # name pytest-args...
  local name=$1; shift
  python3 -m pytest -v -s -rA -p no:cacheprovider "${kexpr[@]}" "$@" > "$logs/$name.log" 2>&1
  echo "$name rc=$? $(tail -1 "$logs/$name.log")" >> "$logs/summary.txt"
}
want() { [[ " $streams " == *" $1 "* ]]; }
want kernels && stream kernels tests/gpu/test_ple_gather.py tests/gpu/test_ple_gather_large_table.py tests/gpu/test_qsa_clip.py \
  tests/gpu/test_qsa_kernel.py \
  tests/gpu/test_gdn_short_prefill.py tests/unit/test_qsa_batched_selection.py &
want parity && stream parity tests/gpu/test_engine_parity.py &
want service && stream service tests/gpu/test_service_cuda.py &
want service_upstream && stream service_upstream tests/gpu/test_service_upstream_cuda.py &
want upstream && stream upstream tests/gpu/test_upstream_cuda.py tests/upstream -k "not quantized and not ple_table" &
want upstream_quant && stream upstream_quant tests/gpu/test_upstream_cuda.py -k "quantized or ple_table or gptq or awq" &
want marlin && stream marlin tests/gpu/test_quant_marlin.py &
want prefix && stream prefix tests/gpu/test_prefix_cache_cuda.py &
want fidelity && stream fidelity tests/gpu/test_fidelity_cuda.py &
want preemption && stream preemption tests/gpu/test_preemption_cuda.py &
want real_shape && stream real_shape tests/gpu/test_real_shape_cuda.py &
want speculative && stream speculative tests/gpu/test_speculative_cuda.py &
want tp && stream tp tests/gpu/test_tp_cuda.py &
wait
if [ "$bench" = 1 ]; then
  for b in bench/gpu_qsa_kernels.py bench/gpu_ple_gather.py bench/bench_engine_gpu.py bench/bench_real_shape.py; do
    [ -f "$b" ] && python3 "$b" > "$logs/bench-$(basename "$b" .py).log" 2>&1
    echo "bench $b rc=$?" >> "$logs/summary.txt"
  done
fi
cat "$logs/summary.txt"
! grep -q " rc=[1-9]" "$logs/summary.txt"
