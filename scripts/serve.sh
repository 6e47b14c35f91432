#!/usr/bin/env bash
# Quick start: create .venv, generate the tiny checkpoint if missing, serve it (CPU works).
# Configuration is by environment only (see the README's table); e.g.
#   QWEN4EXP_PORT=9000 QWEN4EXP_API_KEYS=secret bash scripts/serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -f checkpoints/tiny/model.safetensors ]; then
  .venv/bin/python -m model.tools.checkpoints --preset tiny --out checkpoints/tiny
fi
export QWEN4EXP_MODEL="${QWEN4EXP_MODEL:-checkpoints/tiny}"
# Local demo: loopback unless told otherwise; the container uses 0.0.0.0 and requires keys.
export QWEN4EXP_HOST="${QWEN4EXP_HOST:-127.0.0.1}"
# Without a key the demo serves without auth, said explicitly (the service refuses to guess).
if [ -z "${QWEN4EXP_API_KEYS:-}${QWEN4EXP_API_KEYS_FILE:-}" ]; then
  export QWEN4EXP_AUTH="${QWEN4EXP_AUTH:-off}"
fi
# On vLLM's CPU build the KV cache is sized by this (GiB); keep the demo small.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec .venv/bin/python -m service
