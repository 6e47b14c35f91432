#!/usr/bin/env bash
# On the lent GPU machine, once the test streams are done (the benches need the GPU to themselves):
# one benchmark in the background; poll.sh waits for it.
#   ovu:              bench_ours_vs_upstream.py, ours-loop (issue 13's baseline) vs served, qsa512
#   prefix-rc:        bench_prefix_cache.py on /tmp/rc (start_all.sh draws it), upstream, graphs
#   prefix-qsa512:    the same on qsa512
# EAGER=1 leaves graphs off for the prefix benches; PROFILE=1 torch-profiles the cache hit into
# /tmp/logs/prefix-hit-profile.txt (op tables by device and host time).
set -u
cd /tmp/proj
export PYTHONPATH=/tmp/proj:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
graphs=--cuda-graphs; [ -n "${EAGER:-}" ] && graphs=
case $1 in
  prefix-rc|prefix-qsa512)
    model=/tmp/rc; [ "$1" = prefix-qsa512 ] && model=/tmp/proj/checkpoints/qsa512
    setsid nohup timeout 570 python3 bench/bench_prefix_cache.py --model "$model" --upstream $graphs \
      --gpu-mem 0.5 ${PROFILE:+--profile /tmp/logs/prefix-hit-profile.txt} \
      > "/tmp/logs/$1${EAGER:+-eager}.log" 2>&1 < /dev/null & ;;
  ovu)
    setsid nohup timeout 590 python3 bench/bench_ours_vs_upstream.py --model /tmp/proj/checkpoints/qsa512 \
      --out /tmp/logs/ovu --impls ours-loop,served --parity-lens 4096 --ttft 8192 --batches 1,16,64 \
      --repeats 2 --timeouts reference=120,ours-loop=250,served=250 --phase-timeout 150 --gpu-mem 0.4 \
      > /tmp/logs/ovu.log 2>&1 < /dev/null & ;;
  *) echo "unknown bench $1" >&2; exit 2 ;;
esac
sleep 1; echo "started $1"
