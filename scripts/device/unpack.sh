#!/usr/bin/env bash
# On the lent GPU machine: assemble the carried parts in /tmp/asm and install them.
#   b.NN: vLLM's CUDA stack (../shared/tools/gpu-bundle.sh) -> /tmp/site
#   c.NN: vLLM's CPU build + test tools (scripts/device/pack-cpu-build.sh) -> /tmp/site-cpu, with
#         /tmp/cpuview: /tmp/site without the CUDA vllm package (see cpu_build_env.sh)
set -euo pipefail
cd /tmp
if ls /tmp/asm/b.* >/dev/null 2>&1; then
  cat /tmp/asm/b.* | tar -x && rm -f /tmp/asm/b.*
  python3 -m pip uninstall -y -q torchvision torchaudio || true   # built for the image's torch: break imports
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/bundle/whl/*.whl
fi
if ls /tmp/asm/c.* >/dev/null 2>&1; then
  mkdir -p /tmp/cpuwhl && cat /tmp/asm/c.* | tar -x -C /tmp/cpuwhl && rm -f /tmp/asm/c.*
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-cpu /tmp/cpuwhl/*.whl
  rm -rf /tmp/cpuview && mkdir -p /tmp/cpuview
  for entry in /tmp/site/*; do
    case "$(basename "$entry")" in vllm|vllm-*.dist-info) continue ;; esac
    ln -s "$entry" /tmp/cpuview/
  done
fi
echo "unpacked: $(ls /tmp/site | wc -l) entries in /tmp/site, $(ls /tmp/site-cpu 2>/dev/null | wc -l) in /tmp/site-cpu"
