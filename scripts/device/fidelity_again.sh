#!/usr/bin/env bash
# Re-run the fidelity jobs from a fresh snapshot of the tree ($1), reusing the checkpoints built before.
set -u
pkill -f "[f]idelity_run" ; sleep 3
rm -rf /tmp/proj2 && cp -r "$1" /tmp/proj2 && rm -rf /tmp/proj2/.gpu && cd /tmp/proj2
export PYTHONPATH=/tmp/proj2:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
mkdir -p /tmp/logs/old && mv /tmp/logs/fid-*.log /tmp/logs/old/ 2>/dev/null
setsid nohup python3 -m tests.gpu.fidelity_run --out /tmp/logs/fid-holdout --shapes holdout --lengths 4,600,2500,16000 \
  --runs upstream:eager,ours:eager,upstream:graphs --diagnose upstream > /tmp/logs/fid-holdout.log 2>&1 < /dev/null &
sleep 15
setsid nohup python3 -m tests.gpu.fidelity_run --out /tmp/logs/fid-drawn-1 --shapes drawn-1 --lengths 4,600,2500 \
  --runs upstream:eager,ours:eager > /tmp/logs/fid-drawn-1.log 2>&1 < /dev/null &
sleep 15
FIDELITY_GPU_UTILIZATION=0.3 setsid nohup python3 -m tests.gpu.fidelity_run --out /tmp/logs/fid-real --shapes real-4layer \
  --lengths 4,600,2500 --runs upstream:eager > /tmp/logs/fid-real.log 2>&1 < /dev/null &
sleep 2; echo "started: $(pgrep -fc '[f]idelity_run')"
