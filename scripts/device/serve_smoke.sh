#!/usr/bin/env bash
# The quick start as scripts/serve.sh runs it (without its pip setup: the stack is carried), then
# `{"prompt": [5]}`, a normal completion and a chat; /ready after them; SIGTERM. Lines to $1/serve.txt.
# Usage: serve_smoke.sh LOGDIR [CPU-LIST]   (run from the repository root, environment already set)
set -uo pipefail
logs=${1:?log dir}; mkdir -p "$logs"
pin=(); [ -n "${2:-}" ] && command -v taskset >/dev/null && pin=(taskset -c "$2")
export QWEN4EXP_MODEL=${QWEN4EXP_MODEL:-checkpoints/tiny} QWEN4EXP_HOST=127.0.0.1 QWEN4EXP_PORT=${QWEN4EXP_PORT:-18123}
url=http://127.0.0.1:$QWEN4EXP_PORT
"${pin[@]}" python3 -m service > "$logs/serve.log" 2>&1 & pid=$!
t0=$(date +%s); ok=0
for _ in $(seq 1 200); do curl -sf "$url/ready" >/dev/null 2>&1 && { ok=1; break; }; sleep 1; done
echo "serve ready=$ok after $(( $(date +%s) - t0 )) s" >> "$logs/serve.txt"
name=$(curl -s "$url/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])' 2>/dev/null)
for body in '{"prompt":[5],"max_tokens":4}' '{"prompt":"Hello there","max_tokens":8}'; do
  curl -s -o /dev/null -w "completions $body -> %{http_code}\n" "$url/v1/completions" \
    -H 'content-type: application/json' -d "{\"model\":\"$name\",${body:1}" >> "$logs/serve.txt"
done
curl -s -o /dev/null -w "chat -> %{http_code}\n" "$url/v1/chat/completions" -H 'content-type: application/json' \
  -d "{\"model\":\"$name\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":8}" >> "$logs/serve.txt"
curl -s -o /dev/null -w "ready after them -> %{http_code}\n" "$url/ready" >> "$logs/serve.txt"
kill -TERM $pid 2>/dev/null; wait $pid; echo "serve exit=$?" >> "$logs/serve.txt"
