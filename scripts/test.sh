#!/usr/bin/env bash
# The test command: set up the environment, lint, run every test (CPU; Triton kernels interpreted).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/ci-tools.sh   # docker-compose, promtool/prometheus, helm, schema validator, hadolint
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest tests "$@"
