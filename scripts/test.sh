#!/usr/bin/env bash
# The test command: set up the environment, lint, run every test (CPU; Triton kernels interpreted).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/cpu-kind.sh   # first line: which CPU kind the results below belong to
bash scripts/setup.sh
bash scripts/ci-tools.sh   # docker-compose, promtool/prometheus, helm, schema validator, hadolint
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# --durations: the ten slowest tests close the output, so the suite's cost stays visible.
.venv/bin/python -m pytest tests --durations=10 "$@"
