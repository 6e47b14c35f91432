#!/usr/bin/env bash
# On the lent GPU machine, after unpack.sh: the CPU test suite through vLLM's CPU build on the
# host's AVX512-BF16/AMX CPU (issue 10), the CPU-kind-dependent tests first. Logs go to $1 (a dir).
# Runs on CPUs 8-15 (taskset) so GPU work started beside it keeps cores 0-7.
# Not run here: tests/gpu (CUDA), and the deployment file checks that need the tools of
# scripts/ci-tools.sh (compose, helm, promtool, hadolint: nothing CPU-specific); tests/deploy's
# planner tests do run.
set -uo pipefail
logs=${1:?log dir}; mkdir -p "$logs"
cd "$(dirname "$0")/../.."
source scripts/device/cpu_build_env.sh
pin=(); command -v taskset >/dev/null && [ "$(nproc)" -ge 16 ] && pin=(taskset -c 8-15)
{
  lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/Flags:.*/Flags (avx512*, amx*): /' | tr -d '\n'
  grep -o -E "avx512[a-z_0-9]*|amx[a-z_0-9]*" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  python3 -c "import torch, vllm; from vllm.platforms import current_platform as p; print('torch', torch.__version__, 'vllm', vllm.__version__, 'platform', p.device_type, 'avx512_bf16', torch.cpu._is_avx512_bf16_supported())"
} > "$logs/host.txt" 2>&1
run() {  # name, pytest args...
  local name=$1; shift
  "${pin[@]}" python3 -m pytest -q -p no:cacheprovider "$@" > "$logs/$name.log" 2>&1
  echo "$name rc=$? $(tail -1 "$logs/$name.log")" >> "$logs/summary.txt"
}
: > "$logs/summary.txt"
run first tests/unit/test_gdn_one_token.py tests/deploy/test_planner_vs_vllm.py tests/deploy/test_planner.py \
  tests/parity tests/quant/test_cpu_parity.py tests/service/test_resilience.py
bash scripts/device/serve_smoke.sh "$logs" 8-15
run rest tests --ignore=tests/gpu --ignore=tests/deploy/test_alert_rules.py --ignore=tests/deploy/test_compose.py \
  --ignore=tests/deploy/test_dockerfile.py --ignore=tests/deploy/test_helm.py --ignore=tests/deploy/test_prometheus.py \
  --ignore=tests/unit/test_gdn_one_token.py --ignore=tests/deploy/test_planner_vs_vllm.py \
  --ignore=tests/deploy/test_planner.py --ignore=tests/parity --ignore=tests/quant/test_cpu_parity.py \
  --ignore=tests/service/test_resilience.py
touch "$logs/done"
