# syntax=docker/dockerfile:1
# Qwen4-Exp serving image for 4x RTX 3090 (sm_86, CUDA 13 driver >= 580): vLLM 0.32 + our plugin.
#
#   docker build -t qwen4exp-serve:0.1.0 .
#
# - Base pinned by exact tag (pin by digest too when you mirror it: FROM nvidia/cuda:...@sha256:...).
#   vllm==0.32.0 wheels pin torch==2.13.0 built for CUDA 13, so the base is a CUDA 13 *runtime* image
#   (no toolkit); the torch/vLLM wheels bring cuBLAS, NCCL and Triton.
# - No CUDA code is compiled here: our kernels are Triton, JIT-compiled for the GPU they run on the
#   first time a shape is used (sm_86 on a 3090). TORCH_CUDA_ARCH_LIST=8.6 restricts any extension
#   build to Ampere. Triton needs a C compiler and Python headers at run time to build its small
#   launcher stubs, hence gcc/libc6-dev/python3-dev in the runtime image. Compiled kernels are cached
#   under TRITON_CACHE_DIR/VLLM_CACHE_ROOT: mount a volume there (compose: qwen4exp-cache) to keep
#   them across restarts; the first requests after a cold start pay the compilation.
# - The run-time CUDA C++ JIT users we know of are kept off (this image has no nvcc): vLLM's FlashInfer
#   sampler is off (VLLM_USE_FLASHINFER_SAMPLER=0: vLLM's own sampler), and on the upstream CUDA path
#   our subclass computes the indexer's Gemma RMS norm with vLLM's compiled op instead of FlashInfer's
#   JIT kernel (model/vllm_adapter/upstream_qsa.py).
# - Nothing is downloaded at run time and no model is baked in: mount the checkpoint read-only and
#   point QWEN4EXP_MODEL at it. HF_HUB_OFFLINE=1 makes an accidental hub lookup fail fast.
# - Host driver: CUDA 13 needs NVIDIA driver >= 580, and GeForce cards (RTX 3090) get no forward
#   compatibility. The base image's NVIDIA_REQUIRE_CUDA=cuda>=13.0 makes the NVIDIA runtime refuse
#   an older driver at container creation ("requirement error: unsatisfied condition: cuda>=13.0");
#   where that check does not run (CDI, NVIDIA_DISABLE_REQUIRE), `python -m service` runs its own
#   preflight (service/cuda_preflight.py) and exits 3 naming the driver needed and found.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04 AS base

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# ---- build: the virtual environment with pinned vLLM and our package -------------------------
FROM base AS build
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/requirements-cuda.txt /tmp/requirements-cuda.txt
RUN pip install -r /tmp/requirements-cuda.txt
WORKDIR /src
COPY pyproject.toml ./
COPY model ./model
COPY service ./service
# --no-deps: every dependency is already pinned above; the package adds only our code and the
# vllm.general_plugins entry point.
RUN pip install --no-deps . \
 && python -c "import model.plugin, service.settings, vllm; assert vllm.__version__.startswith('0.32.')"

# ---- runtime ------------------------------------------------------------------------------------
FROM base AS runtime
RUN groupadd --gid 10001 app \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/app --shell /usr/sbin/nologin app \
 && mkdir -p /home/app/.cache \
 && chown -R app:app /home/app
COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/app \
    TORCH_CUDA_ARCH_LIST=8.6 \
    TRITON_CACHE_DIR=/home/app/.cache/triton \
    VLLM_CACHE_ROOT=/home/app/.cache/vllm \
    HF_HUB_OFFLINE=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 \
    CUDA_DEVICE_ORDER=PCI_BUS_ID \
    QWEN4EXP_DEVICE=cuda \
    QWEN4EXP_HOST=0.0.0.0 \
    QWEN4EXP_PORT=8000 \
    QWEN4EXP_TENSOR_PARALLEL_SIZE=4

# Numeric, so runtimes that enforce runAsNonRoot can verify it (the chart sets runAsUser 10001 too).
USER 10001:10001
WORKDIR /home/app
EXPOSE 8000

# Readiness, not liveness: /ready answers 200 only once the engine is loaded and a 1-token
# generation succeeded recently. Loading ~20 GiB of weights per GPU plus the pinned PLE tables takes
# minutes, hence the long start period.
HEALTHCHECK --interval=30s --timeout=20s --start-period=20m --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request as u; r = u.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('QWEN4EXP_PORT', '8000'), timeout=15); sys.exit(0 if r.status == 200 else 1)"]

# SIGTERM drains in-flight requests for QWEN4EXP_DRAIN_SECONDS, then exits.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "service"]
