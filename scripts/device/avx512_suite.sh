#!/usr/bin/env bash
# On the lent GPU machine, after unpack.sh: the CPU test suite through vLLM's CPU build on the
# host's AVX512-BF16/AMX CPU (issue 10), the CPU-kind-dependent tests first. Logs go to $1 (a dir).
# Runs on CPUs 8-15 (taskset) so GPU work started beside it keeps cores 0-7: four shards of two
# cores at once (the suite is ~28 min serial on 2 cores), each with its own pytest base temp.
# Not run here: tests/gpu (CUDA), and the deployment file checks that need the tools of
# scripts/ci-tools.sh (compose, helm, promtool, hadolint: nothing CPU-specific); tests/deploy's
# planner tests do run.
set -uo pipefail
logs=${1:?log dir}; mkdir -p "$logs"
cd "$(dirname "$0")/../.."
source scripts/device/cpu_build_env.sh
{
  lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/Flags:.*/Flags (avx512*, amx*): /' | tr -d '\n'
  grep -o -E "avx512[a-z_0-9]*|amx[a-z_0-9]*" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  python3 -c "import torch, vllm; from vllm.platforms import current_platform as p; print('torch', torch.__version__, 'vllm', vllm.__version__, 'platform', p.device_type, 'avx512_bf16', torch.cpu._is_avx512_bf16_supported())"
} > "$logs/host.txt" 2>&1
shard() {  # name cores pytest-args...
  local name=$1 cores=$2; shift 2
  local pin=(); command -v taskset >/dev/null && [ "$(nproc)" -ge 16 ] && pin=(taskset -c "$cores")
  local t0=$(date +%s)
  "${pin[@]}" python3 -m pytest -q -p no:cacheprovider --basetemp="/tmp/shard-$name" "$@" > "$logs/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(tail -1 "$logs/$name.log")" >> "$logs/summary.txt"
}
: > "$logs/summary.txt"
# 1: the tests that depend on the CPU kind (conv path, state layout, AMX kernels), then the quick start.
( shard kind 8-9 tests/unit/test_gdn_one_token.py tests/deploy/test_planner_vs_vllm.py tests/deploy/test_planner.py \
    tests/parity; bash scripts/device/serve_smoke.sh "$logs" 8-9 ) &
shard service 10-11 tests/service &
shard kernels 12-13 tests/kernels tests/qsa_kv tests/quant &
shard rest 14-15 tests/unit tests/upstream tests/ple tests/prefix_cache tests/loading tests/deploy \
  --ignore=tests/unit/test_gdn_one_token.py --ignore=tests/deploy/test_planner_vs_vllm.py \
  --ignore=tests/deploy/test_planner.py --ignore=tests/deploy/test_alert_rules.py \
  --ignore=tests/deploy/test_compose.py --ignore=tests/deploy/test_dockerfile.py \
  --ignore=tests/deploy/test_helm.py --ignore=tests/deploy/test_prometheus.py &
wait
touch "$logs/done"
