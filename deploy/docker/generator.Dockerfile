# Generator: vLLM rollouts with in-flight weight swaps, on a GPU node.
# The vLLM image brings CUDA, PyTorch and vLLM; the project installs on top.
# Build all four from the repository root with `docker buildx bake` (docker-bake.hcl),
# which passes the base image's digest; alone:
#   docker build -f deploy/docker/generator.Dockerfile --build-arg VLLM_DIGEST=sha256:... -t asymptote-generator .
ARG VLLM_VERSION=0.32.0
# The base image is pinned by digest: without one the reference is invalid and the build fails.
ARG VLLM_DIGEST
FROM vllm/vllm-openai:v${VLLM_VERSION}@${VLLM_DIGEST}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/asymptote
COPY pyproject.toml README.md ./
COPY asymptote ./asymptote
COPY services ./services
# vLLM is already in the base image; pip keeps it and adds the rest (the project, from the context).
# hadolint ignore=DL3013
RUN python3 -m pip install ".[generator]" \
 && groupadd --gid 10001 asymptote \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin asymptote

USER 10001:10001
ENV HOME=/tmp
EXPOSE 50061 9102
ENTRYPOINT ["asymptote"]
CMD ["generator"]
