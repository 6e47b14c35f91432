#!/usr/bin/env bash
# On the lent GPU machine: wait up to $1 s (or until no stream or bench is left; keep it well under
# the call's limit), print new findings as they come, then each
# stream's summary and verdict lines and the benches' tables, and tar /tmp/logs into $OUT (one
# call's files come back; the machine and its logs go after 30 s without a call).
set -u
end=$((SECONDS + ${1:-60}))
# Findings are echoed as they appear: a call cut by its limit (which shrinks to the session's remaining
# device time) still returns what it printed, but never the summary at the end (seventh H200 run).
seen=/tmp/logs/.poll-seen; touch "$seen"
news() {
  grep -hE "^(marlin|parity|service|kernels|prefix|upstream)[a-z_]* rc=|caching on[^(]*\(|prefix caching|per round|PASSED|FAILED" \
    /tmp/logs/*/summary.txt /tmp/logs/*.log /tmp/logs/*/*.log 2>/dev/null | cut -c1-300 | sort -u > "$seen.now"
  comm -13 "$seen" "$seen.now"; mv "$seen.now" "$seen"
}
while [ $SECONDS -lt $end ]; do
  news
  pgrep -f "[g]pu_tests.sh" >/dev/null || pgrep -f "[b]ench" >/dev/null || break
  sleep 5
done
echo "--- after ${SECONDS}s; running: $(pgrep -fa '[p]ytest|[b]ench/' | grep -o 'tests/gpu/[a-z_]*\.py\|bench/[a-z_]*\.py' | sort | uniq -c | tr '\n' ' ')"
for d in /tmp/logs/*/; do [ -f "$d/summary.txt" ] && { echo "== $d"; cat "$d/summary.txt"; }; done
for f in /tmp/logs/*/*.log; do
  echo "== $f"
  grep -E "PASSED|FAILED|problem|differs|token-identical|cached tokens per" "$f" | tail -12 | cut -c1-300
done
for f in /tmp/logs/prefix*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "^\||prefix caching|first tokens|per round|caching on[^(]*\(|Error" "$f" | tail -14; }; done
[ -f /tmp/logs/ovu/bench_ours_vs_upstream.md ] && head -12 /tmp/logs/ovu/bench_ours_vs_upstream.md | cut -c1-600
cd /tmp && tar -czf "$OUT/logs.tgz" --exclude='*.safetensors' logs 2>/dev/null
[ "$(stat -c %s "$OUT/logs.tgz")" -gt 15000000 ] && { rm "$OUT/logs.tgz"; tar -czf "$OUT/logs-small.tgz" --exclude=pytest-tmp logs; }
true
