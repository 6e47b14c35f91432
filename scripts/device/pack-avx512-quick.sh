#!/usr/bin/env bash
# Here: the small bundle for scripts/device/avx512_quick.sh, parts .gpu/mini/m.NN of 44 MiB (~18).
# vLLM's CPU build + the CUDA bundle's torch 2.13 and pure-Python deps, without the CUDA vLLM,
# FlashInfer, Triton and torchvision (nvidia_nccl_cu13 stays: the CUDA torch does not import
# without it); the project's wheel (its vLLM plugin entry point) and HEAD + checkpoints/tiny.
# Needs .gpu/wheels (../shared/tools/gpu-bundle.sh) and .gpu/cpuwhl (pack-cpu-build.sh) first.
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=$(mktemp -d); mkdir -p "$stage/whl" "$stage/cpuwhl"
for w in .gpu/wheels/*.whl; do
  case "$(basename "$w")" in vllm-0.32.0*|flashinfer*|triton-*|torchvision*) ;; *) ln -s "$PWD/$w" "$stage/whl/" ;; esac
done
.venv/bin/python -m pip wheel -q --no-deps . -w "$stage/whl"
ln -s "$PWD"/.gpu/cpuwhl/*.whl "$stage/cpuwhl/"
git archive --format=tar -o "$stage/head.tar" HEAD && tar -rf "$stage/head.tar" checkpoints/tiny
gzip "$stage/head.tar"
rm -rf .gpu/mini && mkdir -p .gpu/mini
tar -chf - -C "$stage" . | split -b 44M -d -a 2 - .gpu/mini/m.
rm -rf "$stage"
ls .gpu/mini | wc -l | xargs printf 'parts in .gpu/mini: %s (carry one per call, then run scripts/device/avx512_quick.sh)\n'
