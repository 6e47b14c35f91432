#!/usr/bin/env bash
# On the lent GPU machine, after unpack.sh and a snapshot of the tree in /tmp/proj (checkpoints/ with
# tiny and qsa512 copied in): every tests/gpu stream in the background (setsid: the streams survive
# the call that starts them), as two gpu_tests.sh runs so parity tiny and wide run side by side, and
# the real-compute timing checkpoint drawn on the GPU (/tmp/rc). STREAMS picks streams (gpu_tests.sh).
# Follow with poll.sh.
# 2026-12-02: ~10 min for the longest stream (upstream) with all of them side by side on an H200.
set -u
mkdir -p /tmp/logs
cd /tmp/proj
streams="${STREAMS:-parity service service_upstream marlin kernels upstream_quant prefix upstream}"
STREAMS="$streams" PARITY_K=tiny setsid nohup bash scripts/device/gpu_tests.sh /tmp/logs/gpu > /tmp/logs/gpu.out 2>&1 < /dev/null &
[[ " $streams " == *" parity "* ]] && STREAMS=parity PARITY_K=wide PARITY_CORES=14-15 \
  setsid nohup bash scripts/device/gpu_tests.sh /tmp/logs/gpu2 > /tmp/logs/gpu2.out 2>&1 < /dev/null &
PYTHONPATH=/tmp/proj:/tmp/site setsid nohup python3 -m model.checkpoints --preset real-compute --out /tmp/rc \
  --train-steps 0 --device cuda > /tmp/logs/rc.log 2>&1 < /dev/null &
sleep 3; echo "pytest processes: $(pgrep -fc '[p]ytest')"
