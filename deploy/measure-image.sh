#!/usr/bin/env bash
# Size of the serving image where a container engine exists (docker or podman):
#
#   bash deploy/measure-image.sh [IMAGE]          # default qwen4exp-serve:0.1.0, built if missing
#
# Prints the image's total size, its largest layers, and the largest Python packages inside it
# (site-packages of /opt/venv), so a change of the lock file or the base shows up as a number.
set -euo pipefail
cd "$(dirname "$0")/.."
image=${1:-qwen4exp-serve:0.1.0}
engine=$(command -v docker || command -v podman || true)
if [ -z "$engine" ]; then
  echo "measure-image: no docker or podman here; run this on the build host" >&2
  exit 2
fi
"$engine" image inspect "$image" >/dev/null 2>&1 || "$engine" build -t "$image" .
bytes=$("$engine" image inspect --format '{{.Size}}' "$image")
echo "measure-image: $image: $((bytes / 1000000)) MB ($(awk "BEGIN {printf \"%.2f\", $bytes / 1e9}") GB)"
echo "largest layers:"
"$engine" history --no-trunc --format '{{.Size}}\t{{.CreatedBy}}' "$image" | sort -h -r | head -5 | cut -c1-160
echo "largest Python packages:"
"$engine" run --rm --entrypoint sh "$image" -c \
  'du -sm /opt/venv/lib/python3*/site-packages/* 2>/dev/null | sort -n -r | head -12'
