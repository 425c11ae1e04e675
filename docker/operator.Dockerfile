# syntax=docker/dockerfile:1
# The Graft operator: kopf, the Kubernetes client and the rollout logic. No torch, no GPU.
#
#   docker build -f docker/operator.Dockerfile -t graft/operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/graft
WORKDIR /src
COPY pyproject.toml README.md ./
COPY graft ./graft
# the `operator` extra alone: the dev cluster's packages (the `devcluster` extra) stay out of the image
RUN /opt/graft/bin/pip install ".[operator]"

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 graft \
 && useradd --system --uid 10001 --gid graft --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin graft
COPY --from=build /opt/graft /opt/graft
ENV PATH=/opt/graft/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# kopf's liveness endpoint (--liveness); the chart probes the same path
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["graft"]
CMD ["operator", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
