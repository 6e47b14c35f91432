# syntax=docker/dockerfile:1
# Qwen4-Exp serving image for 4x RTX 3090 (sm_86, CUDA 13 driver >= 580): vLLM 0.32 + our plugin.
#
#   docker build -t qwen4exp-serve:0.1.0 .
#   bash deploy/measure-image.sh qwen4exp-serve:0.1.0     # size of the image and of its layers
#
# - vLLM's own image convention: the final stage starts from NVIDIA's CUDA *base* image (the CUDA
#   runtime's cudart and the container toolkit's labels, no cuBLAS/cuDNN), because the torch and
#   vLLM wheels bring every CUDA library they load (nvidia-* wheels in deploy/requirements-cuda.txt).
#   NVIDIA_REQUIRE_CUDA=cuda>=13.0 of that base makes the NVIDIA runtime refuse a host driver too old
#   for CUDA 13 at container creation. Base pinned by exact tag (add @sha256:... when you mirror it).
# - Python 3.11, the version CI tests, installed by uv as a managed interpreter (as vLLM's image does
#   for its PYTHON_VERSION) into /opt/python; Ubuntu 24.04's own python3 is 3.12.
# - Packages: deploy/requirements-cuda.txt, hash-locked by uv's resolver for CPython 3.11 on Linux
#   x86_64 (bash deploy/lock-requirements.sh), installed with --require-hashes --no-deps, so the
#   image holds exactly the locked set. torchvision, torchaudio and torchcodec are not in it: vLLM
#   declares them, this text-only model never imports them.
# - No CUDA code is compiled here: our kernels are Triton, JIT-compiled for the GPU they run on the
#   first time a shape is used (sm_86 on a 3090). TORCH_CUDA_ARCH_LIST=8.6 restricts any extension
#   build to Ampere. Triton needs a C compiler at run time to build its small launcher stubs (the
#   managed Python brings its headers), hence gcc/libc6-dev in the runtime image. Compiled kernels
#   are cached under TRITON_CACHE_DIR/VLLM_CACHE_ROOT: mount a volume there (compose: qwen4exp-cache).
# - The run-time CUDA C++ JIT users we know of are kept off (this image has no nvcc): vLLM's FlashInfer
#   sampler is off (VLLM_USE_FLASHINFER_SAMPLER=0: vLLM's own sampler), and on the upstream CUDA path
#   our subclass computes the indexer's Gemma RMS norm with vLLM's compiled op instead of FlashInfer's
#   JIT kernel (model/upstream/qsa.py).
# - No model is baked in and serving never downloads: mount the checkpoint read-only and point
#   QWEN4EXP_MODEL at it; HF_HUB_OFFLINE=1 makes an accidental hub lookup fail fast. compose's
#   `download` profile turns it off for its one job (docs/deployment.md).
# - The root filesystem may be read-only (compose read_only, the chart's readOnlyRootFilesystem):
#   everything written goes to /home/app/.cache (a volume: caches, vLLM's config root), /tmp (a tmpfs
#   or emptyDir: Triton's launcher builds) and the metrics directory (under /tmp, or the chart's
#   emptyDir named by PROMETHEUS_MULTIPROC_DIR); no usage statistics are sent.
# - Host driver: CUDA 13 needs NVIDIA driver >= 580, and GeForce cards (RTX 3090) get no forward
#   compatibility. Where the runtime's check does not run (CDI, NVIDIA_DISABLE_REQUIRE),
#   `python -m service` runs its own preflight (service/cuda_preflight.py) and exits 3 naming the
#   driver needed and found.
FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

FROM nvidia/cuda:13.0.2-base-ubuntu24.04 AS base

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# ---- build: the interpreter and the virtual environment with the locked packages -------------
FROM base AS build
COPY --from=uv /uv /usr/local/bin/uv
RUN uv python install 3.11 && uv venv --python 3.11 /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv
COPY deploy/requirements-cuda.txt /tmp/requirements-cuda.txt
RUN uv pip install --require-hashes --no-deps -r /tmp/requirements-cuda.txt
WORKDIR /src
COPY pyproject.toml ./
COPY model ./model
COPY service ./service
# --no-deps: every dependency is already locked above; the package adds only our code and the
# vllm.general_plugins entry point.
RUN uv pip install --no-deps . \
 && python -c "import model.plugin, service.settings, vllm; assert vllm.__version__.startswith('0.32.')" \
 && python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torchvision', 'torchaudio', 'torchcodec')))"

# ---- runtime ------------------------------------------------------------------------------------
FROM base AS runtime
RUN groupadd --gid 10001 app \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/app --shell /usr/sbin/nologin app \
 && mkdir -p /home/app/.cache \
 && chown -R app:app /home/app
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/app \
    TORCH_CUDA_ARCH_LIST=8.6 \
    TRITON_CACHE_DIR=/home/app/.cache/triton \
    VLLM_CACHE_ROOT=/home/app/.cache/vllm \
    VLLM_CONFIG_ROOT=/home/app/.cache/vllm-config \
    VLLM_NO_USAGE_STATS=1 \
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
# minutes, hence the long start period: the 40-minute start-up limit (docs/deployment.md).
HEALTHCHECK --interval=30s --timeout=20s --start-period=40m --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request as u; r = u.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('QWEN4EXP_PORT', '8000'), timeout=15); sys.exit(0 if r.status == 200 else 1)"]

# SIGTERM drains in-flight requests for QWEN4EXP_DRAIN_SECONDS, then exits.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "service"]
