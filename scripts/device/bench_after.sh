#!/usr/bin/env bash
# On the lent GPU machine, once the test streams are done (the benches need the GPU to themselves):
# benchmarks in the background, one after another; poll.sh waits for them.
#   ovu:              bench_ours_vs_upstream.py, ours-loop (issue 13's baseline) vs served, qsa512
#   prefix-rc-ab:     bench_prefix_cache.py on /tmp/rc (start_all.sh draws it), upstream, graphs, 5 rounds
#                     alternating the GDN short-prefill path on (the default) and off in one engine, + control
#   prefix-rc:        one round with QWEN4EXP_GDN_SHORT_PREFILL=0 (the seventh run's path), + control
#   prefix-rc-16:     the same with graphs only up to 16 tokens (the bench before --capture-max), no control
#   prefix-rc-gdn:    one round with QWEN4EXP_GDN_SHORT_PREFILL=1 (one recurrent GDN launch for short prefills), no control
#   prefix-rc-fp8:    three rounds with the FP8 QSA cache (the 3090's path: E4M3 writer, unfused prepare), no control
#   prefix-qsa512:    one round on qsa512, the served default (short-prefill path on), + control
# EAGER=1 leaves graphs off for the prefix benches; PROFILE=1 torch-profiles a cache hit into
# /tmp/logs/prefix-hit-profile.txt (op tables by device and host time).
set -u
cd /tmp/proj
export PYTHONPATH=/tmp/proj:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
graphs=--cuda-graphs; [ -n "${EAGER:-}" ] && graphs=
one() {
  case $1 in
    prefix-rc|prefix-rc-ab|prefix-rc-16|prefix-rc-gdn|prefix-rc-fp8|prefix-qsa512)
      local model=/tmp/rc more=() gdn=0
      [ "$1" = prefix-qsa512 ] && model=/tmp/proj/checkpoints/qsa512 && gdn=1
      [ "$1" = prefix-rc-16 ] && more=(--capture-max 16 --no-control)
      [ "$1" = prefix-rc-gdn ] && more=(--no-control) && gdn=1
      [ "$1" = prefix-rc-ab ] && more=(--gdn-ab --rounds "${ROUNDS:-5}") && gdn=1
      [ "$1" = prefix-rc-fp8 ] && more=(--kv-cache-dtype fp8 --rounds 3 --no-control) && gdn=1
      [ -n "${PROFILE:-}" ] && [ "$1" != prefix-rc-16 ] && more+=(--profile "/tmp/logs/$1-hit-profile.txt")
      QWEN4EXP_GDN_SHORT_PREFILL=$gdn timeout 570 python3 bench/bench_prefix_cache.py --model "$model" --upstream $graphs --gpu-mem 0.5 \
        "${more[@]}" > "/tmp/logs/$1${EAGER:+-eager}.log" 2>&1 ;;
    ovu)
      timeout 590 python3 bench/bench_ours_vs_upstream.py --model /tmp/proj/checkpoints/qsa512 \
        --out /tmp/logs/ovu --impls ours-loop,served --parity-lens 4096 --ttft 8192 --batches 1,16,64 \
        --repeats 2 --timeouts reference=120,ours-loop=250,served=250 --phase-timeout 150 --gpu-mem 0.4 \
        > /tmp/logs/ovu.log 2>&1 ;;
    *) echo "unknown bench $1" >&2 ;;
  esac
}
export -f one; export graphs
mkdir -p /tmp/logs
# WAIT_FOR=PATTERN: start once no process matching it is left (e.g. the draw of /tmp/rc).
setsid nohup bash -c 'while pgrep -f "${WAIT_FOR:-[n]o-such-process}" >/dev/null; do sleep 2; done
  for b in "$@"; do one "$b"; done' benches "$@" > /tmp/logs/benches.out 2>&1 < /dev/null &
sleep 1; echo "started: $*"
