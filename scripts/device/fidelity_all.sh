#!/usr/bin/env bash
# On a GPU host with the CUDA stack in /tmp/site and this tree in /tmp/proj: the service smoke with
# defaults, then the teacher-forced fidelity runs (tests/gpu/fidelity_run.py) per shape in the
# background. Follow with poll.sh-like waiting; logs in /tmp/logs.
set -u
mkdir -p /tmp/logs; cd /tmp/proj
export PYTHONPATH=/tmp/proj:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
python3 -m model.checkpoints --preset holdout --out /tmp/ck/holdout --train-steps 0 --device cuda > /tmp/logs/ck.log 2>&1
# python -m service with its defaults on this GPU (no test shim), bf16 cache (FP8 needs a sidecar)
QWEN4EXP_MODEL=/tmp/ck/holdout QWEN4EXP_KV_CACHE_DTYPE=auto QWEN4EXP_GPU_MEMORY_UTILIZATION=0.3 \
  timeout 420 bash scripts/device/serve_smoke.sh /tmp/logs/serve-defaults > /dev/null 2>&1
cat /tmp/logs/serve-defaults/serve.txt
grep -E "serves|QWEN4EXP_CUDA_MODEL|gdn_prefill|TILE_R|Error|error" /tmp/logs/serve-defaults/serve.log | head -20
for shape in holdout drawn-1 drawn-8; do
  diag=""; [ "$shape" = holdout ] && diag="--diagnose upstream"
  setsid nohup python3 -m tests.gpu.fidelity_run --out /tmp/logs/fid-$shape --shapes $shape \
    --lengths 4,600,2500,16000 --runs upstream:eager,upstream:graphs,ours:eager $diag \
    > /tmp/logs/fid-$shape.log 2>&1 < /dev/null &
  sleep 20
done
setsid nohup python3 -m tests.gpu.fidelity_run --out /tmp/logs/fid-real --shapes real-4layer \
  --lengths 4,600,2500,8000 --runs upstream:eager,upstream:graphs > /tmp/logs/fid-real.log 2>&1 < /dev/null &
sleep 2; echo "started: $(pgrep -fc '[f]idelity_run')"
