#!/usr/bin/env bash
# Regenerate deploy/requirements-cuda.txt, the hash-locked package set of the CUDA image, from
# deploy/requirements-cuda.in with uv's resolver:
#
#   bash deploy/lock-requirements.sh
#
# Target: the image's interpreter and platform (CPython 3.11, Linux x86_64, manylinux_2_28 wheels),
# not this machine's. torchvision, torchaudio and torchcodec are left out: vLLM declares them, but a
# text-only model never imports them, and the image installs the lock with --no-deps.
# uv comes from PyPI into a throw-away virtual environment (pinned version).
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
PYTHON_VERSION=3.11
uv=$(command -v uv || true)
if [ -z "$uv" ] || ! "$uv" --version | grep -q " ${UV_VERSION}"; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" install -q "uv==${UV_VERSION}"
  uv="$tmp/venv/bin/uv"
fi
"$uv" pip compile deploy/requirements-cuda.in \
  --python-version "$PYTHON_VERSION" \
  --python-platform x86_64-manylinux_2_28 \
  --generate-hashes \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
  --custom-compile-command "bash deploy/lock-requirements.sh" \
  --quiet \
  -o deploy/requirements-cuda.txt
echo "lock-requirements: $(grep -c '^[a-z0-9]' deploy/requirements-cuda.txt) packages, $(grep -c -- '--hash=' deploy/requirements-cuda.txt) hashes"
