#!/usr/bin/env bash
# Wait up to $1 s for the fidelity runs, echo their result lines, tar /tmp/logs into $OUT.
set -u
end=$((SECONDS + ${1:-60}))
while [ $SECONDS -lt $end ] && pgrep -f "[f]idelity_run" >/dev/null; do sleep 5; done
for f in /tmp/logs/fid-*.log; do echo "== $f"; grep -E "^\[|Error|error|Traceback" "$f" | grep -v "INFO\|WARNING" | tail -40 | cut -c1-400; done
for f in /tmp/logs/fid-*/fidelity.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
cd /tmp && tar -czf "$OUT/logs.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude=ckpt logs 2>/dev/null; true
